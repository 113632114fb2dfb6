//! The validity rule: which messages of a partition's stream count. Every reader
//! applies it (a start's replay, a range read, a warm standby), and a leader
//! acknowledges a group only once its append is known to be valid, so no reader
//! ever sees a group counted that a client was refused, nor misses one a client
//! was answered.
//!
//! A message at stream sequence `s` is **valid** iff its `prev_seq == s - 1` (its
//! writer had seen the whole stream before it) and its `epoch` is not below the
//! current epoch. A valid fence makes `s` the epoch. An invalid message changes
//! nothing and is counted (`void`).
//!
//! So a deposed leader is harmless whatever the server lets in: its next append
//! names a `prev_seq` from before the fence that deposed it, which is not the
//! sequence before the one it lands at; and were it to learn the stream's end
//! without leading again, its epoch would be below the fence's. Nothing here
//! trusts the server's `Nats-Expected-Last-Sequence` check, which only keeps void
//! messages rare.
//!
//! A stream's first message held after a trim is taken as valid: trims purge only
//! up to a message the leader knew to be valid and to start a group or be a fence
//! (`crate::log`), so a reader that starts there takes its epoch from it.

use crate::envelope::{Head, Kind};

/// What the rule says of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Valid,
    Void,
}

/// The rule's state as a reader goes through a stream in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The current epoch: the sequence of the last valid fence.
    epoch: u64,
    /// The sequence before the next message to judge.
    last: u64,
    /// Whether the next message is the first one held after a trim, valid by
    /// construction.
    trusted_next: bool,
    /// Messages judged void so far.
    void: u64,
}

impl Rule {
    /// The rule for a reader that starts at `first_seq`, the stream's first
    /// message held (1 when nothing was ever trimmed).
    pub fn starting_at(first_seq: u64) -> Rule {
        Rule {
            epoch: 0,
            last: first_seq.saturating_sub(1),
            trusted_next: first_seq > 1,
            void: 0,
        }
    }

    /// The rule where it stands after a message known valid at `seq`, in `epoch`
    /// (a leader's own state, or a range read's start).
    pub fn after(seq: u64, epoch: u64) -> Rule {
        Rule {
            epoch,
            last: seq,
            trusted_next: false,
            void: 0,
        }
    }

    /// Judge the message at `seq` (the next one after the last judged; a gap
    /// between them is the reader's error to report, not the rule's).
    pub fn judge(&mut self, seq: u64, head: &Head) -> Verdict {
        let trusted = std::mem::take(&mut self.trusted_next);
        self.last = seq;
        let valid = trusted || (head.prev_seq + 1 == seq && head.epoch >= self.epoch);
        if !valid {
            self.void += 1;
            return Verdict::Void;
        }
        match head.kind {
            Kind::Fence => self.epoch = seq,
            Kind::Data if trusted => self.epoch = head.epoch,
            Kind::Data => {}
        }
        Verdict::Valid
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The sequence of the last message judged.
    pub fn last(&self) -> u64 {
        self.last
    }

    /// Messages judged void.
    pub fn void(&self) -> u64 {
        self.void
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: Kind, epoch: u64, prev_seq: u64) -> Head {
        Head {
            kind,
            partition: 0,
            epoch,
            prev_seq,
            part: 0,
            parts: 1,
            first_index: 0,
            node: "n".into(),
        }
    }

    /// A leader fences at 1 and writes; a second fences at 4; the first, deposed,
    /// writes on from what it saw (void), and then, having learnt the end, with its
    /// old epoch (void too).
    #[test]
    fn a_deposed_writer_counts_for_nothing_whatever_the_server_let_in() {
        let mut r = Rule::starting_at(1);
        assert_eq!(r.judge(1, &msg(Kind::Fence, 0, 0)), Verdict::Valid);
        assert_eq!(r.epoch(), 1);
        assert_eq!(r.judge(2, &msg(Kind::Data, 1, 1)), Verdict::Valid);
        assert_eq!(r.judge(3, &msg(Kind::Data, 1, 2)), Verdict::Valid);
        assert_eq!(r.judge(4, &msg(Kind::Fence, 1, 3)), Verdict::Valid);
        assert_eq!(r.epoch(), 4);
        // The first leader's next append: it saw 3 last.
        assert_eq!(r.judge(5, &msg(Kind::Data, 1, 3)), Verdict::Void);
        // Its append after it read the stream's end, still in epoch 1.
        assert_eq!(r.judge(6, &msg(Kind::Data, 1, 5)), Verdict::Void);
        // The new leader's appends.
        assert_eq!(r.judge(7, &msg(Kind::Data, 4, 6)), Verdict::Valid);
        // A fence whose writer saw only epoch 1 is void as well.
        assert_eq!(r.judge(8, &msg(Kind::Fence, 1, 7)), Verdict::Void);
        assert_eq!(r.epoch(), 4);
        assert_eq!(r.void(), 3);
    }

    #[test]
    fn the_first_message_held_after_a_trim_gives_the_epoch() {
        let mut r = Rule::starting_at(10);
        // Its prev_seq names a purged message: valid by construction.
        assert_eq!(r.judge(10, &msg(Kind::Data, 7, 9)), Verdict::Valid);
        assert_eq!(r.epoch(), 7);
        assert_eq!(r.judge(11, &msg(Kind::Data, 6, 10)), Verdict::Void);
        let mut f = Rule::starting_at(10);
        assert_eq!(f.judge(10, &msg(Kind::Fence, 3, 2)), Verdict::Valid);
        assert_eq!(f.epoch(), 10);
    }
}
