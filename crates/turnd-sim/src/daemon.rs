//! The simulated daemon: the real engine on a [`SimKv`], on a current-thread tokio
//! runtime with paused time, and the real router (`turnd_server::router`) in front
//! of it, fed protocol frames by the simulation instead of sockets.
//!
//! One runtime per life of the daemon: a crash drops it with every task it ran, as
//! the death of a process does. Time passes only in [`Daemon::tick`]: the runtime runs
//! every task that can run and then, with nothing left to run, moves its paused clock
//! to the next timer (tokio's auto-advance), until the tick's end. So the order of
//! everything in a life follows from the order the simulation feeds it frames.
//!
//! A connection is what `turnd_server::ws` makes of a socket, minus the socket: an
//! [`Outbox`] the engine and the request tasks write to (drained after each tick
//! into the network), a `hello` first (a worker's goes to the engine's
//! `worker_hello`, which reconciles), then each request in a task of its own through
//! [`router::dispatch`], its answer queued on the same outbox; when either end closes
//! it, `connection_closed` and `worker_disconnected`, as the connection's end does.
//!
//! One invariant is checked here, where the daemon answers: as a `turn.stop` or
//! `session.stop` is answered, before any other task runs, the session's lock was
//! handed over ([`check::lock_handed_over`]). What breaks is kept for the simulation
//! to take ([`Daemon::take_broken`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use turnd_engine::{Caller, Clock, Engine, EngineConfig, Outbox, Workers};
use turnd_proto::frame::{
    decode_raw_request, encode_error, encode_ok_text, to_json_text, FRAME_CAPACITY,
};
use turnd_proto::{ErrorBody, ErrorCode, HelloArgs, HelloOk, Role, SessionStopArgs, StopArgs};
use turnd_server::router::{self, Answer, Origin};
use turnd_store::{Store, StoreError};

use crate::check;
use crate::disk::SimKv;

/// Invariants broken where the daemon answers, for the simulation to take.
type Broken = Arc<Mutex<Vec<String>>>;

/// Frames one connection's outbox holds before the daemon closes it as a slow reader.
const OUTBOX_FRAMES: usize = 4096;
/// Watches one connection may hold.
const MAX_WATCHES: usize = 64;

struct Conn {
    outbox: Outbox,
    rx: mpsc::Receiver<String>,
    /// Set by its `hello`, once answered.
    caller: Arc<Mutex<Option<Caller>>>,
}

/// One life of the daemon. See the module documentation.
pub struct Daemon {
    rt: Runtime,
    engine: Engine,
    kv: Arc<SimKv>,
    conns: BTreeMap<u64, Conn>,
    broken: Broken,
}

/// What the daemon sent on a connection, or that it closed one.
pub enum Out {
    Frame(u64, String),
    Closed(u64),
}

impl Daemon {
    /// Start a life on `kv` with its clock at `clock_ms`, and recover. Returns the
    /// daemon and the simulated milliseconds the start took.
    pub fn start(
        kv: SimKv,
        clock_ms: u64,
        cfg: EngineConfig,
        sync_ms: u64,
    ) -> Result<(Daemon, u64), StoreError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .map_err(|e| StoreError::Write(format!("runtime: {e}")))?;
        let kv = Arc::new(kv);
        let syncer = kv.clone();
        let store = Store::new(kv.clone());
        let (engine, took) = rt.block_on(async move {
            let started = tokio::time::Instant::now();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(sync_ms.max(1))).await;
                    syncer.sync_group();
                }
            });
            let clock = Clock::starting_at(clock_ms);
            let engine = Engine::open_at(store, cfg, Workers::new(), clock).await;
            (engine, started.elapsed())
        });
        let engine = engine?;
        Ok((
            Daemon {
                rt,
                engine,
                kv,
                conns: BTreeMap::new(),
                broken: Broken::default(),
            },
            took.as_millis() as u64,
        ))
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn kv(&self) -> &Arc<SimKv> {
        &self.kv
    }

    /// The invariants broken as the daemon answered, since the last call.
    pub fn take_broken(&self) -> Vec<String> {
        std::mem::take(&mut *self.broken.lock())
    }

    /// Run the daemon for `ms` of simulated time; returns the milliseconds passed.
    pub fn tick(&self, ms: u64) -> u64 {
        let took = self.rt.block_on(async move {
            let t = tokio::time::Instant::now();
            tokio::time::sleep(Duration::from_millis(ms)).await;
            t.elapsed()
        });
        took.as_millis() as u64
    }

    /// Run `f` inside the runtime (for reads that need its clock).
    pub fn within<T>(&self, f: impl FnOnce(&Engine) -> T) -> T {
        let _g = self.rt.enter();
        f(&self.engine)
    }

    /// A new connection `conn` (its id as the engine sees it: `c<conn>`).
    pub fn accept(&mut self, conn: u64) {
        let (outbox, rx) = Outbox::new(format!("c{conn}"), OUTBOX_FRAMES);
        self.conns.insert(
            conn,
            Conn {
                outbox,
                rx,
                caller: Arc::default(),
            },
        );
    }

    /// A frame arrives on `conn` (ignored when the daemon closed it).
    pub fn deliver(&mut self, conn: u64, text: &str) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let req = match decode_raw_request(text) {
            Ok(r) => r,
            Err(e) => {
                let err = ErrorBody::new(ErrorCode::BadFrame, e.message);
                c.outbox.push(encode_error(None, &err));
                return;
            }
        };
        let id = req.id;
        let op = req.op.to_string();
        let args = req.args_text().to_string();
        let engine = self.engine.clone();
        let outbox = c.outbox.clone();
        let caller = c.caller.clone();
        let broken = self.broken.clone();
        let kv = self.kv.clone();
        self.rt.spawn(async move {
            let answer = if op == "hello" {
                hello(&engine, &outbox, &caller, &args).await
            } else {
                request(&engine, &outbox, &caller, id, &op, &args).await
            };
            if answer.is_ok() {
                match answered(&engine, &op, &args) {
                    Ok(()) => {}
                    // The machine stopped after the answer, before the check could
                    // read the store: the restart checks what was acknowledged.
                    Err(v) if kv.stopped() && v.starts_with(check::READ_FAILED) => {}
                    Err(v) => broken.lock().push(v),
                }
            }
            let frame = match answer {
                Ok(Some(text)) => encode_ok_text(id, &text),
                Ok(None) => return,
                Err(e) => encode_error(Some(id), &e),
            };
            outbox.send(frame).await;
        });
    }

    /// The peer's end of `conn` is gone and the daemon notices.
    pub fn close(&mut self, conn: u64) {
        if let Some(c) = self.conns.remove(&conn) {
            self.ended(c);
        }
    }

    fn ended(&self, c: Conn) {
        c.outbox.close_with(turnd_engine::CloseReason::ReaderEnded);
        let engine = self.engine.clone();
        let worker = c.caller.lock().as_ref().and_then(|k| k.worker_id.clone());
        let conn_id = c.outbox.conn_id.clone();
        self.rt.spawn(async move {
            engine.connection_closed(&conn_id);
            if let Some(w) = worker {
                engine.worker_disconnected(&w, &conn_id).await;
            }
        });
    }

    /// Everything queued on every connection since the last drain, in order, and the
    /// connections the daemon closed (superseded, too slow).
    pub fn drain(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        let mut closed = Vec::new();
        for (&id, c) in self.conns.iter_mut() {
            while let Ok(f) = c.rx.try_recv() {
                out.push(Out::Frame(id, f));
            }
            if c.outbox.close_reason().is_some() {
                closed.push(id);
            }
        }
        for id in closed {
            if let Some(c) = self.conns.remove(&id) {
                self.ended(c);
                out.push(Out::Closed(id));
            }
        }
        out
    }

    /// The connections open on the daemon's side.
    pub fn conn_ids(&self) -> Vec<u64> {
        self.conns.keys().copied().collect()
    }

    /// Stop the engine's timers and let the runtime go with every task.
    pub fn shut(self) {
        self.engine.shutdown();
        drop(self.rt);
    }
}

/// A `hello`: a worker's attaches and reconciles through the engine.
async fn hello(
    engine: &Engine,
    outbox: &Outbox,
    caller: &Mutex<Option<Caller>>,
    args: &str,
) -> Result<Option<String>, ErrorBody> {
    if caller.lock().is_some() {
        return Err(ErrorBody::new(
            ErrorCode::Conflict,
            "this connection already said hello",
        ));
    }
    let h: HelloArgs = router::decode(args)?;
    let serves = h.role == Role::Worker;
    let reconciled = if serves {
        Some(engine.worker_hello(&h, outbox.clone()).await?)
    } else {
        None
    };
    *caller.lock() = Some(Caller {
        role: h.role,
        worker_id: if serves { h.worker_id.clone() } else { None },
    });
    to_json_text(
        &HelloOk {
            server: "turnd".into(),
            version: "sim".into(),
            boot_id: engine.boot_id().to_string(),
            connection_id: outbox.conn_id.clone(),
            heartbeat_ms: 0,
            max_frame_bytes: 0,
            reconciled,
        },
        FRAME_CAPACITY,
    )
    .map(Some)
    .map_err(|e| ErrorBody::new(ErrorCode::Internal, e.to_string()))
}

/// The checks of an answered request: after a stop, the lock was handed over.
fn answered(engine: &Engine, op: &str, args: &str) -> check::Checked {
    let store = engine.store();
    let session_id = match op {
        "session.stop" => router::decode::<SessionStopArgs>(args)
            .ok()
            .map(|a| a.session_id),
        "turn.stop" => match router::decode::<StopArgs>(args) {
            Ok(a) => store
                .turn(&a.turn_id)
                .map_err(check::read)?
                .map(|t| t.session_id),
            Err(_) => None,
        },
        _ => None,
    };
    match session_id {
        Some(s) => check::lock_handed_over(store, &s),
        None => Ok(()),
    }
}

/// Any other request, through the router.
async fn request(
    engine: &Engine,
    outbox: &Outbox,
    caller: &Mutex<Option<Caller>>,
    id: u64,
    op: &str,
    args: &str,
) -> Result<Option<String>, ErrorBody> {
    let Some(caller) = caller.lock().clone() else {
        return Err(ErrorBody::new(ErrorCode::NotAuthenticated, "hello first"));
    };
    let origin = Origin {
        outbox,
        max_watches: MAX_WATCHES,
        request_id: id,
    };
    match router::dispatch(engine, &caller, op, args, Some(&origin)).await? {
        Answer::Reply(text) => Ok(Some(text)),
        Answer::Queued => Ok(None),
    }
}
