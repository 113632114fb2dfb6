//! The committer thread (`turnd-log-writer`): every commit passes through it. It
//! takes the queued batches as one group (after a large group, it first sleeps
//! briefly so that more arrive: [`gather`]), appends them to the commit log, which
//! makes the group durable, puts the group's writes into the overlay and only then
//! answers the committers. sled is not on this path.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::codec::encode;
use super::overlay::{OKey, Write};
use super::{lock_err, Ctl, Inner, LoggedOptions};
use crate::error::StoreError;
use crate::kv::CommitReply;
use crate::model::{Batch, KvOp};
use crate::sled::SyncMode;

/// A group commit whose write and `fdatasync` of the commit log take this long is
/// logged as a warning: no commit completes meanwhile (each is one `sync_duration`
/// histogram sample as well). Syncs from [`NOTED_SYNC`] on are logged at debug
/// level, so that a trace can set each beside an interval with no completed turn.
const SLOW_SYNC: Duration = Duration::from_millis(100);
/// See [`SLOW_SYNC`].
const NOTED_SYNC: Duration = Duration::from_millis(10);

/// Largest number of batches one group commit takes.
const MAX_GROUP: usize = 4096;

/// A batch on its way to the committer thread, already in the two forms the thread
/// needs: its log record ([`encode`]) and its writes as the overlay holds them. The
/// committing task prepares both (see [`LogJob::new`]), so the one thread every
/// commit passes through only frames, writes, syncs and publishes.
pub(super) struct LogJob {
    /// Boxed by the committing task, so that the box goes back to be freed there
    /// with the buffers it holds (see [`Spent`]).
    spent: Box<Spent>,
    pub(super) reply: CommitReply,
    /// A carry from the applier ([`LogJob::carry`]): the lsn at which the overlay
    /// held each write's value when the applier took it; empty for a commit.
    expect: Vec<u64>,
}

/// A job's buffers, sent back with its answer once the committer is done with them
/// (see `CommitReply::send_spent`): its log record, and its writes' slots, which
/// then hold the overlay values the group replaced (every write replaces at most
/// one).
struct Spent {
    record: Vec<u8>,
    /// Each write's key, value and whether it creates the key.
    writes: Vec<Write>,
}

impl LogJob {
    pub(super) fn new(batch: Batch, reply: CommitReply) -> LogJob {
        let record = encode(&batch);
        let (ops, created) = batch.into_parts();
        let writes = ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| match op {
                KvOp::Put(k, v) => (OKey::from_vec(k), Some(Arc::from(v)), created.contains(&i)),
                KvOp::Delete(k) => (OKey::from_vec(k), None, false),
            })
            .collect();
        LogJob {
            spent: Box::new(Spent { record, writes }),
            reply,
            expect: Vec::new(),
        }
    }

    /// The applier's carry of settled live records (`overlay::carries`): each key,
    /// the lsn of the value the overlay held when the applier took it, and that
    /// value. The committer appends the values still held at those lsns as one
    /// record, first in its group ([`Committer::prepare_carries`]).
    pub(super) fn carry(entries: Vec<(OKey, u64, Arc<[u8]>)>, reply: CommitReply) -> LogJob {
        let (writes, expect) = entries
            .into_iter()
            .map(|(k, lsn, v)| ((k, Some(v), false), lsn))
            .unzip();
        LogJob {
            spent: Box::new(Spent {
                record: Vec::new(),
                writes,
            }),
            reply,
            expect,
        }
    }

    fn is_carry(&self) -> bool {
        !self.expect.is_empty()
    }
}

/// Wait while the overlay is full ([`super::LoggedOptions::overlay_keys`] keys or
/// [`super::LoggedOptions::overlay_bytes`] bytes), asking the applier
/// to run now, and count the wait in the commit stats. Err when no room came within
/// `patience`: the applier is stuck or failing, and the group is refused rather than
/// left waiting for good.
fn wait_for_room(
    inner: &Inner,
    nudge: &mpsc::Sender<Ctl>,
    patience: Duration,
) -> Result<(), StoreError> {
    let full = || inner.overlay.read().map(|o| o.full()).unwrap_or(false);
    let waiting = || inner.overlay.read().map(|o| o.map.len()).unwrap_or(0);
    if !full() {
        return Ok(());
    }
    let start = Instant::now();
    let give_up = start + patience;
    while full() {
        if Instant::now() >= give_up {
            return Err(StoreError::Write(format!(
                "sled behind the commit log has taken nothing for {} ms; {} keys wait for it",
                patience.as_millis(),
                waiting()
            )));
        }
        if nudge.send(Ctl::Nudge).is_err() {
            // Nothing will take the overlay's keys to sled any more: refuse rather
            // than let it grow with every commit.
            return Err(StoreError::Write(format!(
                "the store's applier thread has ended; {} keys wait for sled",
                waiting()
            )));
        }
        let Ok(g) = inner.applied_mx.lock() else {
            break;
        };
        // A timeout, so that a notification between the check and the wait is not
        // missed for long.
        if inner
            .applied_cv
            .wait_timeout(g, Duration::from_millis(10))
            .is_err()
        {
            break;
        }
    }
    if let Ok(mut s) = inner.stats.lock() {
        s.room_waits += 1;
        s.room_wait_micros += start.elapsed().as_micros() as u64;
    }
    Ok(())
}

/// Groups of at least this many batches make the next group wait for more.
const GATHER_FROM: usize = 4;
/// The longest a group waits for more batches.
const GATHER_MAX: Duration = Duration::from_millis(1);
/// How long a group waits for more batches while the process keeps the machine's
/// cores busy, in writes and syncs of the previous group (otherwise once).
const GATHER_BUSY_SYNCS: u32 = 2;
/// The share of all cores the process used over the last [`CPU_SAMPLE`] from which
/// it counts as keeping them busy.
const GATHER_BUSY_SHARE: f64 = 0.85;
/// How often the committer samples the process's CPU time.
const CPU_SAMPLE: Duration = Duration::from_millis(20);

/// A sleep that grew the group by less than this share on average (batches it
/// brought, against those taken before it) is not worth its wait.
const GATHER_GAIN_MIN: f64 = 0.5;
/// While sleeping does not pay, every this many large groups sleeps once anyway, to
/// notice when it pays again.
const GATHER_PROBE_EVERY: u32 = 16;

/// What the committer knows of its earlier gathers.
struct Gather {
    /// How much a sleep grew the group (batches it brought over those taken before
    /// it), as a running mean (each sleep weighs half).
    gain: f64,
    /// Large groups since the last sleep, while sleeping does not pay.
    skipped: u32,
    /// Whether the process kept the cores busy when last sampled.
    busy: bool,
    /// The process's CPU time and the time it was sampled at, and the cores.
    sampled: Option<(Instant, Duration)>,
    cores: f64,
}

impl Gather {
    fn new() -> Gather {
        Gather {
            gain: GATHER_GAIN_MIN,
            skipped: 0,
            busy: false,
            sampled: None,
            cores: std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
        }
    }

    /// Sample the process's CPU time, at most every [`CPU_SAMPLE`], and note whether
    /// it used [`GATHER_BUSY_SHARE`] of the cores since the last sample.
    fn sample_cpu(&mut self, now: Instant) {
        if self
            .sampled
            .is_some_and(|(at, _)| now.saturating_duration_since(at) < CPU_SAMPLE)
        {
            return;
        }
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        let cpu = Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0),
        );
        if let Some((at, before)) = self.sampled {
            self.busy = busy_share(
                now.saturating_duration_since(at),
                cpu.saturating_sub(before),
                self.cores,
            ) >= GATHER_BUSY_SHARE;
        }
        self.sampled = Some((now, cpu));
    }

    /// How long the next sleep is, after a group that took `last_sync`.
    fn sleep_for(&self, last_sync: Duration) -> Duration {
        let syncs = if self.busy { GATHER_BUSY_SYNCS } else { 1 };
        last_sync.saturating_mul(syncs).min(GATHER_MAX)
    }
}

/// The share of `cores` that `cpu` of CPU time over `wall` is.
fn busy_share(wall: Duration, cpu: Duration, cores: f64) -> f64 {
    if wall.is_zero() || cores <= 0.0 {
        return 0.0;
    }
    cpu.as_secs_f64() / (wall.as_secs_f64() * cores)
}

/// When the previous group had [`GATHER_FROM`] batches or more (many committers at
/// once), sleep for as long as the previous group's write and sync took (at most
/// [`GATHER_MAX`]) and then take every batch queued meanwhile. Under load this makes
/// fewer, larger groups, each one `fdatasync`. The thread sleeps rather than waits
/// on the queue: a wait would be woken by every batch that arrives (a futex wake for
/// the committing task and a context switch for this thread, each time), a sleep
/// costs one wake-up however many arrive.
///
/// A sleep pays only while committers outside the group are about to commit. When a
/// handful of committers are all in the group (a few sessions in a closed loop),
/// none arrives during it and it only delays them; so once sleeps grow groups by
/// less than [`GATHER_GAIN_MIN`] on average, only every [`GATHER_PROBE_EVERY`]th
/// large group sleeps. A lone committer (groups of one, as in a sequential client)
/// never waits.
///
/// While the process keeps the machine's cores busy ([`GATHER_BUSY_SHARE`]), the
/// sleep is [`GATHER_BUSY_SYNCS`] times as long: the commits are then held up by the
/// CPU more than by the log, and fewer, larger groups leave more of it to the work
/// that makes them (under `turnd-bench sessions`, groups of 16 – 19 batches instead
/// of 9 and a fifth less CPU per turn for the whole process). Otherwise a longer
/// sleep only delays the committers: a closed loop of 16 sessions, which does not
/// fill the cores, lost a sixth of its throughput to it. Returns whether it slept.
fn gather(
    rx: &mpsc::Receiver<LogJob>,
    jobs: &mut Vec<LogJob>,
    last_group: usize,
    last_sync: Duration,
    g: &mut Gather,
) -> bool {
    if last_group < GATHER_FROM || jobs.len() >= MAX_GROUP {
        return false;
    }
    if g.gain < GATHER_GAIN_MIN && g.skipped + 1 < GATHER_PROBE_EVERY {
        g.skipped += 1;
        return false;
    }
    g.skipped = 0;
    let before = jobs.len();
    std::thread::sleep(g.sleep_for(last_sync));
    take_queued(rx, jobs);
    g.gain = (g.gain + (jobs.len() - before) as f64 / before.max(1) as f64) / 2.0;
    true
}

/// Take every queued batch, up to [`MAX_GROUP`] in the group.
fn take_queued(rx: &mpsc::Receiver<LogJob>, jobs: &mut Vec<LogJob>) {
    while jobs.len() < MAX_GROUP {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
}

/// The committer's thread: take each group as it comes, until the store closes the
/// queue; then make what the log holds durable.
pub(super) fn committer_loop(
    inner: &Inner,
    rx: mpsc::Receiver<LogJob>,
    nudge: &mpsc::Sender<Ctl>,
    opts: &LoggedOptions,
) {
    let mut c = Committer {
        inner,
        opts,
        last_heal: None,
        last_group: 0,
        last_sync: Duration::ZERO,
        gathered: Gather::new(),
    };
    while let Ok(first) = rx.recv() {
        let room = wait_for_room(inner, nudge, opts.heal_interval.saturating_mul(5));
        let jobs = c.take_group(first, &rx);
        match room {
            Ok(()) => c.commit_group(jobs),
            Err(e) => refuse(jobs, &e),
        }
    }
    if let Err(e) = inner.log.flush() {
        tracing::error!("failed to sync the commit log at close: {e}");
    }
}

/// What the committer keeps between groups.
struct Committer<'a> {
    inner: &'a Inner,
    opts: &'a LoggedOptions,
    /// When a failed log was last told to heal.
    last_heal: Option<Instant>,
    /// Size of the previous group and how long its write and sync took.
    last_group: usize,
    last_sync: Duration,
    gathered: Gather,
}

impl Committer<'_> {
    /// The group that starts with `first`: every batch queued, and after a large
    /// group those that come during a short sleep ([`gather`]).
    fn take_group(&mut self, first: LogJob, rx: &mpsc::Receiver<LogJob>) -> Vec<LogJob> {
        let mut jobs = vec![first];
        take_queued(rx, &mut jobs);
        self.gathered.sample_cpu(Instant::now());
        gather(
            rx,
            &mut jobs,
            self.last_group,
            self.last_sync,
            &mut self.gathered,
        );
        self.last_group = jobs.len();
        jobs
    }

    /// Take the group's carries out of `jobs` and keep of each only the writes whose
    /// value the overlay still holds at the lsn the applier saw (a newer write of the
    /// key is in the log already, and must stay the newest), then encode what is left
    /// (outside the overlay's lock). A carry with nothing left is answered at once.
    ///
    /// The check holds until the carries are in the overlay: only this thread puts
    /// writes there, and they are appended and put in before the rest of the group.
    /// The applier may meanwhile write a checked entry to sled and drop it (a round
    /// without the delay); the carry then puts the same value back as not fresh, so
    /// the turn's later delete reaches sled, which holds the value already.
    fn prepare_carries(&self, jobs: &mut Vec<LogJob>) -> Vec<LogJob> {
        if !jobs.iter().any(LogJob::is_carry) {
            return Vec::new();
        }
        let (mut carries, commits): (Vec<LogJob>, Vec<LogJob>) =
            std::mem::take(jobs).into_iter().partition(LogJob::is_carry);
        *jobs = commits;
        match self.inner.overlay.read() {
            Ok(o) => {
                for c in &mut carries {
                    let expect = std::mem::take(&mut c.expect);
                    let writes = std::mem::take(&mut c.spent.writes);
                    c.spent.writes = writes
                        .into_iter()
                        .zip(expect)
                        .filter(|((k, _, _), lsn)| {
                            o.map.get(k.as_slice()).is_some_and(|p| p.lsn == *lsn)
                        })
                        .map(|(w, _)| w)
                        .collect();
                }
            }
            // No overlay to check against: carry nothing.
            Err(_) => carries.iter_mut().for_each(|c| c.spent.writes.clear()),
        }
        let mut kept = Vec::with_capacity(carries.len());
        for mut c in carries {
            if c.spent.writes.is_empty() {
                if c.reply.send(Ok(())).is_err() {
                    tracing::debug!("the applier went away before its carry was answered");
                }
                continue;
            }
            let mut batch = Batch::new();
            for (k, v, _) in &c.spent.writes {
                if let Some(v) = v {
                    batch.put_raw(k.to_vec(), v.to_vec());
                }
            }
            c.spent.record = encode(&batch);
            kept.push(c);
        }
        kept
    }

    /// Commit a group: the applier's carries first, as a group of their own (so
    /// that a carry the log refuses fails no commit), then the rest.
    fn commit_group(&mut self, mut jobs: Vec<LogJob>) {
        let carries = self.prepare_carries(&mut jobs);
        for (group, carry) in [(carries, true), (jobs, false)] {
            if !group.is_empty() {
                self.publish(group, carry);
            }
        }
    }

    /// Append a group to the log, put its writes into the overlay once it is
    /// durable, count it, and answer every batch of it (`carry`: every batch is one
    /// of the applier's carries).
    fn publish(&mut self, mut jobs: Vec<LogJob>, carry: bool) {
        let started = Instant::now();
        self.heal_if_due(started);
        let bytes: u64 = jobs.iter().map(|j| j.spent.record.len() as u64).sum();
        let carried: u64 = if carry {
            jobs.iter().map(|j| j.spent.writes.len() as u64).sum()
        } else {
            0
        };
        let (result, synced) = self.append(&jobs, bytes);
        let result = result.and_then(|first_lsn| {
            let mut o = self
                .inner
                .overlay
                .write()
                .map_err(|_| lock_err("overlay"))?;
            o.put_group(
                first_lsn,
                carry,
                jobs.iter_mut().map(|j| &mut j.spent.writes),
            );
            Ok(())
        });
        if let Err(e) = &result {
            if carry {
                tracing::warn!("failed to carry {carried} live records in the commit log: {e}");
            } else {
                tracing::error!("failed to commit a group of {} batches: {e}", jobs.len());
            }
        }
        if let Ok(mut s) = self.inner.stats.lock() {
            s.syncs += 1;
            s.batches += jobs.len() as u64;
            s.commit_micros += started.elapsed().as_micros() as u64;
            s.record_sync(synced);
            s.max_group = s.max_group.max(jobs.len() as u64);
            s.log_bytes += bytes;
            if result.is_ok() {
                s.carried_records += carried;
            }
        }
        for job in jobs {
            if job
                .reply
                .send_spent(result.clone(), Some(job.spent))
                .is_err()
            {
                tracing::debug!("committer went away before its commit finished");
            }
        }
    }

    /// Ask a failed log to heal, at most every `heal_interval`.
    fn heal_if_due(&mut self, now: Instant) {
        let log = &self.inner.log;
        if log.is_failed()
            && self
                .last_heal
                .is_none_or(|t| t.elapsed() >= self.opts.heal_interval)
        {
            self.last_heal = Some(now);
            match log.heal() {
                Ok(()) => tracing::info!("the commit log is writable again"),
                Err(e) => tracing::warn!("the commit log is still not writable: {e}"),
            }
        }
    }

    /// Append the group's records to the log: the first one's lsn, and how long the
    /// write and sync alone took (noted when long: see [`note_sync`]).
    fn append(&mut self, jobs: &[LogJob], bytes: u64) -> (Result<u64, StoreError>, Duration) {
        let records: Vec<&[u8]> = jobs.iter().map(|j| j.spent.record.as_slice()).collect();
        let writing = Instant::now();
        let result = self
            .inner
            .log
            .append(&records, self.opts.sled.sync == SyncMode::Always);
        let synced = writing.elapsed();
        self.last_sync = synced;
        note_sync(synced, jobs.len(), bytes);
        (result, synced)
    }
}

/// Log a group's write and sync from [`NOTED_SYNC`] on, as a warning from
/// [`SLOW_SYNC`] on. Under the target `turnd_store::logged`, which operators
/// filter on to see them (`docs/operations.md`).
fn note_sync(synced: Duration, batches: usize, bytes: u64) {
    if synced < NOTED_SYNC {
        return;
    }
    let took_ms = synced.as_millis() as u64;
    if synced >= SLOW_SYNC {
        tracing::warn!(target: "turnd_store::logged", took_ms, batches, bytes, "the commit log's write and fdatasync took {took_ms} ms; every commit waited for the disk");
    } else {
        tracing::debug!(target: "turnd_store::logged", took_ms, batches, bytes, "the commit log's write and fdatasync took {took_ms} ms; every commit waited for the disk");
    }
}

/// Answer every batch of a group refused before it was written.
fn refuse(jobs: Vec<LogJob>, e: &StoreError) {
    tracing::error!("refused a group of {} batches: {e}", jobs.len());
    for job in jobs {
        if job.reply.send(Err(e.clone())).is_err() {
            tracing::debug!("committer went away before its commit was refused");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::CommitTicket;

    /// Queue `n` jobs (their answers are dropped).
    fn send_jobs(tx: &mpsc::Sender<LogJob>, n: usize) {
        for i in 0..n {
            let mut b = Batch::new();
            b.put_raw(format!("k{i}").into_bytes(), b"v".to_vec());
            let (reply, _) = CommitTicket::new();
            tx.send(LogJob::new(b, reply)).expect("queue");
        }
    }

    /// `n` jobs queued on a fresh channel.
    fn queued(n: usize) -> (mpsc::Sender<LogJob>, mpsc::Receiver<LogJob>) {
        let (tx, rx) = mpsc::channel();
        send_jobs(&tx, n);
        (tx, rx)
    }

    #[test]
    fn a_group_waits_for_more_only_after_a_large_one() {
        let sync = Duration::from_millis(10);
        // After a small group nothing more is taken, however much is queued.
        let (_tx, rx) = queued(6);
        let mut jobs = vec![rx.recv().expect("first")];
        assert!(!gather(
            &rx,
            &mut jobs,
            GATHER_FROM - 1,
            sync,
            &mut Gather::new()
        ));
        assert_eq!(jobs.len(), 1);
        // After a large one, the group sleeps first and then takes everything
        // queued.
        let (_tx, rx) = queued(3);
        let mut jobs = vec![rx.recv().expect("first")];
        let t = Instant::now();
        assert!(gather(&rx, &mut jobs, 8, sync, &mut Gather::new()));
        assert_eq!(jobs.len(), 3);
        assert!(t.elapsed() >= GATHER_MAX, "waited {:?}", t.elapsed());
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "waited {:?}",
            t.elapsed()
        );
    }

    /// A group waits twice as long while the process keeps the cores busy, and the
    /// share is CPU time over wall time over cores.
    #[test]
    fn a_group_waits_longer_while_the_cores_are_busy() {
        let ms = Duration::from_millis;
        let mut g = Gather::new();
        assert_eq!(
            g.sleep_for(ms(0) + Duration::from_micros(200)),
            Duration::from_micros(200)
        );
        g.busy = true;
        assert_eq!(
            g.sleep_for(Duration::from_micros(200)),
            Duration::from_micros(400)
        );
        assert_eq!(g.sleep_for(ms(3)), GATHER_MAX);
        assert!((busy_share(ms(100), ms(180), 2.0) - 0.9).abs() < 1e-9);
        assert!(busy_share(ms(100), ms(180), 2.0) >= GATHER_BUSY_SHARE);
        assert!(busy_share(ms(100), ms(120), 2.0) < GATHER_BUSY_SHARE);
        assert_eq!(busy_share(Duration::ZERO, ms(1), 2.0), 0.0);
        // The first sample only notes where the process is; a second one, at least
        // CPU_SAMPLE later, judges the time between (this test's thread idles).
        let mut g = Gather::new();
        let t0 = Instant::now();
        g.sample_cpu(t0);
        assert!(g.sampled.is_some() && !g.busy);
        std::thread::sleep(CPU_SAMPLE);
        g.sample_cpu(Instant::now());
        assert!(!g.busy, "an idle process does not keep the cores busy");
    }

    /// Sleeps that bring nothing (every committer already in the group) stop, but
    /// for one in `GATHER_PROBE_EVERY` large groups; one that brings batches again
    /// makes the next group sleep too.
    #[test]
    fn a_group_stops_sleeping_when_sleeps_bring_nothing() {
        let sync = Duration::from_micros(50);
        let mut g = Gather::new();
        let (tx, rx) = queued(0);
        let mut slept = Vec::new();
        for _ in 0..GATHER_PROBE_EVERY * 2 + 1 {
            let mut jobs = Vec::new();
            slept.push(gather(&rx, &mut jobs, 8, sync, &mut g));
            assert!(jobs.is_empty());
        }
        let probe = GATHER_PROBE_EVERY as usize;
        let sleeps: Vec<usize> = (0..slept.len()).filter(|i| slept[*i]).collect();
        assert_eq!(sleeps, vec![0, probe, probe * 2], "{slept:?}");
        // A probe that doubles its group: the next large group sleeps again.
        for _ in 0..probe - 1 {
            assert!(!gather(&rx, &mut Vec::new(), 8, sync, &mut g));
        }
        send_jobs(&tx, 2);
        let mut jobs = vec![rx.recv().expect("first"), rx.recv().expect("second")];
        send_jobs(&tx, 4);
        assert!(gather(&rx, &mut jobs, 8, sync, &mut g), "the probe");
        assert_eq!(jobs.len(), 6);
        assert!(
            gather(&rx, &mut Vec::new(), 8, sync, &mut g),
            "after a paying probe"
        );
    }
}
