//! One seeded run: the daemon, the peers and the network in simulated time, stepped a
//! few milliseconds at a time, with faults drawn from the seed while the callers
//! still submit, then a quiet tail in which every turn must finish.
//!
//! Each step: the daemon runs for the step's time ([`Daemon::tick`]); what it sent
//! goes into the network (every `invoke` checked first, [`Tracking::on_invoke`]);
//! what the network delivers by now goes to the daemon and the peers; the peers act
//! on their timers; faults are drawn; a daemon whose disk stopped inside a group is
//! crashed, a crashed one restarted when its downtime is over and checked for every
//! acknowledged write ([`check::acked_kept`]). Every loop is bounded: steps by
//! [`Config::max_steps`], the tail by [`Config::tail_ms`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use turnd_proto::frame::{decode_server_frame, ServerFrame};
use turnd_proto::{Invoke, Push};
use turnd_store::MemLog;

use crate::caller::CallerPeer;
use crate::check::{self, Checked, Tracking};
use crate::config::Config;
use crate::daemon::{Daemon, Out};
use crate::disk::{GroupCrash, SimKv};
use crate::ledger::Ledger;
use crate::net::{Delivery, Dir, Fate, Net};
use crate::peer::{Env, Trace};
use crate::worker::Worker;

#[derive(Debug, Clone, Copy)]
enum Peer {
    Worker(usize),
    Caller(usize),
}

/// Counts of what a run did.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    pub steps: u64,
    pub daemon_crashes: u64,
    pub group_crashes: u64,
    pub disk_failures: u64,
    pub worker_crashes: u64,
    pub frames: u64,
}

/// One run. See the module documentation.
pub struct World {
    cfg: Config,
    pub now: u64,
    rng: ChaCha8Rng,
    pub ledger: Ledger,
    pub trace: Trace,
    net: Net,
    next_conn: u64,
    workers: Vec<Worker>,
    callers: Vec<CallerPeer>,
    owner: BTreeMap<u64, Peer>,
    daemon: Option<Daemon>,
    down: Option<(MemLog, u64)>,
    disk_heal_at: Option<u64>,
    clock_offset: i64,
    tracking: Tracking,
    quiet_since: Option<u64>,
    pub counts: Counts,
    pub digest: u64,
    /// The simulated time, for the ids the daemon mints.
    clock: Arc<AtomicU64>,
}

impl World {
    pub fn new(seed: u64, cfg: Config, clock: Arc<AtomicU64>) -> World {
        World {
            now: 1_000,
            rng: ChaCha8Rng::seed_from_u64(seed),
            ledger: Ledger::default(),
            trace: Trace::new(cfg.trace),
            net: Net::default(),
            next_conn: 0,
            workers: (0..cfg.workers).map(Worker::new).collect(),
            callers: (0..cfg.callers)
                .map(|i| CallerPeer::new(i, cfg.sessions_per_caller, cfg.turns_per_caller))
                .collect(),
            owner: BTreeMap::new(),
            daemon: None,
            down: Some((MemLog::new(), 0)),
            disk_heal_at: None,
            clock_offset: 0,
            tracking: Tracking::default(),
            quiet_since: None,
            counts: Counts::default(),
            digest: 0xcbf2_9ce4_8422_2325,
            clock,
            cfg,
        }
    }

    /// Run to the end of the tail, or to the first broken invariant.
    pub fn run(&mut self) -> Checked {
        for _ in 0..self.cfg.max_steps {
            self.counts.steps += 1;
            let quiet = self.quiet();
            let dt = self.rng.random_range(1..=4);
            self.advance(dt);
            self.pump()?;
            self.peers(quiet)?;
            if !quiet {
                self.inject()?;
            }
            self.lifecycle(quiet)?;
            if let Some(v) = self.ledger.violations.first() {
                return Err(v.clone());
            }
            if quiet && self.counts.steps.is_multiple_of(16) && self.done()? {
                return self.final_checks();
            }
            if self
                .quiet_since
                .is_some_and(|q| self.now > q + self.cfg.tail_ms)
            {
                return Err(format!(
                    "not every turn finished within {} ms of the faults' end",
                    self.cfg.tail_ms
                ));
            }
        }
        Err(format!("no end within {} steps", self.cfg.max_steps))
    }

    /// Faults stop once every caller has submitted all its turns.
    fn quiet(&mut self) -> bool {
        if self.quiet_since.is_none() && self.callers.iter().all(|c| c.budget == 0) {
            self.quiet_since = Some(self.now);
            self.trace
                .push(self.now, || "faults stop: the quiet tail".into());
        }
        self.quiet_since.is_some()
    }

    fn advance(&mut self, dt: u64) {
        let took = match &self.daemon {
            Some(d) => d.tick(dt),
            None => dt,
        };
        self.now += took;
        self.clock.store(self.now, Ordering::Relaxed);
    }

    fn mix(&mut self, text: &str) {
        for b in text.bytes() {
            self.digest = (self.digest ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn fate(&mut self, quiet: bool) -> Fate {
        let f = if quiet {
            crate::net::NetFaults::NONE
        } else {
            self.cfg.faults.net
        };
        let latency = self.rng.random_range(0..3);
        let chance = |rng: &mut ChaCha8Rng, p: f64| p > 0.0 && rng.random_bool(p);
        Fate {
            latency,
            drop: chance(&mut self.rng, f.drop),
            dup: chance(&mut self.rng, f.dup),
            extra: if chance(&mut self.rng, f.delay) {
                self.rng.random_range(0..f.long_ms.max(1))
            } else {
                0
            },
        }
    }

    /// What the daemon sent goes to the network; what is due is delivered.
    fn pump(&mut self) -> Checked {
        let quiet = self.quiet_since.is_some();
        let outs = self.daemon.as_mut().map(Daemon::drain).unwrap_or_default();
        if let Some(d) = self.daemon.as_ref() {
            self.ledger.violations.extend(d.take_broken());
        }
        let mut invokes = Vec::new();
        for out in outs {
            match out {
                Out::Frame(conn, text) => {
                    self.trace
                        .push(self.now, || format!("c{conn} <- {}", short(&text)));
                    if let Some(inv) = self.sent_by_daemon(&text)? {
                        invokes.push(inv);
                    }
                    let fate = self.fate(quiet);
                    self.net.send(self.now, conn, Dir::ToPeer, text, fate);
                }
                Out::Closed(conn) => {
                    let at = self.now + self.rng.random_range(0..5);
                    self.net.close(at, conn, Dir::ToPeer);
                }
            }
        }
        self.check_invokes(invokes)?;
        while let Some((conn, d)) = self.net.next_due(self.now) {
            self.counts.frames += 1;
            match d {
                Delivery::Frame(Dir::ToDaemon, text) => {
                    self.trace
                        .push(self.now, || format!("c{conn} => daemon {}", short(&text)));
                    if let Some(daemon) = self.daemon.as_mut() {
                        daemon.deliver(conn, &text);
                    }
                }
                Delivery::Closed(Dir::ToDaemon) => {
                    self.trace
                        .push(self.now, || format!("c{conn} closed, the daemon notices"));
                    if let Some(daemon) = self.daemon.as_mut() {
                        daemon.close(conn);
                    }
                }
                Delivery::Frame(Dir::ToPeer, text) => self.deliver_to_peer(conn, Some(&text))?,
                Delivery::Closed(Dir::ToPeer) => {
                    self.trace
                        .push(self.now, || format!("c{conn} closed, the peer notices"));
                    self.deliver_to_peer(conn, None)?;
                    self.net.forget(conn);
                }
            }
        }
        Ok(())
    }

    /// A frame the daemon sent goes into the digest; an `invoke` is returned, to be
    /// checked.
    fn sent_by_daemon(&mut self, text: &str) -> Result<Option<Invoke>, String> {
        let boot = self
            .daemon
            .as_ref()
            .map(|d| d.engine().boot_id().to_string());
        match boot {
            Some(b) if text.contains(&b) => self.mix(&text.replace(&b, "-")),
            _ => self.mix(text),
        }
        if !text.starts_with("{\"push\":\"invoke\"") {
            return Ok(None);
        }
        let Ok(ServerFrame::Push(Push::Invoke(inv))) = decode_server_frame(text) else {
            return Err(format!("an invoke push does not decode: {text}"));
        };
        Ok(Some(inv))
    }

    /// The `invoke`s of one tick, checked against the store in the order they were
    /// dispatched. A tick's frames come out connection by connection, so two
    /// dispatches of one session in one tick (a turn dispatched, its deadline passed,
    /// the next one dispatched) may come out in the other order; the invocation ids
    /// this thread mints grow with every id (`run_seed`), so their order is the
    /// dispatches' order.
    fn check_invokes(&mut self, mut invokes: Vec<Invoke>) -> Checked {
        invokes.sort_by(|a, b| a.invocation_id.cmp(&b.invocation_id));
        for inv in invokes {
            self.trace.push(self.now, || {
                format!(
                    "daemon invokes {} ({} step {} attempt {})",
                    inv.invocation_id, inv.turn_id, inv.step, inv.attempt
                )
            });
            let Some(d) = self.daemon.as_ref() else {
                return Ok(());
            };
            if d.kv().stopped() {
                return Ok(());
            }
            self.tracking.on_invoke(d.engine().store(), &inv)?;
        }
        Ok(())
    }

    fn deliver_to_peer(&mut self, conn: u64, text: Option<&str>) -> Checked {
        match self.owner.get(&conn).copied() {
            Some(p @ Peer::Worker(i)) => self.act(p, |w, _, env| match text {
                Some(t) => w[i].frame(env, conn, t),
                None => w[i].closed(env, conn),
            }),
            Some(p @ Peer::Caller(i)) => self.act(p, |_, c, env| match text {
                Some(t) => c[i].frame(env, conn, t),
                None => c[i].closed(env, conn),
            }),
            None => Ok(()),
        }
    }

    /// Let a peer act, then carry out what it did.
    fn act(
        &mut self,
        p: Peer,
        f: impl FnOnce(&mut [Worker], &mut [CallerPeer], &mut Env),
    ) -> Checked {
        let mut env = Env {
            now: self.now,
            rng: &mut self.rng,
            ledger: &mut self.ledger,
            trace: &mut self.trace,
            sends: Vec::new(),
            opened: Vec::new(),
            cut: Vec::new(),
            next_conn: &mut self.next_conn,
        };
        f(&mut self.workers, &mut self.callers, &mut env);
        let (sends, opened, cut) = (env.sends, env.opened, env.cut);
        let quiet = self.quiet_since.is_some();
        for conn in opened {
            self.owner.insert(conn, p);
            match self.daemon.as_mut() {
                Some(d) => d.accept(conn),
                None => self.net.close(self.now + 1, conn, Dir::ToPeer),
            }
        }
        for (conn, text) in sends {
            self.trace
                .push(self.now, || format!("c{conn} -> {}", short(&text)));
            self.mix(&text);
            let fate = self.fate(quiet);
            self.net.send(self.now, conn, Dir::ToDaemon, text, fate);
        }
        for conn in cut {
            // The daemon notices at once (a closed socket) or only after its
            // heartbeat timeout (a silent peer).
            let notice = match self.rng.random_range(0..4) {
                0 => self.rng.random_range(300..3_000),
                _ => self.rng.random_range(0..20),
            };
            self.net.close(self.now + notice, conn, Dir::ToDaemon);
        }
        Ok(())
    }

    fn peers(&mut self, quiet: bool) -> Checked {
        let pace = if quiet {
            self.cfg.pace_quiet()
        } else {
            self.cfg.pace
        };
        for i in 0..self.workers.len() {
            self.act(Peer::Worker(i), |w, _, env| w[i].step(env))?;
        }
        for i in 0..self.callers.len() {
            self.act(Peer::Caller(i), |_, c, env| c[i].step(env, pace))?;
        }
        Ok(())
    }

    /// Draw this step's faults.
    fn inject(&mut self) -> Checked {
        let f = self.cfg.faults;
        for i in 0..self.workers.len() {
            if self.rng.random_bool(f.worker_crash) {
                self.counts.worker_crashes += 1;
                self.trace
                    .push(self.now, || format!("fault: worker w{i} crashes"));
                self.act(Peer::Worker(i), |w, _, env| w[i].crash(env))?;
            } else if self.rng.random_bool(f.worker_cut) {
                self.trace
                    .push(self.now, || format!("fault: worker w{i} cut"));
                self.act(Peer::Worker(i), |w, _, env| w[i].cut(env))?;
            } else if self.rng.random_bool(f.worker_stall) {
                let ms = self.rng.random_range(200..3_000);
                self.trace
                    .push(self.now, || format!("fault: worker w{i} stalls {ms} ms"));
                self.workers[i].stall(self.now, ms);
            } else if self.rng.random_bool(f.worker_slow) {
                let ms = self.rng.random_range(500..5_000);
                self.workers[i].slow(self.now, ms);
            }
        }
        if self.rng.random_bool(f.outage) {
            let ms = self.rng.random_range(300..2_500);
            self.trace
                .push(self.now, || format!("fault: every worker away {ms} ms"));
            for i in 0..self.workers.len() {
                self.act(Peer::Worker(i), |w, _, env| w[i].away(env, ms))?;
            }
        }
        for i in 0..self.callers.len() {
            if self.rng.random_bool(f.caller_away) {
                let ms = self.rng.random_range(200..3_000);
                self.trace
                    .push(self.now, || format!("fault: caller k{i} away {ms} ms"));
                self.act(Peer::Caller(i), |_, c, env| c[i].away(env, ms))?;
            }
        }
        self.inject_daemon()
    }

    fn inject_daemon(&mut self) -> Checked {
        let f = self.cfg.faults;
        let Some(d) = self.daemon.as_ref() else {
            return Ok(());
        };
        if self.rng.random_bool(f.daemon_crash) {
            self.trace
                .push(self.now, || "fault: the daemon crashes".into());
            self.crash_daemon();
        } else if self.rng.random_bool(f.group_crash) {
            let how = if self.rng.random_bool(0.5) {
                GroupCrash::AfterAppend
            } else {
                GroupCrash::Torn(self.rng.random_range(0..4))
            };
            self.trace.push(self.now, || {
                format!("fault: the next group ends in a crash, {how:?}")
            });
            d.kv().crash_in_next_group(how);
        } else if self.disk_heal_at.is_none() && self.rng.random_bool(f.disk_fail) {
            let until = self.now + self.rng.random_range(20..1_500);
            self.trace
                .push(self.now, || format!("fault: the disk fails until {until}"));
            self.counts.disk_failures += 1;
            d.kv().set_failing(true);
            self.disk_heal_at = Some(until);
        }
        Ok(())
    }

    fn crash_daemon(&mut self) {
        let Some(d) = self.daemon.take() else { return };
        self.counts.daemon_crashes += 1;
        let log = d.kv().crash();
        for conn in d.conn_ids() {
            let at = self.now + self.rng.random_range(0..5);
            self.net.close(at, conn, Dir::ToPeer);
        }
        d.shut();
        let jump = self.cfg.faults.clock_jump_ms as i64;
        if jump > 0 {
            self.clock_offset += self.rng.random_range(-jump..=jump);
        }
        self.disk_heal_at = None;
        let back = self.now + self.rng.random_range(20..1_500);
        self.down = Some((log, back));
    }

    fn lifecycle(&mut self, quiet: bool) -> Checked {
        if let Some(d) = self.daemon.as_ref() {
            if d.kv().stopped() {
                self.counts.group_crashes += 1;
                self.trace
                    .push(self.now, || "the machine stopped inside a group".into());
                self.crash_daemon();
            } else if self.disk_heal_at.is_some_and(|t| quiet || t <= self.now) {
                self.trace.push(self.now, || "the disk works again".into());
                d.kv().set_failing(false);
                self.disk_heal_at = None;
            }
        }
        match &self.down {
            Some((_, at)) if *at <= self.now => self.restart(),
            _ => Ok(()),
        }
    }

    fn restart(&mut self) -> Checked {
        let Some((log, _)) = self.down.take() else {
            return Ok(());
        };
        let kv = SimKv::recover(log).map_err(|e| format!("the store does not open: {e}"))?;
        let clock = (self.now as i64 + self.clock_offset).max(0) as u64;
        let sync_ms = self.rng.random_range(1..4);
        let (d, took) = Daemon::start(kv, clock, self.cfg.engine(), sync_ms)
            .map_err(|e| format!("the daemon does not start: {e}"))?;
        self.now += took;
        self.trace.push(self.now, || {
            format!("the daemon starts, its clock at {clock}, recovery took {took} ms")
        });
        check::acked_kept(d.engine().store(), &self.ledger)?;
        self.daemon = Some(d);
        Ok(())
    }

    /// Whether everything is finished: every turn submitted and answered, every
    /// result answered, nothing unfinished in the store.
    fn done(&self) -> Result<bool, String> {
        let Some(d) = self.daemon.as_ref() else {
            return Ok(false);
        };
        if self
            .callers
            .iter()
            .any(|c| c.budget > 0 || c.unanswered() > 0)
            || self.workers.iter().any(Worker::holds_work)
        {
            return Ok(false);
        }
        let metas = d
            .engine()
            .store()
            .session_metas()
            .map_err(|e| format!("store read failed: {e}"))?;
        Ok(metas.iter().all(|m| m.active_from.is_none()))
    }

    fn final_checks(&mut self) -> Checked {
        let Some(d) = self.daemon.as_ref() else {
            return Err("the daemon is down at the end".into());
        };
        // Let the engine let go of what the last transitions used.
        d.tick(50);
        let store = d.engine().store();
        check::acked_kept(store, &self.ledger)?;
        check::truthful(store, &self.ledger)?;
        d.within(|e| check::settled(e, store))
    }

    /// Turns the callers were told were admitted.
    pub fn admitted(&self) -> usize {
        self.ledger.admitted.len()
    }

    /// Stop the daemon (the end of a run).
    pub fn finish(mut self) {
        if let Some(d) = self.daemon.take() {
            d.shut();
        }
    }
}

/// A frame as the trace shows it: at most 400 characters.
fn short(text: &str) -> &str {
    match text.char_indices().nth(400) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}
