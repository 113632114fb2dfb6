//! Appending a committer group: split into messages only past the server's
//! `max_payload`, each published after the last one known, and settled before the
//! append returns (see the module documentation of [`super`]).

use std::time::Duration;

use bytes::Bytes;

use super::stream::{self, Outcome};
use super::{lsn, JetStreamLog};
use crate::envelope::{encode, Head, Kind, OVERHEAD, PER_RECORD};
use crate::error::LogError;

/// Bytes of a message left for the headers (`Nats-Msg-Id`, the expected last
/// sequence) and the protocol's own.
const HEADER_ROOM: usize = 512;

/// How one message of an append ended.
#[derive(Debug)]
pub(super) enum Settled {
    /// Stored at this sequence, right after the one expected: it counts.
    Landed(u64),
    /// Another writer's message took the place after the one expected, and the
    /// rule voids it (a deposed leader's that the server let in): the append is to
    /// be made again after it.
    Void(u64),
    Failed(LogError),
}

impl JetStreamLog {
    /// Bytes of records one message may carry.
    fn budget(&self) -> usize {
        self.inner
            .nats
            .max_payload()
            .saturating_sub(HEADER_ROOM + OVERHEAD + self.inner.node.len())
    }

    /// Append `group` (see [`super`]); the first record's position.
    pub(super) fn append_group(&self, group: &[&[u8]]) -> Result<u64, LogError> {
        if let Some(why) = self
            .state()
            .map_err(|e| LogError::Nats(e.to_string()))?
            .failure
            .clone()
        {
            return Err(LogError::Deposed(why));
        }
        if self.inner.stop.is_cancelled() {
            let e = LogError::Stopped("the node stopped serving the partition".into());
            self.fail(&e);
            return Err(e);
        }
        let parts = split(group, self.budget())?;
        let (epoch, mut first) = {
            let s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
            (s.epoch, None)
        };
        let n = parts.len();
        let mut index = 0u32;
        let mut k = 0;
        while let Some(part) = parts.get(k) {
            let prev = self
                .state()
                .map_err(|e| LogError::Nats(e.to_string()))?
                .last;
            let head = Head {
                kind: Kind::Data,
                partition: self.inner.cfg.partition,
                epoch,
                prev_seq: prev,
                part: k as u16,
                parts: n as u16,
                first_index: index,
                node: self.inner.node.clone(),
            };
            let msg = Bytes::from(encode(&head, part));
            let id = format!(
                "{}.{epoch}.{prev}",
                stream::stream_name(self.inner.cfg.partition)
            );
            match self.inner.nats.block_on(self.settle(prev, &id, msg)) {
                Settled::Landed(seq) => {
                    let mut s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
                    s.last = seq;
                    if k == 0 {
                        s.anchors.insert(seq, epoch);
                        first = Some(seq);
                    }
                }
                Settled::Void(seq) => {
                    self.skip_void(seq)?;
                    // A group's parts are consecutive: after a void one, it starts over.
                    (k, index, first) = (0, 0, None);
                    continue;
                }
                Settled::Failed(e) => {
                    if !matches!(e, LogError::Refused(_) | LogError::Full(_)) {
                        self.fail(&e);
                    }
                    return Err(e);
                }
            }
            index += part.len() as u32;
            k += 1;
        }
        Ok(first.map_or_else(|| self.next_lsn_now(), |s| lsn(s, 0)))
    }

    /// Go on after the void message at `seq`.
    pub(super) fn skip_void(&self, seq: u64) -> Result<(), LogError> {
        let mut s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
        s.last = seq;
        s.void += 1;
        Ok(())
    }

    fn next_lsn_now(&self) -> u64 {
        self.state().map_or(0, |s| lsn(s.last + 1, 0))
    }

    /// Publish `msg` after `prev` until it is settled: stored at `prev + 1` (by this
    /// try or an earlier one), another writer's message there (deposed), a refusal
    /// with nothing sent before in doubt, or the node's stop.
    pub(super) async fn settle(&self, prev: u64, id: &str, msg: Bytes) -> Settled {
        let doubt = std::sync::Mutex::new(None::<String>);
        tokio::select! {
            biased;
            () = self.inner.stop.cancelled() => {
                let why = doubt.lock().ok().and_then(|d| d.clone());
                self.stopped(why.as_deref().unwrap_or("not yet answered"))
            }
            s = self.settle_until_known(prev, id, msg, &doubt) => s,
        }
    }

    /// [`JetStreamLog::settle`] without the stop: noting in `doubt` why the append
    /// is in doubt, once it is.
    async fn settle_until_known(
        &self,
        prev: u64,
        id: &str,
        msg: Bytes,
        doubt: &std::sync::Mutex<Option<String>>,
    ) -> Settled {
        let cfg = &self.inner.cfg;
        let mut in_doubt = false;
        let mut pause = cfg.retry_min;
        loop {
            // The first try on the stream leader's own connection; the tries of an
            // append in doubt on the main one, which finds a server that answers.
            let direct = if in_doubt { None } else { self.publisher() };
            let outcome = stream::publish(
                direct.as_ref().unwrap_or(self.inner.nats.client()),
                &self.inner.subject,
                Some(prev),
                id,
                msg.clone(),
                cfg.ack_timeout,
            )
            .await;
            let why = match outcome {
                Outcome::Stored(seq) if seq == prev + 1 => return self.landed(seq, in_doubt),
                Outcome::Stored(seq) => return self.stored_elsewhere(prev, seq, &msg).await,
                Outcome::Refused(why) if !in_doubt => {
                    return Settled::Failed(LogError::Refused(why))
                }
                Outcome::Full(why) if !in_doubt => return Settled::Failed(LogError::Full(why)),
                Outcome::Refused(why)
                | Outcome::Full(why)
                | Outcome::WrongLast(why)
                | Outcome::InDoubt(why) => why,
            };
            if !in_doubt {
                tracing::warn!(
                    "partition {}: the append after {prev} is in doubt ({why}); sent again until settled",
                    cfg.partition
                );
            }
            in_doubt = true;
            if let Ok(mut d) = doubt.lock() {
                *d = Some(why);
            }
            let there =
                tokio::time::timeout(cfg.ack_timeout, stream::get(&self.inner.stream, prev + 1))
                    .await;
            match there {
                Ok(Ok(Some(there))) if there == msg => return self.landed(prev + 1, true),
                Ok(Ok(Some(there))) => return self.judge_other(prev, &there),
                _ => {}
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(cfg.retry_max.max(Duration::from_millis(1)));
        }
    }

    /// The server stored (or, a duplicate, had stored) the message at `seq`, not
    /// right after `prev`: it did not hold the expectation, and that copy is void.
    /// An earlier copy may be right after `prev`, and then counts; otherwise this
    /// node cannot know that it still leads.
    async fn stored_elsewhere(&self, prev: u64, seq: u64, msg: &Bytes) -> Settled {
        let there = tokio::time::timeout(
            self.inner.cfg.ack_timeout,
            stream::get(&self.inner.stream, prev + 1),
        )
        .await;
        match there {
            Ok(Ok(Some(there))) if there == *msg => self.landed(prev + 1, true),
            _ => Settled::Failed(LogError::Deposed(format!(
                "the server stored the message that follows {prev} at {seq}"
            ))),
        }
    }

    /// Another writer's message at `prev + 1`: void by the rule (the append goes on
    /// after it), or this node is deposed.
    fn judge_other(&self, prev: u64, there: &[u8]) -> Settled {
        let epoch = self.state().map_or(u64::MAX, |s| s.epoch);
        let mut rule = crate::fence::Rule::after(prev, epoch);
        match crate::envelope::decode(there) {
            Ok(m) if rule.judge(prev + 1, &m.head) == crate::fence::Verdict::Void => {
                tracing::warn!(
                    "partition {}: message {} is void by the rule ({}'s, epoch {}, after {}); appending after it",
                    self.inner.cfg.partition,
                    prev + 1,
                    m.head.node,
                    m.head.epoch,
                    m.head.prev_seq
                );
                Settled::Void(prev + 1)
            }
            Ok(m) => Settled::Failed(LogError::Deposed(format!(
                "message {} is {}'s, valid in epoch {}",
                prev + 1,
                m.head.node,
                m.head.epoch.max(prev + 1)
            ))),
            Err(e) => Settled::Failed(LogError::Deposed(format!(
                "message {} is another writer's and does not decode: {e}",
                prev + 1
            ))),
        }
    }

    fn landed(&self, seq: u64, was_in_doubt: bool) -> Settled {
        if was_in_doubt {
            if let Ok(mut s) = self.state() {
                s.settled += 1;
            }
            tracing::info!(
                "partition {}: the append in doubt was stored at {seq}",
                self.inner.cfg.partition
            );
        }
        Settled::Landed(seq)
    }

    fn stopped(&self, doubt: &str) -> Settled {
        Settled::Failed(LogError::Stopped(format!(
            "the node stopped serving the partition while an append was unsettled ({doubt})"
        )))
    }
}

/// The group's records as the messages that carry them: as few as `budget` bytes
/// of records each allows (one, unless the group is larger). A record that fits no
/// message is refused.
fn split<'a>(group: &[&'a [u8]], budget: usize) -> Result<Vec<Vec<&'a [u8]>>, LogError> {
    if group.len() > super::reader::MAX_GROUP_RECORDS {
        return Err(LogError::Refused(format!(
            "a group of {} records (at most {})",
            group.len(),
            super::reader::MAX_GROUP_RECORDS
        )));
    }
    let mut parts: Vec<Vec<&[u8]>> = vec![Vec::new()];
    let mut size = 0;
    for r in group {
        let need = r.len() + PER_RECORD;
        if need > budget {
            return Err(LogError::Refused(format!(
                "a record of {} bytes is larger than a message of the server's max_payload can carry ({budget} bytes of records)",
                r.len()
            )));
        }
        if size + need > budget {
            parts.push(Vec::new());
            size = 0;
        }
        size += need;
        if let Some(p) = parts.last_mut() {
            p.push(r);
        }
    }
    if parts.len() > usize::from(u16::MAX) {
        return Err(LogError::Refused(format!(
            "a group of {} messages",
            parts.len()
        )));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_splits_only_past_the_budget_and_a_record_too_large_is_refused() {
        let a = [1u8; 60];
        let group: Vec<&[u8]> = vec![&a, &a, &a];
        assert_eq!(split(&group, 1000).expect("split").len(), 1);
        let parts = split(&group, 130).expect("split");
        assert_eq!(parts.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 1]);
        assert!(matches!(split(&group, 50), Err(LogError::Refused(_))));
        assert_eq!(split(&[], 10).expect("empty").len(), 1);
    }
}
