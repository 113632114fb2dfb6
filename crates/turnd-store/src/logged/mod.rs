//! The store's commit path: a commit log ([`crate::log::CommitLog`]) in front of sled.
//! [`LoggedKv`] is the store the daemon runs on; it works on any log that keeps the
//! log's contract (`open_with_log`), and on a [`LocalLog`] in `DATA_DIR/log` (`open`).
//!
//! **Commit** ([`committer`]). A committing task encodes its batch (its log record,
//! [`codec`], and its writes in the overlay's form) and queues it. The committer thread
//! (`turnd-log-writer`) takes every queued batch (after a large group, it first sleeps
//! briefly so that more arrive), appends each as one record to the commit log, which
//! makes the group durable, puts the group's writes into the *overlay* (key → newest
//! value not yet in sled, with the lsn that wrote it) and only then answers the
//! committers. sled is not on this path.
//!
//! **Apply** ([`applier`], [`runs`], [`apply`]). The applier thread
//! (`turnd-store-applier`) writes the overlay ([`overlay`]) to sled every
//! `apply_interval`: one value per key, however often the key was written in between (a
//! turn's record, rewritten at each transition, reaches sled once), in `apply_batch`
//! calls of bounded size, the last of which also records the lsn applied under
//! [`APPLIED_KEY`]. It then drops from the overlay every entry that has not been
//! written again since. Live records wait `apply_delay` first, and a delete of a key
//! sled never got is dropped, so most turns' live records never reach sled. sled is not
//! synced per apply: when the log has something to trim, the applier flushes sled,
//! `fdatasync`s its files and only then lets the log trim what sled holds. Checkpoints
//! ([`crate::sled::Checkpoints`]) run here too, so they pause applies and store reads,
//! never commits.
//!
//! **Reads** ([`reads`]) look in the overlay first and then in sled. An entry leaves
//! the overlay only after sled has it, so a read that misses the overlay finds the
//! newest value in sled; scans merge the two.
//!
//! **Start** ([`replay`]). sled is opened, the commit log is read from the record after
//! the lsn sled last recorded as applied, and those records are written to sled
//! (coalesced by key, as the applier does), flushed and synced before the daemon
//! serves. A clean close applies and flushes everything, so the next start reads
//! nothing.
//!
//! **Failures.** A failed append of the log fails its group (`unavailable` for the
//! requests, nothing of it in memory); a failed log then refuses groups until it
//! healed, which the committer asks of it every `heal_interval`, and appends go on once
//! that worked. A failed apply or flush of sled loses nothing (the log still holds it)
//! and is tried again at the next interval; the log is not trimmed meanwhile. sled
//! refuses every write after a failed one until it is opened again, so the applier, at
//! most every `heal_interval` and once a probe write and sync in the data directory
//! work, closes sled and opens it again and writes to it what the log holds past the
//! applied mark sled recovered ([`CommitLog::read_range`]); what the old handle held
//! only in memory is written again that way. A committer or applier thread that ended
//! unexpectedly makes [`Kv::health`] fail, and so does sled failing for 10 ×
//! `heal_interval` while the disk takes writes.
//!
//! **Checkpoints** ([`checkpoint`]). A store's sled written out at its applied
//! mark, and put in place of another store's, so that a node behind what a commit
//! log still holds starts from a peer's store.
//!
//! **Follow** ([`follow`]). A warm standby applies a leader's records to a store of
//! its own with the start's code, so that a takeover opens that store and replays
//! only the rest.
//!
//! Both threads run outside any tokio runtime and time real disk work with
//! `std::time`; no tokio timer depends on them.

mod applier;
mod apply;
#[cfg(test)]
mod carry_tests;
mod checkpoint;
mod codec;
mod committer;
#[cfg(test)]
mod crash_tests;
mod follow;
#[cfg(test)]
mod follow_tests;
mod options;
mod overlay;
mod reads;
mod replay;
#[cfg(test)]
mod route_tests;
mod runs;
#[cfg(test)]
mod runs_tests;
#[cfg(test)]
mod sled_tests;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod windows_tests;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

pub use apply::APPLIED_KEY;
pub use checkpoint::{install_checkpoint, CheckpointInfo};
pub use codec::{decode, encode};
pub use follow::Follower;
pub use options::{
    LoggedOptions, DEFAULT_APPLY_DELAY_MS, DEFAULT_APPLY_INTERVAL_MS, DEFAULT_HEAL_INTERVAL_MS,
    DEFAULT_IDLE_REOPEN, DEFAULT_MARK_INTERVAL, DEFAULT_OVERLAY_BYTES, DEFAULT_OVERLAY_KEYS,
    DEFAULT_SEGMENT_KB, DEFAULT_WINDOW_CLOSE_MS,
};

use applier::applier_loop;
use committer::{committer_loop, LogJob};
use overlay::Overlay;

use crate::error::StoreError;
use crate::kv::{CommitTicket, Kv};
use crate::log::{CommitLog, LocalLog, Opened};
use crate::model::keys::Entry;
use crate::model::Batch;
use crate::sled::Shared;
use crate::stats::CommitStats;
use crate::windows::store::Windows;
use crate::windows::WindowInfo;

/// What the store asks of its applier thread.
enum Ctl {
    /// Apply everything, flush sled and trim the log, then answer.
    Flush(mpsc::Sender<Result<(), StoreError>>),
    /// The overlay is full: apply now.
    Nudge,
    /// End the applier thread, as a panic in it would (tests only).
    #[cfg(test)]
    Exit,
    /// Run one round with this delay now, then answer (tests only).
    #[cfg(test)]
    Round(Duration, mpsc::Sender<()>),
}

/// What the store's threads and its readers share.
struct Inner {
    sled: Arc<Shared>,
    /// The time windows of finished turns' records.
    windows: Windows,
    overlay: RwLock<Overlay>,
    stats: Mutex<CommitStats>,
    /// The commit log: appended to by the committer, read and trimmed by the applier.
    log: Arc<dyn CommitLog>,
    /// The committer's queue: commits, and the applier's carries (`overlay::carries`).
    /// Taken at close, which ends the committer once it took what was queued.
    tx: Mutex<Option<mpsc::Sender<LogJob>>>,
    /// The last applier error and since when it has been failing, until an apply
    /// and flush succeed again.
    apply_error: Mutex<Option<(String, Instant)>>,
    /// How long the applier may keep failing before [`Kv::health`] fails.
    apply_patience: Duration,
    /// Notified whenever the applier has dropped entries from the overlay (a full
    /// overlay makes the committer wait on it).
    applied_cv: std::sync::Condvar,
    applied_mx: Mutex<()>,
    /// Sessions whose event values are not written as one by the applier for now,
    /// with how many holds each has ([`Kv::hold_event_merges`]).
    held: Mutex<HashMap<String, u32>>,
    /// Run once by the applier right after it wrote its next slice to sled, before
    /// it drops the slice from the overlay (a test's commit between the two).
    #[cfg(test)]
    after_slice: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Run once by the applier right after its next round read where it begins,
    /// before anything else (a test's commit between the two).
    #[cfg(test)]
    after_settle: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// Run once by the next read right after it took its sources (a test's drop of a
    /// window between the two).
    #[cfg(test)]
    after_sources: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// The store: commit log in front, sled behind. See the module documentation.
pub struct LoggedKv {
    inner: Arc<Inner>,
    ctl: Mutex<Option<mpsc::Sender<Ctl>>>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    applier: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What [`LoggedKv::open`] did before serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    pub records: usize,
    pub bytes: u64,
    pub millis: u64,
}

/// The error of a lock a panicking thread left poisoned.
fn lock_err(what: &str) -> StoreError {
    StoreError::Write(format!("{what} lock poisoned"))
}

impl Inner {
    /// Whether the applier should take everything at once ([`Overlay::eager`]).
    fn eager(&self) -> bool {
        self.overlay.read().map(|o| o.eager()).unwrap_or(false)
    }

    /// Whether retention should hold back ([`Overlay::busy`]).
    fn busy(&self) -> bool {
        self.overlay.read().map(|o| o.busy()).unwrap_or(false)
    }

    /// The sessions held now ([`Kv::hold_event_merges`]).
    fn held_sessions(&self) -> HashSet<String> {
        self.held
            .lock()
            .map(|h| h.keys().cloned().collect())
            .unwrap_or_default()
    }
}

impl LoggedKv {
    /// Open (or create) the store in `dir`: sled in `dir`, the commit log in
    /// `dir/log`. Writes what the log holds past sled's applied mark to sled first.
    pub fn open(dir: &Path, opts: LoggedOptions) -> Result<(LoggedKv, Replayed), StoreError> {
        let log_dir = dir.join("log");
        LoggedKv::open_with_log(dir, opts, |applied| {
            LocalLog::open(&log_dir, opts.segment_bytes, applied).map(Opened::boxed)
        })
    }

    /// [`LoggedKv::open`] with the commit log `open_log` opens at the last lsn sled
    /// holds (any [`CommitLog`]; `dir` holds sled and the windows).
    pub fn open_with_log(
        dir: &Path,
        opts: LoggedOptions,
        open_log: impl FnOnce(u64) -> Result<Opened<Box<dyn CommitLog>>, StoreError>,
    ) -> Result<(LoggedKv, Replayed), StoreError> {
        let started = Instant::now();
        let (sled, wins, applied) = replay::open_databases(dir, &opts)?;
        let opened = open_log(applied)?;
        let log: Arc<dyn CommitLog> = Arc::from(opened.log);
        let (overlay, applied) =
            replay::replay(&sled, &wins, &*log, &opened.records, applied, &opts)?;
        let replayed = Replayed {
            records: opened.records.len(),
            bytes: opened.bytes,
            millis: started.elapsed().as_millis() as u64,
        };
        let inner = Arc::new(Inner {
            sled,
            windows: wins,
            overlay: RwLock::new(overlay),
            stats: Mutex::new(CommitStats::default()),
            log,
            tx: Mutex::new(None),
            apply_error: Mutex::new(None),
            apply_patience: opts.heal_interval.saturating_mul(10),
            applied_cv: std::sync::Condvar::new(),
            applied_mx: Mutex::new(()),
            held: Mutex::new(HashMap::new()),
            #[cfg(test)]
            after_slice: Mutex::new(None),
            #[cfg(test)]
            after_settle: Mutex::new(None),
            #[cfg(test)]
            after_sources: Mutex::new(None),
        });
        Ok((LoggedKv::start(inner, applied, opts)?, replayed))
    }

    /// Start the committer and applier threads over `inner`, whose sled holds
    /// everything up to `applied` (its overlay the rest).
    fn start(inner: Arc<Inner>, applied: u64, opts: LoggedOptions) -> Result<LoggedKv, StoreError> {
        let (tx, rx) = mpsc::channel::<LogJob>();
        *inner.tx.lock().map_err(|_| lock_err("commit queue"))? = Some(tx);
        let (ctl_tx, ctl_rx) = mpsc::channel::<Ctl>();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| StoreError::Write(format!("spawn {name}: {e}")))
        };
        let committer = {
            let inner = inner.clone();
            let nudge = ctl_tx.clone();
            spawn(
                "turnd-log-writer",
                Box::new(move || committer_loop(&inner, rx, &nudge, &opts)),
            )?
        };
        let applier = {
            let inner = inner.clone();
            spawn(
                "turnd-store-applier",
                Box::new(move || applier_loop(&inner, ctl_rx, &opts, applied)),
            )
        };
        let applier = match applier {
            Ok(a) => a,
            Err(e) => {
                // The queue's sender lives in `inner`, which the committer holds: take
                // it, or the committer waits for jobs for good, holding the log and
                // sled.
                if let Ok(mut tx) = inner.tx.lock() {
                    tx.take();
                }
                if committer.join().is_err() {
                    tracing::error!("log writer thread panicked");
                }
                return Err(e);
            }
        };
        Ok(LoggedKv {
            inner,
            ctl: Mutex::new(Some(ctl_tx)),
            committer: Mutex::new(Some(committer)),
            applier: Mutex::new(Some(applier)),
        })
    }

    /// Commit everything queued, apply it to sled, flush and sync sled, trim the
    /// log, and stop both threads. The next open then reads no log.
    pub fn close(&self) -> Result<(), StoreError> {
        drop(self.inner.tx.lock().map_err(|_| StoreError::Closed)?.take());
        if let Some(c) = self
            .committer
            .lock()
            .map_err(|_| StoreError::Closed)?
            .take()
        {
            c.join()
                .map_err(|_| StoreError::Write("log writer thread panicked".into()))?;
        }
        let flushed = self.flush_now();
        drop(self.ctl.lock().map_err(|_| StoreError::Closed)?.take());
        if let Some(a) = self.applier.lock().map_err(|_| StoreError::Closed)?.take() {
            a.join()
                .map_err(|_| StoreError::Write("applier thread panicked".into()))?;
        }
        flushed
    }

    /// Ask the applier to apply, flush and trim now, and wait for it.
    fn flush_now(&self) -> Result<(), StoreError> {
        let (reply, rx) = mpsc::channel();
        {
            let ctl = self.ctl.lock().map_err(|_| StoreError::Closed)?;
            let ctl = ctl.as_ref().ok_or(StoreError::Closed)?;
            ctl.send(Ctl::Flush(reply))
                .map_err(|_| StoreError::Closed)?;
        }
        crate::sled::blocking(|| rx.recv().map_err(|_| StoreError::Closed)?)
    }

    /// Keys written but not yet in sled.
    pub fn overlay_len(&self) -> usize {
        self.inner.overlay.read().map(|o| o.map.len()).unwrap_or(0)
    }

    /// Bytes of keys and values written but not yet in sled, as counted; checked
    /// against the overlay's entries.
    #[cfg(test)]
    fn overlay_bytes(&self) -> usize {
        let o = self.inner.overlay.read().expect("overlay");
        let counted: usize = o
            .map
            .iter()
            .map(|(k, p)| overlay::weight(k, &p.value))
            .sum();
        assert_eq!(o.bytes, counted, "the overlay's bytes as counted");
        o.bytes
    }
}

impl Drop for LoggedKv {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            if !matches!(e, StoreError::Closed) {
                tracing::error!("failed to close store: {e}");
            }
        }
    }
}

impl LoggedKv {
    /// Run one round of the applier now, with `delay` (tests only).
    #[cfg(test)]
    pub(crate) fn round_with(&self, delay: Duration) {
        let (done, wait) = mpsc::channel();
        let sent = self
            .ctl
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|c| c.send(Ctl::Round(delay, done)).is_ok()));
        assert_eq!(sent, Some(true), "applier running");
        wait.recv().expect("round done");
    }

    /// The sled database of the open window starting at `start` (tests only).
    #[cfg(test)]
    pub(crate) fn inner_window(&self, start: u64) -> Option<Arc<Shared>> {
        self.inner.windows.get(start)
    }

    /// Every key of the main database's sled (tests only).
    #[cfg(test)]
    pub(crate) fn main_keys(&self) -> Vec<Vec<u8>> {
        self.inner
            .sled
            .with(|h| {
                h.db.iter()
                    .keys()
                    .map(|k| {
                        k.map(|k| k.to_vec())
                            .map_err(|e| StoreError::Read(e.to_string()))
                    })
                    .collect()
            })
            .expect("main database")
    }

    /// Have the next read run `hook` right after it took its sources.
    #[cfg(test)]
    pub(crate) fn after_sources(&self, hook: impl FnOnce() + Send + 'static) {
        if let Ok(mut h) = self.inner.after_sources.lock() {
            *h = Some(Box::new(hook));
        }
    }
}

impl Kv for LoggedKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        reads::get(&self.inner, key)
    }

    /// A scan reads every window that can hold keys of the range.
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.scan_session(start, end, reverse, limit, Some(0))
    }

    fn scan_session(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
        from_ms: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        reads::scan_session(&self.inner, start, end, reverse, limit, from_ms)
    }

    fn scan_one(
        &self,
        start: &[u8],
        end: &[u8],
        from_ms: Option<u64>,
    ) -> Result<Option<Entry>, StoreError> {
        reads::scan_one(&self.inner, start, end, from_ms)
    }

    fn scan_window(
        &self,
        window_start: u64,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        reads::scan_window(&self.inner, window_start, start, end, limit)
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let (reply, rx) = CommitTicket::new();
        let job = LogJob::new(batch, reply);
        let sent = match self.inner.tx.lock() {
            Ok(tx) => match tx.as_ref() {
                Some(tx) => tx.send(job).map_err(|e| e.0.reply),
                None => Err(job.reply),
            },
            Err(_) => Err(job.reply),
        };
        if let Err(reply) = sent {
            if reply.send(Err(StoreError::Closed)).is_err() {
                tracing::debug!("committer went away before it learned the store is closed");
            }
        }
        rx
    }

    /// Committed batches are durable in the log already; this also writes them to
    /// sled and flushes it, so that the next start has no log to read.
    fn sync(&self) -> Result<(), StoreError> {
        self.flush_now()
    }

    fn busy(&self) -> bool {
        self.inner.busy()
    }

    fn commit_stats(&self) -> CommitStats {
        let mut s = self
            .inner
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default();
        if let Ok(o) = self.inner.overlay.read() {
            s.overlay_keys = o.map.len() as u64;
            s.overlay_bytes = o.bytes as u64;
        }
        self.inner.log.report(&mut s);
        let (parked, reopens) = self.inner.windows.counts();
        s.windows_closed = parked;
        s.window_reopens = reopens;
        s
    }

    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        reads::windows(&self.inner)
    }

    fn hold_event_merges(&self, session_id: &str) {
        if let Ok(mut h) = self.inner.held.lock() {
            *h.entry(session_id.to_string()).or_insert(0) += 1;
        }
    }

    fn release_event_merges(&self, session_id: &str) {
        if let Ok(mut h) = self.inner.held.lock() {
            if let Some(n) = h.get_mut(session_id) {
                *n -= 1;
                if *n == 0 {
                    h.remove(session_id);
                }
            }
        }
    }

    fn health(&self) -> Result<(), String> {
        let dead = |h: &Mutex<Option<std::thread::JoinHandle<()>>>, what: &str| match h.lock() {
            Ok(g) => match g.as_ref() {
                Some(t) if t.is_finished() => Err(format!("the store's {what} thread has ended")),
                _ => Ok(()),
            },
            Err(_) => Err(format!("the store's {what} thread lock is poisoned")),
        };
        dead(&self.committer, "log writer")?;
        dead(&self.applier, "applier")?;
        // sled refuses every operation after some write errors until it is opened
        // again: an applier that keeps failing needs a restart, which replays the log.
        match self.inner.apply_error.lock() {
            Ok(g) => match g.as_ref() {
                Some((e, since)) if since.elapsed() >= self.inner.apply_patience => Err(format!(
                    "writing to sled has failed for {} s (the commit log keeps every change; a restart writes it to sled): {e}",
                    since.elapsed().as_secs()
                )),
                _ => Ok(()),
            },
            Err(_) => Err("the store's applier error lock is poisoned".into()),
        }
    }
}
