//! Reading a partition's stream in order: each message decoded, judged by the
//! validity rule ([`crate::fence`]), and the records of each whole group handed
//! on with their positions. Used by a start's replay, range reads and a warm
//! standby alike, so all of them count the same records.
//!
//! **Positions.** A group whose first message is at stream sequence `s` gives its
//! records `lsn = (s << 20) | i`, `i` its index in the group. Positions then only
//! increase (a later group starts at a later sequence), a group's are consecutive
//! as the store needs, and a position names the message it came from (`lsn >> 20`)
//! so an applied mark says where to read from. A group holds at most 2^20 records
//! (the store's committer takes at most 4,096 batches at once).
//!
//! **Groups in parts.** A group larger than the server's `max_payload` is written
//! as consecutive messages, part `k` of `n` at the first's sequence `+ k`. Its
//! records count only once all its parts were read, valid and in a row: a group
//! cut short (its writer refused or deposed in the middle) counts for nothing.

use turnd_store::log::Record;

use crate::envelope::{decode, Kind};
use crate::error::LogError;
use crate::fence::{Rule, Verdict};

/// Bits of a position that number a record within its group.
pub const INDEX_BITS: u32 = 20;
/// Most records one group holds.
pub const MAX_GROUP_RECORDS: usize = 1 << INDEX_BITS;

/// The position of record `i` of the group whose first message is at `seq`.
pub fn lsn(seq: u64, i: u32) -> u64 {
    (seq << INDEX_BITS) | u64::from(i)
}

/// The sequence of the message a position's group starts at.
pub fn seq_of(lsn: u64) -> u64 {
    lsn >> INDEX_BITS
}

/// A group whose parts are still being read.
struct Partial {
    first_seq: u64,
    parts: u16,
    next_part: u16,
    records: Vec<Record>,
}

/// What one message was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The records of a whole group (in order; empty for an empty group).
    Records(Vec<Record>),
    /// A valid fence: the epoch is now this message's sequence.
    Fence,
    /// A part of a group not yet whole.
    Part,
    /// A message the rule voids, or a part of a group cut short.
    Void,
}

/// A reader's state. See the module documentation.
pub struct Reader {
    partition: u32,
    rule: Rule,
    partial: Option<Partial>,
    /// Valid messages that start a group or are fences, each with the epoch in
    /// force there: where a trim may cut and a read may start.
    anchors: Vec<(u64, u64)>,
    /// Parts of groups cut short.
    cut: u64,
}

impl Reader {
    /// A reader of partition `partition` whose first message is at `first_seq`.
    pub fn starting_at(partition: u32, first_seq: u64) -> Reader {
        Reader::with_rule(partition, Rule::starting_at(first_seq))
    }

    /// A reader that goes on after a message known valid at `seq`, in `epoch`, that
    /// ended a group.
    pub fn after(partition: u32, seq: u64, epoch: u64) -> Reader {
        Reader::with_rule(partition, Rule::after(seq, epoch))
    }

    fn with_rule(partition: u32, rule: Rule) -> Reader {
        Reader {
            partition,
            rule,
            partial: None,
            anchors: Vec::new(),
            cut: 0,
        }
    }

    /// The rule's state.
    pub fn rule(&self) -> &Rule {
        &self.rule
    }

    /// Messages that count for nothing: voided by the rule, or parts of a group cut
    /// short.
    pub fn void(&self) -> u64 {
        self.rule.void() + self.cut
    }

    /// The anchors read since the last [`Reader::take_anchors`].
    pub fn take_anchors(&mut self) -> Vec<(u64, u64)> {
        std::mem::take(&mut self.anchors)
    }

    /// Read the message at `seq` (the one after the last read: a gap is an error).
    pub fn push(&mut self, seq: u64, payload: &[u8]) -> Result<Step, LogError> {
        if seq != self.rule.last() + 1 {
            return Err(LogError::Nats(format!(
                "read message {seq} after {}: messages in between are missing",
                self.rule.last()
            )));
        }
        let msg = decode(payload)?;
        if msg.head.partition != self.partition {
            return Err(LogError::Corrupt(format!(
                "message {seq} of partition {}'s stream says partition {}",
                self.partition, msg.head.partition
            )));
        }
        let verdict = self.rule.judge(seq, &msg.head);
        // Whatever this message is, a group it does not continue is cut short.
        let continues = verdict == Verdict::Valid
            && msg.head.kind == Kind::Data
            && msg.head.part > 0
            && self.partial.as_ref().is_some_and(|p| {
                p.next_part == msg.head.part
                    && p.parts == msg.head.parts
                    && p.first_seq + u64::from(p.next_part) == seq
            });
        if !continues {
            if let Some(p) = self.partial.take() {
                self.cut += u64::from(p.next_part);
            }
        }
        if verdict == Verdict::Void {
            return Ok(Step::Void);
        }
        let h = &msg.head;
        if h.kind == Kind::Fence {
            self.anchors.push((seq, self.rule.epoch()));
            return Ok(Step::Fence);
        }
        if h.part > 0 && !continues {
            self.cut += 1;
            return Ok(Step::Void);
        }
        let first_seq = seq - u64::from(h.part);
        let end = h.first_index as usize + msg.records.len();
        if end > MAX_GROUP_RECORDS || h.parts == 0 || h.part >= h.parts {
            return Err(LogError::Corrupt(format!(
                "message {seq}: part {} of {} with records {}..{end}",
                h.part, h.parts, h.first_index
            )));
        }
        let records = msg
            .records
            .into_iter()
            .zip(h.first_index..)
            .map(|(payload, i)| Record {
                lsn: lsn(first_seq, i),
                payload,
            });
        let mut p = self.partial.take().unwrap_or(Partial {
            first_seq,
            parts: h.parts,
            next_part: 0,
            records: Vec::new(),
        });
        if h.part == 0 {
            self.anchors.push((seq, self.rule.epoch()));
        }
        p.records.extend(records);
        p.next_part += 1;
        if p.next_part == p.parts {
            return Ok(Step::Records(p.records));
        }
        self.partial = Some(p);
        Ok(Step::Part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{encode, Head};

    fn msg(
        kind: Kind,
        epoch: u64,
        prev: u64,
        part: u16,
        parts: u16,
        first: u32,
        recs: &[&[u8]],
    ) -> Vec<u8> {
        encode(
            &Head {
                kind,
                partition: 3,
                epoch,
                prev_seq: prev,
                part,
                parts,
                first_index: first,
                node: "n".into(),
            },
            recs,
        )
    }

    #[test]
    fn a_group_in_parts_counts_once_whole_and_not_when_cut_short() {
        let mut r = Reader::starting_at(3, 1);
        assert_eq!(
            r.push(1, &msg(Kind::Fence, 0, 0, 0, 1, 0, &[])).unwrap(),
            Step::Fence
        );
        assert_eq!(
            r.push(2, &msg(Kind::Data, 1, 1, 0, 2, 0, &[b"a", b"b"]))
                .unwrap(),
            Step::Part
        );
        let Step::Records(recs) = r.push(3, &msg(Kind::Data, 1, 2, 1, 2, 2, &[b"c"])).unwrap()
        else {
            panic!("the group is whole");
        };
        let lsns: Vec<u64> = recs.iter().map(|r| r.lsn).collect();
        assert_eq!(
            lsns,
            vec![lsn(2, 0), lsn(2, 1), lsn(2, 2)],
            "consecutive positions"
        );
        // A group of three parts whose writer stopped after the first: the next
        // group's first message cuts it.
        assert_eq!(
            r.push(4, &msg(Kind::Data, 1, 3, 0, 3, 0, &[b"x"])).unwrap(),
            Step::Part
        );
        let Step::Records(recs) = r.push(5, &msg(Kind::Data, 1, 4, 0, 1, 0, &[b"y"])).unwrap()
        else {
            panic!("a group of one");
        };
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].payload, b"y");
        assert_eq!(r.void(), 1, "the cut group's part counts for nothing");
        // A later part with no group to continue.
        assert_eq!(
            r.push(6, &msg(Kind::Data, 1, 5, 1, 2, 1, &[b"z"])).unwrap(),
            Step::Void
        );
        let anchors: Vec<u64> = r.take_anchors().iter().map(|a| a.0).collect();
        assert_eq!(anchors, vec![1, 2, 4, 5]);
    }

    #[test]
    fn a_missing_message_or_another_partitions_is_an_error() {
        let mut r = Reader::starting_at(3, 1);
        assert!(r.push(2, &msg(Kind::Fence, 0, 1, 0, 1, 0, &[])).is_err());
        let mut r = Reader::starting_at(4, 1);
        assert!(matches!(
            r.push(1, &msg(Kind::Fence, 0, 0, 0, 1, 0, &[])),
            Err(LogError::Corrupt(_))
        ));
    }
}
