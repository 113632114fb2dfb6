//! The applier thread (`turnd-store-applier`): writes the overlay to sled every
//! `apply_interval`, one value per key however often the key was written in between,
//! records how far sled got (the applied mark), lets the commit log trim what sled
//! holds durably, and keeps sled and the windows in order between rounds
//! (checkpoints, window switches, drops, parks). After a failed write it opens sled
//! again and writes what the log holds past sled's last durable mark once more.

use std::ops::Bound;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::apply::{
    applied_mark, apply_routed, apply_to_sled, drops, sync_windows, take_drop, APPLY_KEYS,
};
use super::committer::LogJob;
use super::overlay::{carries, delays, OKey, CARRIED_KINDS};
use super::replay::coalesce;
use super::runs::{drop_applied, event_runs, forget_fresh, sled_writes, Run, Taken};
use super::{lock_err, Ctl, Inner, LoggedOptions};
use crate::error::{IoOp, StoreError};
use crate::kv::CommitTicket;
use crate::model::keys;
use crate::sled::{Checkpoints, Shared, SyncMode};
use crate::windows::store::{Switch, Upkeep};

/// Most records one round carries (`overlay::carries`): at full load a round
/// settles a few thousand live records at most, so this only bounds the log a round
/// can add when more wait (the rest are left to the next rounds, which write them
/// to sled once they were carried as often as they may be).
const MAX_CARRIED_PER_ROUND: usize = 8192;

/// Most bytes of keys and values in one record of a carry (a carry of more is
/// several records, which the committer appends apart from commits, together when
/// it takes them at once), but for its first value: each record
/// stays under the largest a log takes (a JetStream message's 1 MiB by default),
/// whatever the values' sizes. A single value is no larger than the commit that
/// wrote it.
const MAX_CARRY_RECORD_BYTES: usize = 256 * 1024;

/// A settled live record a round carries: its key, the lsn the overlay held it at
/// and its value.
type Carried = (OKey, u64, Arc<[u8]>);

/// Bytes [`probe_disk`] writes.
const PROBE_BYTES: usize = 64 * 1024;

/// Write, sync and remove a small file in `dir`: Err while the disk refuses writes
/// (full, or failing).
fn probe_disk(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::FileExt;
    let path = dir.join("write-probe");
    let r = std::fs::File::create(&path)
        .and_then(|f| {
            f.write_all_at(&[0u8; PROBE_BYTES], 0)?;
            f.sync_data()
        })
        .map_err(|e| StoreError::io(IoOp::Write, "the disk still refuses writes", &e));
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::debug!("remove {path:?}: {e}");
        }
    }
    r
}

/// The applier's state between rounds.
struct Applier<'a> {
    inner: &'a Inner,
    checkpoints: Checkpoints,
    /// Everything up to this lsn is in sled (not necessarily on disk).
    applied: u64,
    /// The applied mark last written to the main database ([`Applier::write_mark`]).
    marked: u64,
    /// When it was written.
    marked_at: Instant,
    /// Windows written since they were last synced: synced before the next mark.
    unsynced: Vec<u64>,
    /// [`LoggedOptions::mark_interval`].
    mark_interval: Duration,
    /// The applied mark when sled's files were last synced: sled holds at least
    /// this much whatever happens to its handle.
    synced: u64,
    /// When sled was last opened again after failing (see [`Applier::repair`]).
    last_repair: Option<Instant>,
    heal_interval: Duration,
    /// Dropped windows whose directories are still to delete, once their drops are
    /// durable in the main database.
    closing: Vec<(u64, Arc<Shared>)>,
    upkeep: Upkeep,
    /// [`LoggedOptions::idle_reopen`].
    idle_reopen: Duration,
    /// [`LoggedOptions::window_close_after`].
    window_close_after: Option<Duration>,
    /// When the log's upkeep last failed (tried again after `heal_interval`).
    upkeep_failed: Option<Instant>,
    /// The answers to the last carry's records sent to the committer: no round
    /// carries again before they came.
    carry_tickets: Vec<CommitTicket>,
    /// After a carry failed, no round carries before this (`heal_interval` later):
    /// the records are written to sled meanwhile.
    carry_paused_until: Option<Instant>,
    /// Whether rounds carry at all: only while the log is synced before every
    /// answer (`storage.sync = "always"`). Unsynced, a carry could be the only copy
    /// of a record whose first write a synced mark has passed.
    carrying: bool,
}

/// Run once the hook a test left in `slot`, if any.
#[cfg(test)]
fn run_test_hook(slot: &std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>) {
    if let Some(hook) = slot.lock().ok().and_then(|mut h| h.take()) {
        hook();
    }
}

/// What a round reads of the overlay as it begins ([`Applier::settle`]).
struct Begun {
    committed: u64,
    settled: u64,
    /// The overlay's last key: where the walk ends (None: the overlay is empty).
    end: Option<OKey>,
    /// The window drops committed by then: start and lsn of each.
    drops: Vec<(u64, u64)>,
    /// The overlay was past a quarter of its room ([`super::overlay::Overlay::busy`]).
    busy: bool,
}

/// What a round's walk of the overlay took.
#[derive(Default)]
struct Walked {
    /// Keys written to sled (each once, however often committed).
    keys: u64,
    /// Deletes dropped instead of written (of keys only the overlay held).
    skipped: u64,
    /// Event values written as part of a later value of their session.
    merged: u64,
    /// The lowest lsn of the runs that stayed in the overlay: the mark stays before
    /// it (see `runs`).
    kept: Option<u64>,
}

impl Applier<'_> {
    /// Write the overlay to sled and drop what sled now has from it.
    ///
    /// The overlay is walked in key order in slices of [`APPLY_KEYS`], each copied
    /// under the read lock, written to sled, and dropped from the overlay where not
    /// written again since, so the copy never holds more than a slice. Entries
    /// committed meanwhile may be written too (their newer values: harmless). Only
    /// after every slice does sled get the applied mark: everything up to the lsn
    /// committed when the round began is then in sled. The walk ends at the last
    /// key the overlay held when the round began, so that a round ends however fast
    /// new keys arrive (new turns and events have ever larger keys).
    ///
    /// A write of a live record ([`delays`]) is taken only once its group is
    /// `delay` old (*settled*), and the mark is then the last settled lsn: what a
    /// start replays past it holds every write left waiting. A round that takes a
    /// window drop takes everything (a drop's window is deleted after the round, and
    /// a replay from before the drop would route keys to it). A delete of a key only
    /// the overlay held ([`Pending::fresh`]) is dropped, not written.
    fn apply(&mut self, delay: Duration) -> Result<(), StoreError> {
        let started = Instant::now();
        let Begun {
            committed,
            settled,
            end,
            drops: pending,
            busy,
        } = self.settle(started, delay)?;
        #[cfg(test)]
        run_test_hook(&self.inner.after_settle);
        self.switch_window_if_due()?;
        if committed == self.applied {
            return self.mark_if_due(false);
        }
        // Drops committed before this round began, taken once this round's writes are
        // in the windows (retention's deletes of their records among them): what they
        // still hold then moves to the main database, where their keys go from now on.
        let dropping = !pending.is_empty();
        let mark = if dropping {
            committed
        } else {
            settled.max(self.applied)
        };
        let Some(end) = end else {
            self.applied = committed;
            return self.mark_if_due(false);
        };
        // Carry only in a round that waits out the delay (not at a flush, a close or
        // while eager), with room to spare, and once the last carry was answered. A
        // carried record is in sled at no lsn, and in the log again only once its
        // carry is appended: the round's mark stays before it, chosen before the walk
        // so that its runs of event values end at that mark too (see `runs`); the
        // next round finds it at its new lsn (or written again meanwhile).
        let carried =
            if self.carrying && !delay.is_zero() && !dropping && !busy && self.carry_answered() {
                self.to_carry(mark)?
            } else {
                Vec::new()
            };
        let mark = carried.iter().map(|c| c.1).min().map_or(mark, |lsn| {
            mark.min(lsn.saturating_sub(1)).max(self.applied)
        });
        let walked = self.walk(&end, mark, dropping)?;
        self.carry(carried);
        let leftovers = self.take_drops(pending)?;
        // A run that stayed has every value after `applied` (see `event_runs`).
        let mark = walked.kept.map_or(mark, |lsn| {
            mark.min(lsn.saturating_sub(1)).max(self.applied)
        });
        self.applied = mark;
        self.mark_if_due(dropping)?;
        if let Ok(mut s) = self.inner.stats.lock() {
            s.dropped_deletes += walked.skipped;
            s.merged_event_values += walked.merged;
            s.window_leftovers += leftovers;
            s.applies += 1;
            s.applied_keys += walked.keys;
            s.apply_micros += started.elapsed().as_micros() as u64;
        }
        Ok(())
    }

    /// As a round begins: the last lsn committed, the last one settled (the groups
    /// `delay` old), the overlay's last key, where the walk ends, and the window
    /// drops it holds, all read at once. A drop committed later waits for the next
    /// round: its key (prefix `W`, the last) lies past this walk's end, so this round
    /// would not write it to sled, and deleting its window before sled holds the drop
    /// would leave a start after a power loss a window directory cut in half.
    fn settle(&self, now: Instant, delay: Duration) -> Result<Begun, StoreError> {
        let mut o = self
            .inner
            .overlay
            .write()
            .map_err(|_| lock_err("overlay"))?;
        let settled = o.settle(now, delay);
        let (s, e) = keys::dropped_range();
        let drops = drops(
            o.map
                .range::<[u8], _>((Bound::Included(&s[..]), Bound::Excluded(&e[..])))
                .map(|(k, p)| (k.as_slice(), p.lsn, p.value.is_some())),
        );
        Ok(Begun {
            committed: o.committed,
            settled,
            end: o.map.keys().next_back().cloned(),
            drops,
            busy: o.busy(),
        })
    }

    /// Whether a round may carry: the last carry was answered, and none failed in
    /// the last `heal_interval` (its records are still in the overlay, and the
    /// rounds meanwhile write them to sled).
    fn carry_answered(&mut self) -> bool {
        let now = Instant::now();
        while let Some(ticket) = self.carry_tickets.last_mut() {
            match ticket.try_answer() {
                None => return false,
                Some(answer) => {
                    if let Err(e) = answer {
                        tracing::debug!("a carry of live records failed: {e}");
                        self.carry_paused_until = Some(now + self.heal_interval);
                    }
                    self.carry_tickets.pop();
                }
            }
        }
        self.carry_paused_until.is_none_or(|until| now >= until)
    }

    /// The settled live records this round carries (`overlay::carries`), up to
    /// [`MAX_CARRIED_PER_ROUND`].
    fn to_carry(&self, mark: u64) -> Result<Vec<Carried>, StoreError> {
        let o = self.inner.overlay.read().map_err(|_| lock_err("overlay"))?;
        let mut carried = Vec::new();
        for prefix in CARRIED_KINDS {
            let kind = (
                Bound::Included(&[prefix][..]),
                Bound::Excluded(&[prefix + 1][..]),
            );
            for (k, p) in o.map.range::<[u8], _>(kind) {
                if carried.len() == MAX_CARRIED_PER_ROUND {
                    return Ok(carried);
                }
                if let (true, Some(v)) = (p.lsn <= mark && carries(k, p), &p.value) {
                    carried.push((k.clone(), p.lsn, v.clone()));
                }
            }
        }
        Ok(carried)
    }

    /// Send a round's carried records to the committer, as records of at most
    /// [`MAX_CARRY_RECORD_BYTES`] each (whether or not they are appended, the round's
    /// mark stays before them).
    fn carry(&mut self, carried: Vec<Carried>) {
        let mut records: Vec<Vec<Carried>> = Vec::new();
        let mut bytes = 0;
        for c in carried {
            let size = c.0.len() + c.2.len();
            match records.last_mut() {
                Some(r) if bytes + size <= MAX_CARRY_RECORD_BYTES => {
                    bytes += size;
                    r.push(c);
                }
                _ => {
                    bytes = size;
                    records.push(vec![c]);
                }
            }
        }
        let Ok(tx) = self.inner.tx.lock() else {
            tracing::debug!("the commit queue's lock is poisoned: nothing carried");
            return;
        };
        // Closing (no queue): the round that flushes writes them to sled.
        let Some(tx) = tx.as_ref() else {
            return;
        };
        for record in records {
            let (reply, ticket) = CommitTicket::new();
            if tx.send(LogJob::carry(record, reply)).is_err() {
                return;
            }
            self.carry_tickets.push(ticket);
        }
    }

    /// Start a new time window when one is due, but only when turns were admitted or
    /// finished (their list entries or folded records are to be written): an idle
    /// daemon makes none.
    fn switch_window_if_due(&mut self) -> Result<(), StoreError> {
        let turns_pending = {
            let o = self.inner.overlay.read().map_err(|_| lock_err("overlay"))?;
            [keys::finished_range(), keys::session_turn_range()]
                .iter()
                .any(|(s, e)| {
                    o.map
                        .range::<[u8], _>((Bound::Included(&s[..]), Bound::Excluded(&e[..])))
                        .next()
                        .is_some()
                })
        };
        if !turns_pending {
            return Ok(());
        }
        // An error: a window that could not be made left its directory, which would
        // take keys written now at the next start; nothing is written until it is
        // removed.
        match self.inner.windows.switch_if_due()? {
            // Not idle before it took its first writes.
            Switch::Made(start) => self.inner.windows.written(&mut self.upkeep, start, 0),
            Switch::NotDue => {}
            Switch::Failed(e) => {
                tracing::warn!(
                    "a new time window could not be made (nothing of it is left; tried again next round): {e}"
                );
            }
        }
        Ok(())
    }

    /// Walk the overlay up to `end` slice by slice: take each slice (the writes that
    /// wait for their delay, past `mark`, passed over), write it to sled, and drop
    /// from the overlay what sled now has.
    fn walk(&mut self, end: &OKey, mark: u64, dropping: bool) -> Result<Walked, StoreError> {
        // After the first slice, the walk goes on past the last key taken (an
        // exclusive start: past `end` the range is empty, never reversed).
        let mut from: Bound<OKey> = Bound::Unbounded;
        let mut walked = Walked::default();
        loop {
            let (slice, last) = self.take_slice(&from, end, mark)?;
            // No runs in a round that takes a window drop: its mark must be
            // everything committed, and a run that had to stay would hold it back.
            let runs = if dropping {
                Vec::new()
            } else {
                event_runs(&slice, self.applied, mark, &self.inner.held_sessions())
            };
            self.write_slice(&slice, &runs)?;
            self.drop_slice(&slice, &runs, &mut walked)?;
            // The walk ends at `end`, or when a slice stopped short of it.
            let Some(last) = last else {
                break;
            };
            from = Bound::Excluded(last);
        }
        Ok(walked)
    }

    /// A slice of up to [`APPLY_KEYS`] entries from `from` on to take (the waiting
    /// ones passed over), each with whether it is a delete only the overlay knew
    /// of, and the last key walked when the slice stopped before `end`.
    fn take_slice(
        &self,
        from: &Bound<OKey>,
        end: &OKey,
        mark: u64,
    ) -> Result<(Vec<Taken>, Option<OKey>), StoreError> {
        let o = self.inner.overlay.read().map_err(|_| lock_err("overlay"))?;
        let mut walked = 0usize;
        let mut slice = Vec::new();
        let mut gap = false;
        for (k, p) in o.map.range::<[u8], _>((
            from.as_ref().map(|k| k.as_slice()),
            Bound::Included(end.as_slice()),
        )) {
            walked += 1;
            if p.lsn <= mark || !delays(k) {
                slice.push(Taken {
                    key: k.clone(),
                    lsn: p.lsn,
                    value: p.value.clone(),
                    fresh: p.fresh,
                    pristine: p.pristine,
                    gap_before: std::mem::take(&mut gap),
                });
            } else {
                gap = true;
            }
            if slice.len() == APPLY_KEYS || walked == 4 * APPLY_KEYS {
                return Ok((slice, Some(k.clone())));
            }
        }
        Ok((slice, None))
    }

    /// Write a slice (its runs as one value each) where it belongs in sled and the
    /// windows. On a failure, its keys that sled may now hold are no longer counted
    /// as held by the overlay alone.
    fn write_slice(&mut self, slice: &[Taken], runs: &[Run]) -> Result<(), StoreError> {
        let applied = apply_routed(
            &self.inner.sled,
            &self.inner.windows,
            sled_writes(slice, runs),
        );
        let (bytes, wins) = match applied {
            Ok(done) => done,
            Err(e) => {
                let mut o = self
                    .inner
                    .overlay
                    .write()
                    .map_err(|_| lock_err("overlay"))?;
                forget_fresh(&mut o.map, slice);
                return Err(e);
            }
        };
        self.checkpoints.wrote(bytes);
        for (w, keys) in wins {
            self.inner.windows.written(&mut self.upkeep, w, keys);
            if !self.unsynced.contains(&w) {
                self.unsynced.push(w);
            }
        }
        #[cfg(test)]
        run_test_hook(&self.inner.after_slice);
        Ok(())
    }

    /// Drop from the overlay what a slice wrote to sled, where not written again
    /// since, and count it in `walked`.
    fn drop_slice(
        &self,
        slice: &[Taken],
        runs: &[Run],
        walked: &mut Walked,
    ) -> Result<(), StoreError> {
        {
            let mut o = self
                .inner
                .overlay
                .write()
                .map_err(|_| lock_err("overlay"))?;
            let held = self.inner.held_sessions();
            let (stayed, freed) = drop_applied(&mut o.map, slice, runs, &held);
            o.bytes = o.bytes.saturating_sub(freed);
            if let Some(lsn) = stayed {
                walked.kept = Some(walked.kept.map_or(lsn, |k: u64| k.min(lsn)));
            }
        }
        self.inner.applied_cv.notify_all();
        let dropped = slice.iter().filter(|e| e.dropped()).count() as u64;
        let into_others: u64 = runs.iter().map(|r| (r.last - r.first) as u64).sum();
        walked.skipped += dropped;
        walked.merged += into_others;
        walked.keys += slice.len() as u64 - dropped - into_others;
        Ok(())
    }

    /// Take the committed drops of a round, once its writes are in the windows: a
    /// drop reads what its window still holds, from sled, synced first. Returns the
    /// keys the windows passed on to the main database.
    fn take_drops(&mut self, pending: Vec<(u64, u64)>) -> Result<u64, StoreError> {
        if pending.is_empty() {
            return Ok(0);
        }
        sync_windows(&self.inner.windows, &self.unsynced)?;
        self.unsynced.clear();
        let mut leftovers = 0;
        for (start, lsn) in pending {
            let (taken, held) = take_drop(&self.inner.sled, &self.inner.windows, start, lsn)?;
            self.closing.extend(taken);
            leftovers += held;
        }
        Ok(leftovers)
    }

    /// Record the applied mark in the main database when it is `forced` (a round
    /// that took a window drop) or [`LoggedOptions::mark_interval`] has passed since
    /// the last one.
    fn mark_if_due(&mut self, forced: bool) -> Result<(), StoreError> {
        if forced || self.marked_at.elapsed() >= self.mark_interval {
            self.write_mark()?;
        }
        Ok(())
    }

    /// Flush and `fdatasync` the windows written since their last sync, then record
    /// the applied mark in the main database, so that a mark never claims what a
    /// window may not have on disk. Between marks, rounds write to sled without
    /// syncing anything: a start after a crash replays the log from the last mark
    /// that reached the disk, and its records are absolute values, so writing again
    /// what sled already held leaves the same state.
    fn write_mark(&mut self) -> Result<(), StoreError> {
        self.marked_at = Instant::now();
        if self.marked == self.applied {
            return Ok(());
        }
        sync_windows(&self.inner.windows, &self.unsynced)?;
        self.unsynced.clear();
        apply_to_sled(&self.inner.sled, std::iter::empty(), Some(self.applied))?;
        self.marked = self.applied;
        Ok(())
    }

    /// Once a log segment is wholly applied: make sled durable, then delete it.
    fn trim(&mut self, force_flush: bool) -> Result<(), StoreError> {
        if !self.closing.is_empty() {
            // The drops are in the main database (this round wrote them): make them
            // durable, then delete the windows' directories.
            let sled = &self.inner.sled;
            sled.with(|h| sled.sync_files(h))?;
            self.synced = self.marked;
            // A deletion that fails is tried again after the next round.
            let mut failed = None;
            for (start, w) in std::mem::take(&mut self.closing) {
                if let Err(e) = self.inner.windows.delete(start, w.clone()) {
                    self.closing.push((start, w));
                    failed.get_or_insert(e);
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
        }
        self.inner.windows.warm_written(&mut self.upkeep);
        self.inner
            .windows
            .snapshot_idle(&mut self.upkeep, self.idle_reopen);
        if let Some(after) = self.window_close_after {
            self.inner.windows.park_unused(&self.upkeep, after);
        }
        if !force_flush && !self.inner.log.wants_trim() {
            return Ok(());
        }
        self.write_mark()?;
        let sled = &self.inner.sled;
        sled.with(|h| sled.sync_files(h))?;
        self.synced = self.marked;
        let n = self.inner.log.trim(self.marked)?;
        if let Ok(mut s) = self.inner.stats.lock() {
            s.log_trims += n as u64;
        }
        Ok(())
    }

    /// The commit log's upkeep ([`CommitLog::upkeep`]); after a failure (a full
    /// disk), not again for `heal_interval`.
    fn log_upkeep(&mut self) {
        if self
            .upkeep_failed
            .is_some_and(|t| t.elapsed() < self.heal_interval)
        {
            return;
        }
        match self.inner.log.upkeep() {
            Ok(()) => self.upkeep_failed = None,
            Err(e) => {
                if self.upkeep_failed.is_none() {
                    tracing::warn!(
                        "the commit log's upkeep failed (tried again after heal_interval): {e}"
                    );
                }
                self.upkeep_failed = Some(Instant::now());
            }
        }
    }

    /// One round: apply (taking live records once `delay` old), then trim.
    fn round(&mut self, force_flush: bool, delay: Duration) -> Result<(), StoreError> {
        let r = self.apply(delay).and_then(|()| self.trim(force_flush));
        let mut err = self
            .inner
            .apply_error
            .lock()
            .map_err(|_| lock_err("applier error"))?;
        match &r {
            Ok(()) => {
                if err.take().is_some() {
                    tracing::info!("writing to sled works again");
                }
                self.checkpoints
                    .after_group(&self.inner.sled, &self.inner.stats);
                self.checkpoints
                    .when_idle(&self.inner.sled, &self.inner.stats, self.idle_reopen);
                self.log_upkeep();
            }
            Err(e) => {
                let since = match err.as_ref() {
                    Some((_, since)) => *since,
                    None => {
                        tracing::error!("failed to write the commit log's records to sled (the log keeps them; tried again): {e}");
                        Instant::now()
                    }
                };
                *err = Some((e.to_string(), since));
                drop(err);
                self.repair_if_due();
            }
        }
        r
    }

    /// After a failed round: open sled again ([`Applier::repair`]), at most every
    /// `heal_interval`.
    fn repair_if_due(&mut self) {
        if self
            .last_repair
            .is_some_and(|t| t.elapsed() < self.heal_interval)
        {
            return;
        }
        self.last_repair = Some(Instant::now());
        match self.repair() {
            Ok(Some(n)) => tracing::info!(
                "opened sled again after a failed write and wrote {n} records of the commit log to it again"
            ),
            Ok(None) => {
                // The disk itself refuses writes: a restart would not help, so
                // `/healthz` is not failed for it.
                if let Ok(mut err) = self.inner.apply_error.lock() {
                    if let Some((_, since)) = err.as_mut() {
                        *since = Instant::now();
                    }
                }
            }
            Err(e) => tracing::warn!("sled could not be opened again yet: {e}"),
        }
    }

    /// After a failed write sled refuses every later one until it is opened again,
    /// and what its handle held only in memory is gone with it (the same for the
    /// windows, written in the same rounds). So first the commit log's records past
    /// what sled surely has (the mark at its last sync: the log is trimmed only past
    /// that) go back into the overlay, where they were not written again since:
    /// reads find them there while sled is opened again, and the next round writes
    /// them to sled again. Then sled and every window are opened again. Returns the
    /// records read back (None: the disk still refuses a write, and sled was left as
    /// it is).
    fn repair(&mut self) -> Result<Option<usize>, StoreError> {
        let sled = &self.inner.sled;
        // Closing sled while the disk still fails would leave reads without a store
        // until it works again: first see that a write and a sync work.
        if let Err(e) = probe_disk(sled.dir()) {
            tracing::debug!("sled not opened again: {e}");
            return Ok(None);
        }
        let upto = self
            .inner
            .overlay
            .read()
            .map_err(|_| lock_err("overlay"))?
            .committed;
        let records = self.inner.log.read_range(self.synced, upto)?;
        let map = coalesce(&records)?;
        self.inner
            .overlay
            .write()
            .map_err(|_| lock_err("overlay"))?
            .refill(map);
        sled.reopen_after_failure()?;
        for (_, w) in self.inner.windows.all_open() {
            w.reopen_after_failure()?;
        }
        // The next round writes the overlay, and the mark after it.
        self.applied = self.synced.min(applied_mark(sled)?);
        self.marked = self.applied;
        self.unsynced.clear();
        Ok(Some(records.len()))
    }
}

/// The applier's thread: a round every `apply_interval` (at once while the store is
/// behind), and when the committer or the store asks, until the store closes.
pub(super) fn applier_loop(
    inner: &Inner,
    ctl: mpsc::Receiver<Ctl>,
    opts: &LoggedOptions,
    applied: u64,
) {
    let mut a = Applier {
        inner,
        checkpoints: Checkpoints::new(&opts.sled),
        applied,
        marked: applied,
        marked_at: Instant::now(),
        unsynced: Vec::new(),
        mark_interval: opts.mark_interval,
        synced: applied,
        last_repair: None,
        heal_interval: opts.heal_interval,
        closing: Vec::new(),
        upkeep: Upkeep::default(),
        idle_reopen: opts.idle_reopen,
        window_close_after: opts.window_close_after,
        upkeep_failed: None,
        carry_tickets: Vec::new(),
        carry_paused_until: None,
        carrying: opts.sled.sync == SyncMode::Always,
    };
    loop {
        // Half the overlay's room used: no pause between rounds, and no write waits
        // for its delay.
        let (pause, delay) = if inner.eager() {
            (Duration::ZERO, Duration::ZERO)
        } else {
            (opts.apply_interval, opts.apply_delay)
        };
        match ctl.recv_timeout(pause) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(e) = a.round(false, delay) {
                    tracing::debug!("apply round failed: {e}");
                }
            }
            Ok(Ctl::Nudge) => {
                if let Err(e) = a.round(false, Duration::ZERO) {
                    tracing::debug!("apply round failed: {e}");
                }
            }
            Ok(Ctl::Flush(reply)) => {
                let r = a.round(true, Duration::ZERO);
                if reply.send(r).is_err() {
                    tracing::debug!("flush requester went away");
                }
            }
            #[cfg(test)]
            Ok(Ctl::Exit) => break,
            #[cfg(test)]
            Ok(Ctl::Round(delay, done)) => {
                if let Err(e) = a.round(false, delay) {
                    tracing::debug!("apply round failed: {e}");
                }
                if done.send(()).is_err() {
                    tracing::debug!("round requester went away");
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
}
