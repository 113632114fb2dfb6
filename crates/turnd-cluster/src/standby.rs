//! A warm standby of one partition: a thread that tails the partition's stream
//! from the local store's applied mark, applies the validity rule ([`crate::fence`])
//! to every message as every reader does, and hands the records of whole valid
//! groups to a [`Follower`], so that a takeover opens a store that is nearly
//! current. It reports its durable applied mark (what a node writes to the marks
//! bucket for trims) and its lag (messages the stream holds past what it applied).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turnd_store::log::Record;
use turnd_store::logged::Follower;
use turnd_store::LoggedOptions;

use crate::error::LogError;
use crate::log::reader::{seq_of, Reader, Step};
use crate::log::{stream, LogConfig};
use crate::nats::Nats;

/// Most messages a standby takes before it applies them.
const BATCH: usize = 1024;
/// How long a standby waits for a message before it looks at its stop signal.
const POLL: Duration = Duration::from_millis(200);

/// Where a standby is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StandbyStatus {
    /// The last position applied, durable in the local store.
    pub applied: u64,
    /// Messages the stream held past the last one read, when it was read (a
    /// standby that reads nothing, caught up or cut off, keeps the last figure).
    pub lag: u64,
    /// Messages that counted for nothing.
    pub void_records: u64,
    /// Why it stopped, when it stopped by itself.
    pub error: Option<String>,
    /// It stopped because the stream no longer holds the records after its mark
    /// ([`LogError::Behind`]): the store must be copied from a peer's checkpoint.
    pub behind: bool,
}

/// A running standby. See the module documentation.
pub struct Standby {
    stop: CancellationToken,
    status: Arc<Mutex<StandbyStatus>>,
    thread: Option<std::thread::JoinHandle<Result<(), LogError>>>,
}

impl Standby {
    /// Open the store in `dir` ([`Follower::open`]) and tail partition
    /// `cfg.partition`'s stream into it on a thread of its own.
    pub fn start(
        nats: &Arc<Nats>,
        cfg: &LogConfig,
        dir: &Path,
        opts: LoggedOptions,
    ) -> Result<Standby, LogError> {
        let follower = Follower::open(dir, opts).map_err(|e| LogError::Config(e.to_string()))?;
        let stop = CancellationToken::new();
        let status = Arc::new(Mutex::new(StandbyStatus {
            applied: follower.durable(),
            ..StandbyStatus::default()
        }));
        let run = Run {
            nats: nats.clone(),
            cfg: cfg.clone(),
            stop: stop.clone(),
            status: status.clone(),
            dir: dir.to_path_buf(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("turnd-standby-p{}", cfg.partition))
            .spawn(move || run.run(follower))
            .map_err(|e| LogError::Config(format!("spawn a standby: {e}")))?;
        Ok(Standby {
            stop,
            status,
            thread: Some(thread),
        })
    }

    pub fn status(&self) -> StandbyStatus {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Stop tailing and close the store, so that a takeover can open it. Returns
    /// the applied mark, or why the standby had stopped by itself.
    pub fn stop(mut self) -> Result<u64, LogError> {
        self.stop.cancel();
        self.join()?;
        Ok(self.status().applied)
    }

    fn join(&mut self) -> Result<(), LogError> {
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(LogError::Config("the standby's thread panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Err(e) = self.join() {
            tracing::debug!("standby: {e}");
        }
    }
}

/// The standby's thread.
struct Run {
    nats: Arc<Nats>,
    cfg: LogConfig,
    stop: CancellationToken,
    status: Arc<Mutex<StandbyStatus>>,
    dir: PathBuf,
}

impl Run {
    fn run(self, mut follower: Follower) -> Result<(), LogError> {
        let r = self.tail(&mut follower).and_then(|()| {
            follower
                .sync()
                .map_err(|e| LogError::Config(format!("sync the standby's store: {e}")))
        });
        if let Ok(mut s) = self.status.lock() {
            s.applied = follower.durable();
        }
        follower.close();
        if let Err(e) = &r {
            tracing::warn!(
                "partition {}: the standby in {:?} stopped: {e}",
                self.cfg.partition,
                self.dir
            );
            if let Ok(mut s) = self.status.lock() {
                s.error = Some(e.to_string());
                s.behind = matches!(e, LogError::Behind { .. });
            }
        }
        r
    }

    fn tail(&self, follower: &mut Follower) -> Result<(), LogError> {
        let p = self.cfg.partition;
        let applied = follower.applied();
        let s = self.nats.block_on(stream::ensure(&self.nats, &self.cfg))?;
        let (first, _) = self.nats.block_on(stream::bounds(&s))?;
        if first > seq_of(applied) + 1 {
            return Err(LogError::Behind {
                applied,
                first_seq: first,
            });
        }
        let mut msgs = self.nats.block_on(stream::open_tail(&s, p, first))?;
        let mut reader = Reader::starting_at(p, first);
        while !self.stop.is_cancelled() {
            let (records, lag) = self.nats.block_on(self.batch(&mut msgs, &mut reader))?;
            let fresh: Vec<Record> = records
                .into_iter()
                .filter(|r| r.lsn > follower.applied())
                .collect();
            let applied = if fresh.is_empty() {
                // Nothing to apply: what was is made durable now rather than at the
                // next message.
                follower.sync()
            } else {
                follower.apply(&fresh)
            };
            applied.map_err(|e| LogError::Config(format!("apply to the standby's store: {e}")))?;
            if let Ok(mut st) = self.status.lock() {
                // What trims may count on: the durable mark, at most a mark
                // interval behind what was applied.
                st.applied = follower.durable();
                if let Some(lag) = lag {
                    st.lag = lag;
                }
                st.void_records = reader.void();
            }
        }
        Ok(())
    }

    /// The records of the messages ready now or within `standby_linger` of the first
    /// (waiting up to [`POLL`] for the first), and the stream's lag after the last
    /// one read.
    async fn batch(
        &self,
        msgs: &mut async_nats::jetstream::consumer::pull::Ordered,
        reader: &mut Reader,
    ) -> Result<(Vec<Record>, Option<u64>), LogError> {
        let mut out = Vec::new();
        let mut lag = None;
        let first = tokio::select! {
            m = stream::next_with_pending(msgs, POLL) => m,
            () = self.stop.cancelled() => return Ok((out, lag)),
        };
        let Some(mut m) = first? else {
            // Nothing came: the lag stays what the last message said.
            return Ok((out, lag));
        };
        let until = tokio::time::Instant::now() + self.cfg.standby_linger;
        for _ in 0..BATCH {
            let (seq, payload, pending) = m;
            lag = Some(pending);
            if let Step::Records(recs) = reader.push(seq, &payload)? {
                out.extend(recs);
            }
            // What is ready now, and what comes until the batch's linger is over
            // (a zero wait still takes a message that is already here).
            let wait = until.saturating_duration_since(tokio::time::Instant::now());
            let next = tokio::select! {
                n = stream::next_with_pending(msgs, wait) => n?,
                () = self.stop.cancelled() => None,
            };
            match next {
                Some(n) => m = n,
                None => break,
            }
        }
        Ok((out, lag))
    }
}
