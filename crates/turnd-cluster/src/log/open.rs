//! Opening a partition's log to lead it: the stream read to its end from the
//! store's applied mark with the rule applied, then this node's fence.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use turnd_store::log::{Opened, Record};

use super::append::Settled;
use super::reader::{seq_of, Reader, Step};
use super::{stream, Inner, JetStreamLog, LogConfig, State};
use crate::envelope::{encode, Head, Kind};
use crate::error::LogError;
use crate::marks::{Liveness, Marks};
use crate::nats::Nats;

/// What a read of a partition's whole stream found, the rule applied.
#[derive(Debug, Clone)]
pub struct Valid {
    /// The records of valid whole groups past the position read after.
    pub records: Vec<Record>,
    /// Their payloads' bytes.
    pub bytes: u64,
    /// The stream's first message held and its last sequence.
    pub first: u64,
    pub last: u64,
    /// The epoch after the last message.
    pub epoch: u64,
    /// Valid messages that start a group or are fences, with the epoch there.
    pub anchors: BTreeMap<u64, u64>,
    /// Messages that counted for nothing.
    pub void: u64,
}

/// Read partition `cfg.partition`'s whole stream with the rule applied, keeping
/// the records past `after` (what a start, or a checker, reads), without leading.
pub async fn read_valid(nats: &Arc<Nats>, cfg: &LogConfig, after: u64) -> Result<Valid, LogError> {
    let s = stream::ensure(nats, cfg).await?;
    read_to_end(&s, cfg, after).await
}

impl JetStreamLog {
    /// Open partition `cfg.partition`'s log for a store whose applied mark is
    /// `applied`, and lead it as `node`: read the stream to its end (the records
    /// past the mark are the [`Opened`]'s), then append a fence after the last
    /// message read. Fails with [`LogError::NotLeader`] when another writer's
    /// message took that place, and with [`LogError::Behind`] when the stream no
    /// longer holds the records after the mark. `marks`, when given, is where
    /// trims learn how far the other nodes have applied.
    ///
    /// Blocks on the connection's runtime: call it from a thread outside any
    /// runtime (as `LoggedKv::open_with_log` is, from a blocking thread).
    pub fn lead(
        nats: &Arc<Nats>,
        cfg: &LogConfig,
        node: &str,
        applied: u64,
        marks: Option<Marks>,
    ) -> Result<Opened<JetStreamLog>, LogError> {
        check_node(node)?;
        let s = nats.block_on(stream::ensure(nats, cfg))?;
        let read = nats.block_on(read_to_end(&s, cfg, applied))?;
        let stream_leader = s
            .cached_info()
            .cluster
            .as_ref()
            .and_then(|c| c.leader.clone());
        let log = JetStreamLog {
            inner: Arc::new(Inner {
                nats: nats.clone(),
                cfg: cfg.clone(),
                node: node.to_string(),
                stream: s,
                subject: stream::subject(cfg.partition),
                stop: CancellationToken::new(),
                marks,
                state: Mutex::new(State {
                    last: read.last,
                    epoch: read.epoch,
                    first_seq: read.first,
                    anchors: read.anchors,
                    failure: None,
                    void: read.void,
                    settled: 0,
                    trimmed_at: None,
                    liveness: Liveness::default(),
                    route: None,
                }),
            }),
        };
        log.route_to(stream_leader.as_deref());
        log.fence()?;
        log.follow_stream_leader();
        Ok(Opened {
            log,
            records: read.records,
            bytes: read.bytes,
        })
    }

    /// Append this node's fence after the last message read (and any void ones
    /// found after it); lead from it.
    fn fence(&self) -> Result<(), LogError> {
        loop {
            match self.try_fence()? {
                Some(seq) => self.skip_void(seq)?,
                None => return Ok(()),
            }
        }
    }

    /// One try of [`JetStreamLog::fence`]: Some(seq) when a void message took the
    /// place after the last one known.
    fn try_fence(&self) -> Result<Option<u64>, LogError> {
        let (prev, msg) = self.whole_message(Kind::Fence, &[])?;
        // The id tells this claim from any other, of this node too.
        let id = format!(
            "{}.fence.{}.{}.{prev}",
            stream::stream_name(self.inner.cfg.partition),
            self.inner.node,
            nonce()
        );
        match self.inner.nats.block_on(self.settle(prev, &id, msg)) {
            Settled::Landed(seq) => {
                let mut s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
                s.last = seq;
                s.epoch = seq;
                s.anchors.insert(seq, seq);
                tracing::info!(
                    "partition {}: {} leads from epoch {seq}",
                    self.inner.cfg.partition,
                    self.inner.node
                );
                Ok(None)
            }
            Settled::Void(seq) => Ok(Some(seq)),
            Settled::Failed(LogError::Deposed(why)) => Err(LogError::NotLeader(why)),
            Settled::Failed(e) => Err(e),
        }
    }

    /// A message of `kind` in one part, after the last one known and in this log's
    /// epoch, with that last sequence.
    fn whole_message(&self, kind: Kind, records: &[&[u8]]) -> Result<(u64, Bytes), LogError> {
        let (prev, epoch) = {
            let s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
            (s.last, s.epoch)
        };
        let head = Head {
            kind,
            partition: self.inner.cfg.partition,
            epoch,
            prev_seq: prev,
            part: 0,
            parts: 1,
            first_index: 0,
            node: self.inner.node.clone(),
        };
        Ok((prev, Bytes::from(encode(&head, records))))
    }

    /// A data message written as a deposed leader would write it, from this log's
    /// view of the stream (its epoch, its last sequence), published *without* the
    /// expected last sequence so that the server stores it wherever the stream
    /// ends. Returns the sequence it was stored at. For tests that the validity
    /// rule, not the server, voids what a deposed leader writes; it changes
    /// nothing of this log's state.
    #[doc(hidden)]
    pub fn append_unchecked_for_tests(&self, records: &[&[u8]]) -> Result<u64, LogError> {
        let (_, msg) = self.whole_message(Kind::Data, records)?;
        let id = format!("unchecked.{}", nonce());
        let out = self.inner.nats.block_on(stream::publish(
            self.inner.nats.client(),
            &self.inner.subject,
            None,
            &id,
            msg,
            self.inner.cfg.ack_timeout,
        ));
        match out {
            stream::Outcome::Stored(seq) => Ok(seq),
            o => Err(LogError::Nats(format!("unchecked publish: {o:?}"))),
        }
    }
}

/// Node ids name KV keys and message ids: letters, digits, `-` and `_`.
pub(crate) fn check_node(node: &str) -> Result<(), LogError> {
    if node.is_empty()
        || node.len() > 64
        || !node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(LogError::Config(format!(
            "node id {node:?}: 1 to 64 letters, digits, '-' or '_'"
        )));
    }
    Ok(())
}

/// A number no other claim of this process or another is likely to share.
fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Read the stream from its first message to its last, the rule applied, keeping
/// the records past `applied`.
async fn read_to_end(
    s: &async_nats::jetstream::stream::Stream,
    cfg: &LogConfig,
    applied: u64,
) -> Result<Valid, LogError> {
    let (first, last) = stream::bounds(s).await?;
    let need = seq_of(applied);
    if first > need + 1 {
        return Err(LogError::Behind {
            applied,
            first_seq: first,
        });
    }
    if need > last {
        return Err(LogError::Corrupt(format!(
            "the store's applied mark {applied} (message {need}) is past the stream's last message {last}: the stream lost messages"
        )));
    }
    let p = cfg.partition;
    let msgs = stream::read(s, p, first, last, cfg.read_timeout).await?;
    let mut r = Reader::starting_at(p, first);
    let (mut records, mut bytes) = (Vec::new(), 0u64);
    for (seq, payload) in msgs {
        if let Step::Records(recs) = r.push(seq, &payload)? {
            for rec in recs.into_iter().filter(|x| x.lsn > applied) {
                bytes += rec.payload.len() as u64;
                records.push(rec);
            }
        }
    }
    let anchors = r.take_anchors().into_iter().collect();
    Ok(Valid {
        records,
        bytes,
        first,
        last,
        epoch: r.rule().epoch(),
        anchors,
        void: r.void(),
    })
}
