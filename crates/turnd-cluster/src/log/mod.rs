//! [`JetStreamLog`]: a partition's commit log on a NATS JetStream stream, a
//! [`CommitLog`] the store runs on unchanged (`LoggedKv::open_with_log`).
//!
//! Partition `p` is the stream `TURND_P<p>` on subject `turnd.p.<p>.log` ([`stream`]),
//! file storage, `discard: new` under `max_bytes` (a full stream refuses a commit, and
//! it is refused, nothing written), replicated on `replicas` servers. Each committer
//! group is one message (several in a row only past the server's `max_payload`:
//! [`reader`]), in an envelope ([`crate::envelope`]) that carries what the validity
//! rule ([`crate::fence`]) judges. Record positions: `lsn = (seq << 20) | i`.
//!
//! **Leading** ([`JetStreamLog::lead`]): read the stream to its end from the store's
//! applied mark (the rule applied, the records past the mark handed to the store's
//! replay), then append a fence whose `prev_seq` is the last sequence read; the node
//! leads only if it landed right after it, and its sequence is the leader's epoch.
//!
//! **Appends** ([`append`]): every publish carries `Nats-Expected-Last-Sequence:
//! prev_seq` and a message id fixed by the epoch and position, and counts only when
//! it is stored at `prev_seq + 1`. Another writer's message there, or a store at
//! another sequence, means this node was **deposed**: the log fails for good
//! ([`CommitLog::health`] names it, [`CommitLog::heal`] fails) and the node must
//! stop serving the partition. A publish **in doubt** (a timeout, a lost connection,
//! no stream leader) is sent again, the same message with the same id, and the
//! sequence after `prev_seq` read back, until one of them settles it; the append
//! does not return before, so an acknowledged group always counts and a group
//! answered with an error never counts later. Only the node's stop signal
//! ([`JetStreamLog::stop`]) ends the wait, with the log failed for good. A definite
//! refusal (the stream full, a message too large) fails the group with nothing
//! written, and the log goes on.
//!
//! **Trimming** waits for the replicas: it purges only below the least applied
//! mark of the nodes seen within `replica_timeout` ([`crate::marks`]) and the
//! leader's own, and only up to a message that starts a group or is a fence (so a
//! reader starting at the first message held can take it as valid).
//!
//! The log's calls come from the store's std threads and wait on the connection's
//! own runtime ([`Nats::block_on`]); [`JetStreamLog::lead`] likewise, so a node calls
//! `LoggedKv::open_with_log` from a blocking thread.

mod append;
mod open;
pub(crate) use open::check_node;
pub mod reader;
mod route;
pub mod stream;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use turnd_store::log::{CommitLog, Record};
use turnd_store::{CommitStats, StoreError};

use crate::error::LogError;
use crate::marks::{Liveness, Marks};
use crate::nats::Nats;
pub use open::{read_valid, Valid};
pub use reader::{lsn, seq_of};
pub use stream::{stream_name, subject, LogConfig, API_TRY_TIMEOUT};

/// A partition's commit log on JetStream. Clones are handles of one log: the store
/// holds one, the node another (status, stop).
#[derive(Clone)]
pub struct JetStreamLog {
    inner: Arc<Inner>,
}

struct Inner {
    nats: Arc<Nats>,
    cfg: LogConfig,
    node: String,
    stream: async_nats::jetstream::stream::Stream,
    subject: String,
    /// The node's signal that it stops serving the partition: an append in doubt
    /// gives up, and the log fails for good.
    stop: CancellationToken,
    /// Where trims learn the other nodes' applied marks (None: only this node's).
    marks: Option<Marks>,
    state: Mutex<State>,
}

/// What the log knows of its stream.
struct State {
    /// The last sequence known: this leader's last message (its fence at first).
    last: u64,
    /// This leader's epoch: its fence's sequence.
    epoch: u64,
    /// The stream's first message held.
    first_seq: u64,
    /// Messages that start a group or are fences, from `first_seq` on, with the
    /// epoch in force there: where trims cut and range reads start.
    anchors: BTreeMap<u64, u64>,
    /// Why the log can take no more appends (deposed, stopped): for good.
    failure: Option<String>,
    /// Messages the rule voided (or groups cut short) read at open.
    void: u64,
    /// Appends that were in doubt and were settled.
    settled: u64,
    /// When a trim was last tried, and the other nodes' marks as last seen.
    trimmed_at: Option<Instant>,
    liveness: Liveness,
    /// The connection appends go out on when it is not the main one.
    route: Option<route::Route>,
}

/// What the node reads of its log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogStatus {
    pub partition: u32,
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub void_records: u64,
    pub settled_in_doubt: u64,
    /// Set once the log failed for good (deposed, or stopped in doubt).
    pub failure: Option<String>,
    /// The server whose own connection carries the appends (the stream's leader
    /// as last read); None: the node's main connection does.
    pub appends_on: Option<String>,
}

impl JetStreamLog {
    fn state(&self) -> Result<MutexGuard<'_, State>, StoreError> {
        self.inner
            .state
            .lock()
            .map_err(|_| StoreError::Write("the JetStream log's state lock is poisoned".into()))
    }

    /// The node's stop signal: once given, an append in doubt returns an error
    /// without knowing its outcome and the log fails for good. The node gives it
    /// when it stops serving the partition (its lease lost or handed over), never
    /// to refuse a client.
    pub fn stop(&self) {
        self.inner.stop.cancel();
    }

    /// The leader's epoch (its fence's sequence).
    pub fn epoch(&self) -> u64 {
        self.state().map_or(0, |s| s.epoch)
    }

    pub fn status(&self) -> LogStatus {
        let s = self.state();
        LogStatus {
            partition: self.inner.cfg.partition,
            epoch: s.as_ref().map_or(0, |s| s.epoch),
            first_seq: s.as_ref().map_or(0, |s| s.first_seq),
            last_seq: s.as_ref().map_or(0, |s| s.last),
            void_records: s.as_ref().map_or(0, |s| s.void),
            settled_in_doubt: s.as_ref().map_or(0, |s| s.settled),
            failure: match &s {
                Ok(s) => s.failure.clone(),
                Err(e) => Some(e.to_string()),
            },
            appends_on: s
                .as_ref()
                .ok()
                .and_then(|s| s.route.as_ref().map(|r| r.server.clone())),
        }
    }

    /// Whether the partition's stream still ends at a message this log wrote, so that
    /// no node fenced it since: the stream's last sequence, read from its leader
    /// (one request, within [`Nats::control`]'s bound), lies between this log's last
    /// one before and after the read (an append of its own may land meanwhile). A
    /// leader whose lease cannot be renewed because the owners bucket does not answer
    /// goes on leading while this holds: a node that takes the partition over
    /// appends its fence first.
    pub async fn still_ends_here(&self) -> Result<bool, LogError> {
        let before = self.status().last_seq;
        let stream = self.inner.stream.clone();
        let what = format!(
            "stream info of {}",
            stream::stream_name(self.inner.cfg.partition)
        );
        let info = self
            .inner
            .nats
            .control(&what, async move { stream.get_info().await })
            .await?
            .map_err(|e| LogError::nats(&what, e))?;
        let after = self.status().last_seq;
        let last = info.state.last_sequence;
        Ok(self.status().failure.is_none() && before <= last && last <= after)
    }

    /// Fail the log for good with `why`.
    fn fail(&self, why: &LogError) {
        if let Ok(mut s) = self.state() {
            if s.failure.is_none() {
                tracing::error!(
                    "partition {}: the commit log stops taking appends: {why}",
                    self.inner.cfg.partition
                );
                s.failure = Some(why.to_string());
            }
        }
    }

    /// The records with `after < lsn <= upto`, read from the anchor at or before
    /// `after`'s message with the rule applied from there.
    fn read_between(&self, after: u64, upto: u64) -> Result<Vec<Record>, LogError> {
        let (start, to) = {
            let s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
            // The records right after `after` are in its message or the next one.
            let held = seq_of(after) + 1 >= s.first_seq;
            let start = s
                .anchors
                .range(..=seq_of(after).max(s.first_seq))
                .next_back();
            (start.filter(|_| held).map(|(a, _)| *a), s.last)
        };
        let Some(start) = start else {
            return Err(LogError::Nats(format!(
                "records after {after} are not held (trimmed)"
            )));
        };
        let p = self.inner.cfg.partition;
        let msgs = self.inner.nats.block_on(stream::read(
            &self.inner.stream,
            p,
            start,
            to,
            self.inner.cfg.read_timeout,
        ))?;
        let mut r = reader::Reader::starting_at(p, start);
        let mut out = Vec::new();
        for (seq, payload) in msgs {
            if let reader::Step::Records(recs) = r.push(seq, &payload)? {
                out.extend(recs.into_iter().filter(|x| x.lsn > after && x.lsn <= upto));
            }
        }
        if out.last().map(|r| r.lsn) != Some(upto) {
            return Err(LogError::Nats(format!(
                "records {after} to {upto} are not all in the stream"
            )));
        }
        Ok(out)
    }

    /// Purge what every node seen within `replica_timeout` has applied, up to an
    /// anchor at or before `applied` (this node's mark). Returns the messages purged.
    fn trim_to(&self, applied: u64) -> Result<usize, LogError> {
        let p = self.inner.cfg.partition;
        // A leader that stops (hands over, lost its lease) or was deposed no longer
        // knows what the partition's next leader needs: it leaves the stream alone.
        if self.inner.cfg.keep_all || self.inner.stop.is_cancelled() || self.is_failed() {
            return Ok(0);
        }
        let mut least = applied;
        if let Some(marks) = &self.inner.marks {
            let seen = self.inner.nats.block_on(marks.all(p))?;
            if marks.missing_required(p, &self.inner.node, &seen) {
                return Ok(0);
            }
            let mut s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
            let now = Instant::now();
            for m in s
                .liveness
                .live(&seen, &self.inner.node, now, self.inner.cfg.replica_timeout)
            {
                least = least.min(m);
            }
        }
        let (cut, first) = {
            let s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
            let cut = s
                .anchors
                .range(..=seq_of(least))
                .next_back()
                .map(|(a, _)| *a);
            (cut, s.first_seq)
        };
        let Some(cut) = cut.filter(|c| *c > first) else {
            return Ok(0);
        };
        let purged = self
            .inner
            .nats
            .block_on(stream::purge_below(&self.inner.stream, cut))?;
        let mut s = self.state().map_err(|e| LogError::Nats(e.to_string()))?;
        s.anchors = s.anchors.split_off(&cut);
        s.first_seq = cut;
        Ok(purged as usize)
    }
}

impl CommitLog for JetStreamLog {
    fn next_lsn(&self) -> u64 {
        self.state().map_or(0, |s| lsn(s.last + 1, 0))
    }

    /// Every append is replicated, and synced as the servers are configured to
    /// (`sync_interval: always`, checked at start: [`crate::checks`]), before it is
    /// acknowledged: `sync` changes nothing.
    fn append(&self, group: &[&[u8]], _sync: bool) -> Result<u64, StoreError> {
        self.append_group(group).map_err(StoreError::from)
    }

    fn is_failed(&self) -> bool {
        self.state().map_or(true, |s| s.failure.is_some())
    }

    /// A refused group left nothing and an append in doubt never returns unsettled,
    /// so there is nothing to heal; a log deposed or stopped stays failed.
    fn heal(&self) -> Result<(), StoreError> {
        match &self.state()?.failure {
            Some(why) => Err(StoreError::Write(why.clone())),
            None => Ok(()),
        }
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn read_range(&self, after: u64, upto: u64) -> Result<Vec<Record>, StoreError> {
        if upto <= after {
            return Ok(Vec::new());
        }
        self.read_between(after, upto).map_err(StoreError::from)
    }

    fn wants_trim(&self) -> bool {
        self.state().is_ok_and(|s| {
            s.anchors.len() > self.inner.cfg.trim_every
                && s.trimmed_at
                    .is_none_or(|t| t.elapsed() >= self.inner.cfg.trim_interval)
        })
    }

    fn trim(&self, applied: u64) -> Result<usize, StoreError> {
        if let Ok(mut s) = self.state() {
            s.trimmed_at = Some(Instant::now());
        }
        self.trim_to(applied).map_err(StoreError::from)
    }

    fn report(&self, stats: &mut CommitStats) {
        if let Ok(s) = self.state() {
            stats.log_segments = (s.last + 1).saturating_sub(s.first_seq);
        }
    }

    fn health(&self) -> Result<(), String> {
        match self.state() {
            Ok(s) => s.failure.clone().map_or(Ok(()), |why| {
                Err(format!(
                    "partition {}'s commit log takes no more appends: {why}",
                    self.inner.cfg.partition
                ))
            }),
            Err(e) => Err(e.to_string()),
        }
    }
}
