//! Retention: terminal turns older than `retention_terminal_ms` are deleted.
//!
//! A sweep runs every `retention_sweep_interval_ms`. It reads finished turns' folded
//! records in key order (turn ids are UUIDv7, so oldest first) and stops at the first
//! turn created after the cutoff (`now - retention_terminal_ms`): a turn cannot have
//! finished before it was created. It gathers the terminal turns among them whose
//! `finished_at_ms` is at or before the cutoff (up to [`SWEEP_BATCH`] at a time),
//! groups them by session and deletes each session's in one durable batch (up to
//! [`SESSIONS_AT_ONCE`] sessions at the same time, whose batches share group
//! commits), with everything that belongs to them alone:
//!
//! - its folded record;
//! - its idempotency key (when it still names this turn), so the key can be used
//!   again;
//! - its invocations (the last one from the record, the others under their own keys,
//!   found by the dispatch time their ids begin with: [`early_invocations`]);
//! - its place in the session's turn list and its events, unless they are left to
//!   the drop of its time window ([`left_to_window`]: its keys are in an open window
//!   and it comes before the session's first unfinished turn). Reads pass over the
//!   entries and events of turns that are no longer stored (`turn.list`,
//!   `Store::events`), and a window's drop deletes its directory whole, so deleting
//!   them key by key would only load the applier (it about doubled its sled writes
//!   under retention at full load). Otherwise, the session's stored event values are
//!   read from the first up to the first value written after the cutoff; a value
//!   whose events all belong to turns that are gone is deleted, one that mixes them
//!   with events of turns that remain is written again with the remaining events
//!   only.
//!
//! The session meta's counts drop by the deleted turns. A session left with no turn at
//! all, no unfinished work, no watcher and no timer is forgotten: its meta, every
//! entry of its turn list and every remaining event value are deleted and its cell
//! leaves memory, so `session.inspect` answers `not_found`, and a later submit starts
//! it again from `seq` 1 with nothing of the old session left to read. Unfinished
//! turns are never deleted, however old.
//!
//! **Windows.** After the deletions, a window that holds no stored turn any more
//! ([`empty_windows`]) is dropped, with, in the same batch, its event values that
//! also hold events of an older turn still stored written again without the others
//! ([`rescue`]).
//!
//! **No stalls.** Everything a sweep reads (turn records, idempotency keys, event
//! values) is read *without* the session's lock, on a blocking thread, at most
//! [`READS_AT_ONCE`] reads at a time: a read that waits for sled (an apply round or a
//! checkpoint holding it) delays the sweep, never the session, and the sweep's
//! decoding takes no more than that many threads' share of the cores from live work.
//! The lock is taken only to check that nothing changed what was read and to commit.
//! A terminal turn changes only with a transition of its session, and every
//! transition appends an event, so the check is the session's last event `seq`: when
//! it moved since the reads, the events written since are read (again
//! without the lock) and the sweep leaves the session for the next sweep if any of
//! them is about a turn it meant to delete (a late result amending it); otherwise it
//! checks again. After a few rounds of a very busy session, that last read is done
//! under the lock.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::RuntimeFlavor;
use turnd_store::{keys, windows, SessionKeys, Store, StoreError};

use super::Engine;
use crate::machine::{self, Tx};
use crate::metrics::Counters;
use crate::session::SessionState;
use crate::sessions::SessionCell;

mod drops;
mod invocations;
mod plan;

use drops::{empty_windows, rescue, Open};
use invocations::{early_invocations, stale_invocations, Early};
use plan::{all_list_keys, delete_all_events, gather, plan, touched, Expired, Planned};

/// Sessions whose expired turns a sweep deletes at the same time.
const SESSIONS_AT_ONCE: usize = 64;
/// Times the lock-free check of a session's new events is repeated before it is done
/// under the lock.
const RECHECKS: usize = 4;
/// Longest a sweep holds back one session's deletes while the store is behind
/// ([`turnd_store::Kv::busy`]), so that under a load that keeps it behind the sweep
/// still moves on.
const HOLD_BACK_MAX: Duration = Duration::from_millis(20);

/// Store reads of retention running at the same time. The [`SESSIONS_AT_ONCE`]
/// sessions' reads (turn records, event values: JSON and LZ4 to decode) once each ran
/// on a blocking thread of its own: at the first sweep under full load, dozens of
/// threads busy decoding took the two cores from the runtime's workers and the log
/// writer, and no turn completed for 50 – 175 ms at a time (`docs/benchmarks.md`).
/// With two at a time that is gone and the sweeps still keep up with 10k turns/s;
/// with one they fell behind it. The sessions' locks and commits still overlap.
pub(super) const READS_AT_ONCE: usize = 2;

/// A hold on merging a session's event values in the store, released when dropped
/// (on every way out of a sweep of the session).
struct MergeHold<'a> {
    kv: &'a Arc<dyn turnd_store::Kv>,
    session_id: &'a str,
}

impl<'a> MergeHold<'a> {
    fn new(kv: &'a Arc<dyn turnd_store::Kv>, session_id: &'a str) -> MergeHold<'a> {
        kv.hold_event_merges(session_id);
        MergeHold { kv, session_id }
    }
}

impl Drop for MergeHold<'_> {
    fn drop(&mut self) {
        self.kv.release_event_merges(self.session_id);
    }
}

impl Engine {
    /// Start the sweep task (nothing when retention is off).
    pub(super) fn spawn_retention(&self) {
        let cfg = &self.inner.cfg;
        if cfg.retention_terminal_ms == 0 {
            return;
        }
        let every = Duration::from_millis(cfg.retention_sweep_interval_ms.max(1));
        self.every(every, |engine| async move {
            match engine.sweep().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!("retention deleted {n} terminal turns"),
                Err(e) => {
                    tracing::warn!("retention sweep failed (tried again at the next one): {e}")
                }
            }
        });
    }

    /// Run a function that reads the store: on the blocking pool of a multi-threaded
    /// runtime (a sled read may wait for an apply round or a checkpoint), at most
    /// [`READS_AT_ONCE`] at a time; inline elsewhere (tests on a current-thread
    /// runtime).
    async fn off_runtime<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
        if !multi {
            return f();
        }
        let _turn = self
            .inner
            .retention_reads
            .acquire()
            .await
            .map_err(|e| StoreError::Read(format!("retention read turn: {e}")))?;
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| StoreError::Read(format!("retention read task: {e}")))?
    }

    /// One sweep: delete every terminal turn that finished `retention_terminal_ms` or
    /// more ago. Returns how many turns it deleted. Its time is counted
    /// (`Counters::retention_sweep_micros`).
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let started = tokio::time::Instant::now();
        let r = self.sweep_once().await;
        Counters::add_time(
            &self.inner.counters.retention_sweep_micros,
            started.elapsed(),
        );
        r
    }

    async fn sweep_once(&self) -> Result<u64, StoreError> {
        let keep = self.inner.cfg.retention_terminal_ms;
        if keep == 0 {
            return Ok(0);
        }
        let cutoff = self.now_ms().saturating_sub(keep);
        let mut from = Store::FIRST.to_vec();
        let mut deleted = 0;
        // Only this task drops windows, after the deletions: the open ones stay open
        // while it deletes.
        let store = self.inner.store.clone();
        let open = Arc::new(self.off_runtime(move || Open::read(&store)).await?);
        let store = self.inner.store.clone();
        // Invocation ids carry the wall clock's time of their dispatch, and the
        // engine's clock may have drifted from it since the start: the later bound.
        let minted = windows::now_ms().saturating_sub(keep).max(cutoff);
        let early = Arc::new(
            self.off_runtime(move || early_invocations(&store, minted))
                .await?,
        );
        loop {
            let store = self.inner.store.clone();
            let (by_session, next) = self
                .off_runtime(move || gather(&store, from, cutoff))
                .await?;
            // Sessions at once: each waits for its lock (behind the session's own
            // transitions) and for a durable commit, which many share.
            let mut running = tokio::task::JoinSet::new();
            let mut failed = None;
            let mut join = |r: Result<Result<u64, StoreError>, tokio::task::JoinError>| match r {
                Ok(Ok(n)) => deleted += n,
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(StoreError::Write(format!("retention task: {e}")));
                }
            };
            for (sid, turns) in by_session {
                while running.len() >= SESSIONS_AT_ONCE {
                    if let Some(r) = running.join_next().await {
                        join(r);
                    }
                }
                self.hold_back().await;
                let engine = self.clone();
                let (open, early) = (open.clone(), early.clone());
                running.spawn(async move { engine.expire(&sid, turns, cutoff, open, early).await });
            }
            while let Some(r) = running.join_next().await {
                join(r);
            }
            if let Some(e) = failed {
                return Err(e);
            }
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        // Invocations of turns that are gone by other ways (deleted key by key, whose
        // events named them) or were left behind: deleted when still there.
        let store = self.inner.store.clone();
        let stale = self
            .off_runtime(move || stale_invocations(&store, &early))
            .await?;
        if !stale.is_empty() {
            self.inner.store.commit(stale).await?;
        }
        let store = self.inner.store.clone();
        for w in self
            .off_runtime(move || empty_windows(&store, windows::now_ms()))
            .await?
        {
            let store = self.inner.store.clone();
            let start = w.start_ms;
            let mut b = self.off_runtime(move || rescue(&store, &w)).await?;
            b.drop_window(start);
            self.inner.store.commit(b).await?;
            self.inner
                .counters
                .windows_dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!("dropped the time window starting at {start}");
        }
        Ok(deleted)
    }

    /// Wait while the store is behind, at most [`HOLD_BACK_MAX`]: retention's deletes
    /// then wait rather than fill the room that live commits need.
    async fn hold_back(&self) {
        let started = tokio::time::Instant::now();
        let until = started + HOLD_BACK_MAX;
        while self.inner.store.kv().busy() && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Counters::add_time(
            &self.inner.counters.retention_held_back_micros,
            started.elapsed(),
        );
    }

    /// Lock the session once no event after `seen` is about a turn of `gone` (checked
    /// without the lock, a few times, then under it). None: one is, the session is
    /// left to the next sweep (a late result changed one of them).
    async fn lock_untouched<'a>(
        &self,
        cell: &'a Arc<SessionCell>,
        sid: &str,
        mut seen: u64,
        gone: &Arc<HashSet<String>>,
    ) -> Result<Option<tokio::sync::MutexGuard<'a, SessionState>>, StoreError> {
        let mut rechecks = 0;
        loop {
            let st = self.sessions().lock(cell).await?;
            let now = st.meta.last_event_seq;
            if now == seen {
                return Ok(Some(st));
            }
            if rechecks == RECHECKS {
                if touched(&self.inner.store, st.meta.keys(), seen, gone)? {
                    return Ok(None);
                }
                return Ok(Some(st));
            }
            let from_ms = st.meta.routed_from_ms;
            drop(st);
            rechecks += 1;
            let (store, owned_sid, g) = (self.inner.store.clone(), sid.to_string(), gone.clone());
            let s = move || {
                let keys = SessionKeys {
                    id: &owned_sid,
                    from_ms,
                };
                touched(&store, keys, seen, &g)
            };
            if self.off_runtime(s).await? {
                return Ok(None);
            }
            seen = now;
        }
    }

    /// Delete the expired turns of one session (see the module doc). The store keeps
    /// the session's event values under their keys meanwhile
    /// ([`turnd_store::Kv::hold_event_merges`]): the plan reads them and writes them
    /// again under those keys.
    async fn expire(
        &self,
        sid: &str,
        expired: Vec<Expired>,
        cutoff: u64,
        open: Arc<Open>,
        early: Arc<Early>,
    ) -> Result<u64, StoreError> {
        let _hold = MergeHold::new(self.inner.store.kv(), sid);
        let cell = self.sessions().cell(sid);
        let (planned_at, at, from_ms) = {
            let st = self.sessions().lock(&cell).await?;
            let m = &st.meta;
            let at = Planned {
                counts: m.counts.clone(),
                active_from: m.active_from,
                open,
                early,
            };
            (m.last_event_seq, at, m.routed_from_ms)
        };
        let store = self.inner.store.clone();
        let owned_sid = sid.to_string();
        let plan = self
            .off_runtime(move || {
                let s = SessionKeys {
                    id: &owned_sid,
                    from_ms,
                };
                plan(&store, s, expired, cutoff, &at)
            })
            .await?;
        if plan.gone.is_empty() {
            return Ok(0);
        }
        let gone = Arc::new(plan.gone);

        // Under the lock only if nothing touched the turns since the reads.
        let Some(mut st) = self.lock_untouched(&cell, sid, planned_at, &gone).await? else {
            return Ok(0);
        };

        let mut tx = Tx::new(&st, self.now_ms());
        let gone_of_it = machine::Expiry {
            statuses: &plan.statuses,
            pruned: plan.pruned,
            watched: self.inner.watches.watched(sid),
        };
        let verdict = machine::expired(&self.ctx(&st), &mut tx, gone_of_it);
        let forget = verdict == machine::ExpiryVerdict::Forgotten;
        let mut b = plan.batch;
        if forget {
            match (plan.all_values, plan.all_entries) {
                // Read when the counts were what they are now (the last event seq
                // did not move since), so these are all of them.
                (Some(values), Some(entries)) if planned_at == st.meta.last_event_seq => {
                    for k in values.into_iter().chain(entries) {
                        b.delete(k);
                    }
                }
                _ => {
                    delete_all_events(&self.inner.store, st.meta.keys(), &mut b)?;
                    for k in all_list_keys(&self.inner.store, st.meta.keys())? {
                        b.delete(k);
                    }
                }
            }
            b.delete(keys::session_meta(sid));
        } else {
            b.put_session_meta(&tx.meta);
        }
        self.inner.store.commit(b).await?;
        self.inner
            .counters
            .turns_expired
            .fetch_add(gone.len() as u64, std::sync::atomic::Ordering::Relaxed);

        if forget {
            // Before the lock goes: a new turn of the session starts at `seq` 1.
            self.inner.store.forgot_session(sid);
        }
        tx.apply(&mut st);
        machine::uncount(&mut self.inner.counts.lock(), &plan.statuses);
        drop(st);
        if forget {
            self.sessions().forget(sid, &cell);
        }
        Ok(gone.len() as u64)
    }
}

#[cfg(test)]
mod tests;
