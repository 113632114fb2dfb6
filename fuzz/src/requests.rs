//! The `requests` target's body: a sequence of protocol requests from callers and
//! workers, applied to a real [`Engine`] on an in-memory store.
//!
//! Every request is built as a JSON text frame, decoded with the server's
//! `decode_raw_request` and handed, with the caller its connection said `hello` as,
//! to the daemon's own router (`turnd_server::router::dispatch`), which admits the op
//! for the caller's role, decodes its `args` and runs it on the engine, as it does
//! for every request of a real connection. Responses are encoded with the server's
//! encoders and decoded again with the SDK's `decode_server_frame` and the op's
//! result type; every push a worker or watcher receives is decoded the same way.
//!
//! Ids that the daemon mints (turn, invocation and watch ids) are learned from its
//! responses and pushes, and the fuzzer refers to them by index, so the ops hit real
//! state; caller-chosen ids (sessions, functions, workers, instances, idempotency
//! keys) come from small alphabets. Time is tokio's paused clock: an `Advance` lets
//! deadlines, probes, backoffs and reconnect graces fire. `Restart` drops the whole
//! runtime (every task of the old engine, as a crash would) and reopens the engine
//! on the same store, which runs recovery. `Faults` toggles write and read failures
//! of the store (`turnd_store::faulty::FaultyKv` around `turnd_store::mem::MemKv`); a
//! fault still pending at a restart may make the start fail, after which the store
//! must be consistent and a start without faults must succeed.
//!
//! Properties checked: nothing panics; after every request (and at the end, once the
//! faults are lifted and time has passed) `turnd_store::check_store` reports no
//! violation; every frame the server would send decodes with the SDK's decoder and
//! every `ok` result decodes as its op's result type. With the environment variable
//! `TURND_FUZZ_NO_INTERNAL=1`, an `internal` error answer is a failure too.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use turnd_engine::{Caller, Engine, EngineConfig, Outbox};
use turnd_proto::frame::{
    decode_server_frame, encode_error, encode_ok_text, encode_request, ServerFrame,
};
use turnd_proto::*;
use turnd_server::router::{self, Answer, Origin};
use turnd_store::faulty::{Faults, FaultyKv};
use turnd_store::mem::MemKv;
use turnd_store::{check_store, Kv, Store};

/// Most actions taken from one input (keeps each run small and fast).
pub const MAX_ACTIONS: usize = 64;

pub const SESSIONS: [&str; 3] = ["s0", "s1", "s2"];
pub const FUNCTIONS: [&str; 2] = ["f0", "f1"];
pub const WORKERS: [&str; 2] = ["w0", "w1"];
pub const INSTANCES: [&str; 2] = ["i0", "i1"];
pub const KEYS: [&str; 2] = ["k0", "k1"];

/// Ids that name nothing, or are invalid (empty, control character, too long).
fn bogus_ids() -> [String; 4] {
    [
        "t_00000000000000000000000000000000".into(),
        String::new(),
        "inv_\u{1}".into(),
        "x".repeat(257),
    ]
}

/// Keys that args objects are built from (every field name of protocol v1 args).
const FIELDS: [&str; 34] = [
    "protocol",
    "role",
    "token",
    "name",
    "worker_id",
    "instance_id",
    "inflight",
    "finished",
    "function_id",
    "concurrency",
    "timeout_ms",
    "delivery",
    "max_attempts",
    "invocation_id",
    "outcome",
    "state",
    "session_id",
    "input",
    "idempotency_key",
    "turn_timeout_ms",
    "turn_id",
    "reason",
    "status",
    "limit",
    "before_seq",
    "after",
    "watch_id",
    "complete",
    "continue",
    "fail",
    "cancelled",
    "code",
    "message",
    "retryable",
];

/// Strings values are drawn from: ids and every enum spelling of the protocol.
const WORDS: [&str; 20] = [
    "s0",
    "s1",
    "f0",
    "f1",
    "w0",
    "w1",
    "i0",
    "k0",
    "worker",
    "client",
    "operator",
    "at_most_once",
    "at_least_once",
    "running",
    "finished",
    "unknown",
    "queued",
    "completed",
    "failed",
    "cancelled",
];

/// A small JSON value (depth at most 3), biased towards the protocol's vocabulary.
#[derive(Debug, Clone)]
pub struct Json(pub Value);

impl<'a> Arbitrary<'a> for Json {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(Json(value(u, 3)?))
    }
}

fn value(u: &mut Unstructured<'_>, depth: u32) -> arbitrary::Result<Value> {
    let top = if depth == 0 { 5 } else { 7 };
    Ok(match u.int_in_range(0..=top)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => json!(u.int_in_range(-2i64..=3)?),
        3 => json!(u.arbitrary::<i64>()?),
        4 => json!(u.arbitrary::<f64>()?),
        5 => Value::String(if u.arbitrary()? {
            u.choose(&WORDS)?.to_string()
        } else {
            let s: &str = u.arbitrary()?;
            s.chars().take(16).collect()
        }),
        6 => {
            let n = u.int_in_range(0..=3)?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(value(u, depth - 1)?);
            }
            Value::Array(v)
        }
        _ => {
            let n = u.int_in_range(0..=3)?;
            let mut m = Map::new();
            for _ in 0..n {
                let k = u.choose(&FIELDS)?.to_string();
                m.insert(k, value(u, depth - 1)?);
            }
            Value::Object(m)
        }
    })
}

/// How an `invocation.result` reports its outcome.
#[derive(Arbitrary, Debug, Clone)]
pub enum OutcomeChoice {
    Complete(Json),
    Continue(Json),
    Fail {
        code: u8,
        retryable: bool,
    },
    Cancelled {
        message: bool,
    },
    /// Any value as `outcome` (mostly a `bad_request`).
    Raw(Json),
}

/// Engine settings chosen per input, to reach the limits quickly (all zero, the
/// default: the engine's own limits).
#[derive(Arbitrary, Debug, Clone, Default)]
pub struct Setup {
    pub dispatch_timeout: u8,
    pub max_queued: u8,
    pub max_steps: u8,
    pub max_value: u8,
    /// Workers' outgoing queues of 4 frames instead of 4096 (slow-reader closes).
    pub small_worker_outbox: bool,
}

/// One thing a peer (or the test) does.
#[derive(Arbitrary, Debug, Clone)]
pub enum Action {
    /// A worker connection says `hello` (superseding its older connection).
    Hello {
        worker: u8,
        instance: u8,
        inflight: Vec<u8>,
        finished: Vec<u8>,
    },
    /// A worker connection ends.
    Disconnect {
        worker: u8,
    },
    Register {
        worker: u8,
        function: u8,
        concurrency: u8,
        timeout: u8,
        delivery: u8,
        max_attempts: u8,
    },
    Unregister {
        worker: u8,
        function: u8,
    },
    Submit {
        session: u8,
        function: u8,
        input: Json,
        key: u8,
        timeout: u8,
    },
    Get {
        turn: u8,
    },
    Wait {
        turn: u8,
        timeout: u8,
    },
    Stop {
        turn: u8,
        reason: bool,
    },
    StopSession {
        session: u8,
        reason: bool,
    },
    List {
        session: u8,
        status: u8,
        limit: u8,
        before: u8,
    },
    Inspect {
        session: u8,
    },
    Events {
        session: u8,
        after: u8,
        limit: u8,
    },
    Watch {
        session: u8,
        turn: u8,
        which: u8,
        after: u8,
    },
    Unwatch {
        watch: u8,
    },
    /// `invocation.result` from a worker (0, 1) or the operator (other values).
    Result {
        caller: u8,
        invocation: u8,
        outcome: OutcomeChoice,
    },
    Heartbeat {
        caller: u8,
        invocation: u8,
    },
    Status {
        caller: u8,
        invocation: u8,
        state: u8,
    },
    Stats,
    Workers,
    Functions,
    Check,
    Ping,
    /// Let time pass (timers fire).
    Advance {
        step: u8,
    },
    /// Switch store faults: 0 writes on, 1 writes off, 2 fail the next commit,
    /// 3 reads on, 4 reads off.
    Faults {
        kind: u8,
    },
    /// Crash and restart: a fresh runtime and engine on the same store.
    Restart,
    /// An op by index (or a bogus name) with any args, from any role.
    Raw {
        role: u8,
        op: u8,
        args: Json,
    },
    /// Any text as a frame, from any role.
    RawText {
        role: u8,
        text: String,
    },
}

fn pick<T: Copy>(list: &[T], i: u8) -> T {
    list[i as usize % list.len()]
}

/// A worker connection as the server holds it.
struct WorkerConn {
    worker_id: String,
    outbox: Outbox,
    rx: mpsc::Receiver<String>,
}

/// The client/operator connection (watches push to it).
struct ClientConn {
    outbox: Outbox,
    rx: mpsc::Receiver<String>,
}

/// Who sends a request.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Worker(usize),
    Client,
    Operator,
    /// A connection that never said hello.
    Anonymous,
}

/// What one run did, for the harness's own tests: answers per op and outcome.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// `(op, "ok" | error code)` → count.
    pub answers: std::collections::BTreeMap<(String, String), u64>,
    /// Invocations dispatched to the workers.
    pub invocations: usize,
    /// Turns learned.
    pub turns: usize,
    /// Checks that memory holds exactly the sessions with live work.
    pub memory_checks: u64,
    /// Reads of unknown ids (and stopped submits to a function nobody serves)
    /// whose effect on the sessions in memory was checked.
    pub unknown_reads: u64,
    /// Whether the registry was checked after the wind-down at the end.
    pub registry_checked: bool,
}

impl Report {
    pub fn count(&self, op: &str, outcome: &str) -> u64 {
        self.answers
            .get(&(op.to_string(), outcome.to_string()))
            .copied()
            .unwrap_or(0)
    }
}

/// Everything that survives a restart: the store and the ids learned so far.
struct Durable {
    faults: Arc<Faults>,
    store: Store,
    turns: Vec<String>,
    invocations: Vec<String>,
    next_conn: u64,
    next_req: u64,
    /// Fresh sessions made for submits to a function nobody serves.
    strays: u64,
    strict_internal: bool,
    report: Report,
}

/// One epoch: an engine and its connections, inside one runtime.
struct World<'d> {
    d: &'d mut Durable,
    engine: Engine,
    worker_cap: usize,
    workers: [Option<WorkerConn>; 2],
    client: ClientConn,
    watches: Vec<String>,
}

/// Decode an input into the engine's settings and up to [`MAX_ACTIONS`] actions.
pub fn decode(data: &[u8]) -> Option<(Setup, Vec<Action>)> {
    let mut u = Unstructured::new(data);
    let setup = Setup::arbitrary(&mut u).ok()?;
    let mut actions = Vec::new();
    while !u.is_empty() && actions.len() < MAX_ACTIONS {
        match Action::arbitrary(&mut u) {
            Ok(a) => actions.push(a),
            Err(_) => break,
        }
    }
    Some((setup, actions))
}

/// Run one input. With `TURND_FUZZ_PRINT=1` the decoded input is printed first.
pub fn run(data: &[u8]) {
    let Some((setup, actions)) = decode(data) else {
        return;
    };
    if std::env::var_os("TURND_FUZZ_PRINT").is_some() {
        eprintln!("{setup:?}\n{actions:#?}");
    }
    run_actions(&setup, &actions);
}

/// Run a decoded input (also used by the regression tests).
pub fn run_actions(setup: &Setup, actions: &[Action]) -> Report {
    let kv = Arc::new(MemKv::new());
    let (faulty, faults) = FaultyKv::new(kv.clone() as Arc<dyn Kv>);
    let store = Store::new(Arc::new(faulty));
    let mut d = Durable {
        faults,
        store,
        turns: Vec::new(),
        invocations: Vec::new(),
        next_conn: 0,
        next_req: 1,
        strays: 0,
        strict_internal: std::env::var_os("TURND_FUZZ_NO_INTERNAL").is_some_and(|v| v != "0"),
        report: Report::default(),
    };
    let cfg = engine_config(setup);
    let worker_cap = if setup.small_worker_outbox { 4 } else { 4096 };
    let epochs: Vec<&[Action]> = actions.split(|a| matches!(a, Action::Restart)).collect();
    let last = epochs.len() - 1;
    for (k, epoch) in epochs.into_iter().enumerate() {
        let (rt, engine) = open(&mut d, &cfg);
        rt.block_on(async {
            let mut w = World::new(&mut d, engine, worker_cap);
            w.check("after open (recovery)");
            w.settle().await;
            w.check_memory(|| "after open (recovery)".into()).await;
            for a in epoch {
                w.act(a).await;
                w.settle().await;
                w.check_between(a);
                w.check_memory(|| format!("after {a:?}")).await;
            }
            // Lift the faults and let pending retries and timers run, then check.
            w.d.faults.set_fail_writes(false);
            w.d.faults.set_fail_reads(false);
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_millis(2_100)).await;
                w.settle().await;
            }
            w.check("at the end of the epoch");
            w.check_memory(|| "at the end of the epoch".into()).await;
            // The input's end (not a crash): every connection ends, the linger
            // passes, and the registry must have forgotten what nothing refers to.
            if k == last {
                w.wind_down().await;
                w.check("after the wind-down");
            }
            w.engine.shutdown();
        });
        // Dropping the runtime drops every task of this engine, as a crash would.
        drop(rt);
    }
    let mut report = d.report;
    report.invocations = d.invocations.len();
    report.turns = d.turns.len();
    report
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime builds")
}

fn lift_faults(f: &Faults) {
    f.set_fail_writes(false);
    f.set_fail_reads(false);
    // No "clear" for a pending fail_nth: move it out of reach.
    f.fail_nth(1 << 62);
}

/// Start an engine on the store in a fresh runtime. A fault still pending (a
/// `fail_nth` that no commit consumed yet) may make recovery fail, as a daemon fails
/// to start on a disk error; then the store must still be consistent, and once the
/// fault is gone the engine must start.
fn open(d: &mut Durable, cfg: &EngineConfig) -> (tokio::runtime::Runtime, Engine) {
    let rt = runtime();
    match rt.block_on(Engine::open(d.store.clone(), cfg.clone())) {
        Ok(e) => return (rt, e),
        Err(e) => {
            drop(rt);
            lift_faults(&d.faults);
            let v = check_store(&d.store).expect("store.check reads the in-memory store");
            assert!(
                v.is_empty(),
                "store invariants violated after a failed start ({e}): {v:#?}"
            );
        }
    }
    let rt = runtime();
    let e = rt
        .block_on(Engine::open(d.store.clone(), cfg.clone()))
        .unwrap_or_else(|e| panic!("the engine does not start on a healthy store: {e}"));
    (rt, e)
}

fn engine_config(s: &Setup) -> EngineConfig {
    let mut c = turnd_server::Config::default().engine_config();
    c.turns.dispatch_timeout_ms = pick(
        &[None, None, Some(100), Some(1_000), Some(10_000)],
        s.dispatch_timeout,
    );
    c.turns.max_queued_per_session = pick(&[10_000, 10_000, 1, 2, 3], s.max_queued);
    c.turns.max_steps = pick(&[1_000, 1_000, 1, 2, 3], s.max_steps);
    c.turns.max_value_bytes = pick(&[512 * 1024, 512 * 1024, 16, 64], s.max_value);
    c
}

/// What the store holds that is live: the sessions with an unfinished turn, how
/// many unfinished turns there are, and the functions they name.
#[derive(Debug, Default)]
struct Live {
    sessions: BTreeSet<String>,
    turns: usize,
    functions: BTreeSet<String>,
}

fn live_in(store: &Store) -> Result<Live, turnd_store::StoreError> {
    let mut live = Live::default();
    for meta in store.session_metas()? {
        let unfinished = store.unfinished_turns(&meta)?;
        if unfinished.is_empty() {
            continue;
        }
        live.sessions.insert(meta.session_id.clone());
        live.turns += unfinished.len();
        live.functions
            .extend(unfinished.into_iter().map(|t| t.function_id));
    }
    Ok(live)
}

/// What the server concluded about one frame: the answer's JSON text, or an error.
type Answered = Result<String, ErrorBody>;

impl<'d> World<'d> {
    fn new(d: &'d mut Durable, engine: Engine, worker_cap: usize) -> Self {
        let client = Self::client_conn(d);
        World {
            d,
            engine,
            worker_cap,
            workers: [None, None],
            client,
            watches: Vec::new(),
        }
    }

    fn conn_id(d: &mut Durable, kind: &str) -> String {
        d.next_conn += 1;
        format!("c_{kind}_{}", d.next_conn)
    }

    fn client_conn(d: &mut Durable) -> ClientConn {
        let (outbox, rx) = Outbox::new(Self::conn_id(d, "client"), 4096);
        ClientConn { outbox, rx }
    }

    fn turn_id(&self, i: u8) -> String {
        if !self.d.turns.is_empty() && i < 240 {
            self.d.turns[i as usize % self.d.turns.len()].clone()
        } else {
            bogus_ids()[i as usize % 4].clone()
        }
    }

    /// Whether `turn_id(i)` is one of the bogus ids (no turn has it).
    fn bogus_turn(&self, i: u8) -> bool {
        self.d.turns.is_empty() || i >= 240
    }

    /// Session `i`: one of [`SESSIONS`], or from 240 on an id no other action
    /// names (longer than any string [`Json`] draws), with whether the store knows
    /// nothing of it.
    fn session_arg(&self, i: u8) -> (String, bool) {
        if i >= 240 {
            let id = format!("session-never-used-{i}");
            let unknown = self.no_such_session(&id);
            (id, unknown)
        } else {
            (pick(&SESSIONS, i).to_string(), false)
        }
    }

    fn invocation_id(&self, i: u8) -> String {
        if !self.d.invocations.is_empty() && i < 240 {
            self.d.invocations[i as usize % self.d.invocations.len()].clone()
        } else {
            bogus_ids()[i as usize % 4].clone()
        }
    }

    fn remember(list: &mut Vec<String>, id: &str) {
        if !list.iter().any(|x| x == id) {
            list.push(id.to_string());
        }
    }

    fn check(&self, when: &str) {
        let reads = self
            .d
            .faults
            .fail_reads
            .load(std::sync::atomic::Ordering::SeqCst);
        self.d.faults.set_fail_reads(false);
        let v = check_store(&self.d.store).expect("store.check reads the in-memory store");
        self.d.faults.set_fail_reads(reads);
        assert!(v.is_empty(), "store invariants violated {when}: {v:#?}");
    }

    fn check_between(&self, a: &Action) {
        let reads = self
            .d
            .faults
            .fail_reads
            .load(std::sync::atomic::Ordering::SeqCst);
        self.d.faults.set_fail_reads(false);
        let v = check_store(&self.d.store).expect("store.check reads the in-memory store");
        self.d.faults.set_fail_reads(reads);
        assert!(
            v.is_empty(),
            "store invariants violated after {a:?}: {v:#?}"
        );
    }

    /// What the store says is live, read with read faults lifted for the moment.
    fn live_in_store(&self) -> Live {
        let reads = self
            .d
            .faults
            .fail_reads
            .load(std::sync::atomic::Ordering::SeqCst);
        self.d.faults.set_fail_reads(false);
        let r = live_in(&self.d.store);
        self.d.faults.set_fail_reads(reads);
        r.unwrap_or_else(|e| panic!("the in-memory store does not read: {e}"))
    }

    /// Memory follows live work: the sessions in memory are exactly those with an
    /// unfinished turn in the store, and the index of live turns holds exactly the
    /// unfinished turns (the invariant of `turnd-engine/tests/memory_props.rs`).
    ///
    /// A session is also held while it has a live invocation, an armed timer or a
    /// write being retried, but each of those exists only for an unfinished turn
    /// (`machine::next_due` arms nothing for a session without a lock holder), so
    /// they add no session; a watch does not hold its session's state at all.
    ///
    /// Exact only once every user of a session has let go: a cell leaves memory
    /// when its last user drops it, and a drive that this action spawned (freed
    /// capacity, a timer that fired, a disconnect) may still hold one at the moment
    /// the action returns. Those run to the end at the current instant (no store
    /// operation here waits for time), so the check first lets runnable tasks run,
    /// without moving time, then checks.
    async fn check_memory(&mut self, when: impl FnOnce() -> String) {
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
        let live = self.live_in_store();
        let memory = self.engine.session_ids_in_memory();
        let want: Vec<String> = live.sessions.iter().cloned().collect();
        if memory != want {
            panic!(
                "sessions in memory {}: {memory:?}, but the sessions with an unfinished \
                 turn in the store are {want:?}",
                when()
            );
        }
        let indexed = self.engine.live_turn_index_len();
        if indexed != live.turns {
            panic!(
                "the index of live turns holds {indexed} entries {}, the store has {} \
                 unfinished turns",
                when(),
                live.turns
            );
        }
        self.d.report.memory_checks += 1;
    }

    /// Whether nothing in the store knows session `id` (an id the fuzzer's other
    /// actions could only reach through `RawText`).
    fn no_such_session(&self, id: &str) -> bool {
        let reads = self
            .d
            .faults
            .fail_reads
            .load(std::sync::atomic::Ordering::SeqCst);
        self.d.faults.set_fail_reads(false);
        let meta = self.d.store.session_meta(id);
        self.d.faults.set_fail_reads(reads);
        matches!(meta, Ok(None))
    }

    /// A request that names only unknown ids (`unknown`): nothing it touched may
    /// outlive it, so the sessions in memory are as many right after its answer as
    /// right before it. (Nothing else is runnable meanwhile: `settle` ran every
    /// task that was, and such a request wakes none.)
    async fn request_unknown(&mut self, unknown: bool, who: Who, op: &str, args: &Value) {
        if !unknown {
            return self.request(who, op, args).await;
        }
        self.settle().await;
        let before = self.engine.session_ids_in_memory();
        self.request(who, op, args).await;
        let after = self.engine.session_ids_in_memory();
        assert_eq!(
            before, after,
            "{op} naming only unknown ids changed the sessions in memory ({args})"
        );
        self.d.report.unknown_reads += 1;
    }

    /// A turn to a function nobody serves, on a fresh session, stopped at once:
    /// once it is cancelled, its session holds nothing live and must leave memory
    /// (and the function, known while the turn waited for it, is forgotten by the
    /// registry after the linger, which `wind_down` checks).
    async fn stray_submit(&mut self, function: u8, input: &Value, timeout: Option<u64>) {
        self.d.strays += 1;
        let session = format!("session-stray-{}", self.d.strays);
        let function = format!("function-nobody-serves-{function}");
        self.settle().await;
        let before = self.engine.session_ids_in_memory();
        let known = self.d.turns.len();
        let mut args = json!({
            "session_id": session,
            "function_id": function,
            "input": input,
        });
        if let Some(t) = timeout {
            args["turn_timeout_ms"] = json!(t);
        }
        self.request(Who::Client, "turn.submit", &args).await;
        // A new turn id is appended to what was learned (none if the submit failed).
        let Some(turn) = self.d.turns.get(known).cloned() else {
            return;
        };
        self.request(Who::Client, "turn.stop", &json!({ "turn_id": turn }))
            .await;
        self.settle().await;
        let reads = self
            .d
            .faults
            .fail_reads
            .load(std::sync::atomic::Ordering::SeqCst);
        self.d.faults.set_fail_reads(false);
        let stored = self.d.store.turn(&turn);
        self.d.faults.set_fail_reads(reads);
        // A stop that could not be written leaves the turn queued: live work.
        if let Ok(Some(t)) = stored {
            if t.status.is_terminal() {
                assert_eq!(
                    before,
                    self.engine.session_ids_in_memory(),
                    "a stopped turn to a function nobody serves left its session in memory"
                );
                self.d.report.unknown_reads += 1;
            }
        }
    }

    /// The end of the input: every worker connection ends, the client connection
    /// ends (dropping its watches), and the workers' linger passes on paused time
    /// (with two periods of the registry's forgetting task to spare). Then memory
    /// must hold only live sessions, no watch may be left, and the registry must
    /// hold no function that no unfinished turn names and no worker without a
    /// live invocation assigned to it.
    async fn wind_down(&mut self) {
        for i in 0..self.workers.len() {
            self.disconnect(i).await;
        }
        self.engine.connection_closed(&self.client.outbox.conn_id);
        self.client = Self::client_conn(self.d);
        self.watches.clear();
        assert_eq!(
            self.engine.watch_count(),
            0,
            "watches outlived their connection"
        );
        let linger = self.engine.config().turns.worker_linger_ms;
        // `registry_gc`: the forgetting task runs every quarter of the linger,
        // clamped to 50 ms ..= 60 s.
        let every = (linger / 4).clamp(50, 60_000);
        let step = (linger + 2 * every) / 16 + 1;
        for _ in 0..16 {
            tokio::time::sleep(Duration::from_millis(step)).await;
            self.settle().await;
        }
        self.check_memory(|| "after the wind-down".into()).await;
        let live = self.live_in_store();
        let listed = self.engine.functions();
        for f in &listed {
            if live.functions.contains(&f.function_id) {
                continue;
            }
            panic!(
                "function {} is still listed {linger} ms after its last worker left, and \
                 no unfinished turn names it (unfinished: {:?}): {listed:?}",
                f.function_id, live.functions
            );
        }
        let (workers, functions) = self.engine.registry_sizes();
        assert!(
            functions <= live.functions.len(),
            "the registry holds {functions} functions after the linger, but unfinished \
             turns name only {:?}",
            live.functions
        );
        let listed = self.engine.workers();
        assert_eq!(listed.len(), workers);
        let mut assigned = 0;
        for w in &listed {
            assert!(
                !w.connected && w.inflight > 0,
                "worker {} is kept {linger} ms after its connection ended with no live \
                 invocation: {listed:?}",
                w.worker_id
            );
            assigned += w.inflight;
        }
        // At most one live invocation per session, and only for an unfinished turn.
        assert!(
            assigned as usize <= live.sessions.len(),
            "{assigned} invocations still assigned to departed workers, for {} sessions \
             with an unfinished turn: {listed:?}",
            live.sessions.len()
        );
        self.d.report.registry_checked = true;
    }

    /// Let spawned tasks (drives after freed capacity, etc.) run, without moving time.
    async fn settle(&mut self) {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        self.drain().await;
    }

    /// Read every frame queued for the workers and the client, as their SDKs would;
    /// close connections whose outbox the server closed (as the server's connection
    /// task does).
    async fn drain(&mut self) {
        for i in 0..self.workers.len() {
            let Some(c) = self.workers[i].as_mut() else {
                continue;
            };
            while let Ok(f) = c.rx.try_recv() {
                let frame = decode_server_frame(&f)
                    .unwrap_or_else(|e| panic!("worker cannot decode a server frame: {e}\n{f}"));
                if let ServerFrame::Push(Push::Invoke(inv)) = frame {
                    Self::remember(&mut self.d.invocations, &inv.invocation_id);
                    Self::remember(&mut self.d.turns, &inv.turn_id);
                }
            }
            if c.outbox.is_closed() {
                self.disconnect(i).await;
            }
        }
        while let Ok(f) = self.client.rx.try_recv() {
            let frame = decode_server_frame(&f)
                .unwrap_or_else(|e| panic!("client cannot decode a server frame: {e}\n{f}"));
            match frame {
                ServerFrame::Ok { ok, .. } => {
                    let w: WatchOk = decode_as("watch", &ok);
                    Self::remember(&mut self.watches, &w.watch_id);
                }
                ServerFrame::Push(Push::Event { event, .. }) => {
                    Self::remember(&mut self.d.turns, &event.turn_id);
                }
                ServerFrame::Error { error, .. } => {
                    panic!("error frame on the client outbox: {error}")
                }
                ServerFrame::Push(p) => panic!("worker push on a client connection: {p:?}"),
            }
        }
        if self.client.outbox.is_closed() {
            self.engine.connection_closed(&self.client.outbox.conn_id);
            self.client = Self::client_conn(self.d);
            self.watches.clear();
        }
    }

    async fn disconnect(&mut self, i: usize) {
        if let Some(c) = self.workers[i].take() {
            self.engine.connection_closed(&c.outbox.conn_id);
            self.engine
                .worker_disconnected(&c.worker_id, &c.outbox.conn_id)
                .await;
        }
    }

    async fn act(&mut self, a: &Action) {
        match a {
            Action::Hello {
                worker,
                instance,
                inflight,
                finished,
            } => {
                let wi = *worker as usize % WORKERS.len();
                let mut args = json!({
                    "protocol": PROTOCOL_VERSION,
                    "role": "worker",
                    "worker_id": WORKERS[wi],
                    "inflight": inflight.iter().take(4).map(|i| self.invocation_id(*i)).collect::<Vec<_>>(),
                    "finished": finished.iter().take(4).map(|i| self.invocation_id(*i)).collect::<Vec<_>>(),
                });
                // Instance: i0, i1, or none (the connection id stands in).
                if (*instance as usize % 3) < 2 {
                    args["instance_id"] = json!(INSTANCES[*instance as usize % 3]);
                }
                let text = self.frame("hello", &args);
                self.hello(wi, &text).await;
            }
            Action::Disconnect { worker } => {
                self.disconnect(*worker as usize % WORKERS.len()).await;
            }
            Action::Register {
                worker,
                function,
                concurrency,
                timeout,
                delivery,
                max_attempts,
            } => {
                let mut args = json!({ "function_id": pick(&FUNCTIONS, *function) });
                if let Some(c) = pick(
                    &[None, Some(1), Some(2), Some(0), Some(10_001)],
                    *concurrency,
                ) {
                    args["concurrency"] = json!(c);
                }
                if let Some(t) = pick(
                    &[
                        None,
                        Some(1u64),
                        Some(100),
                        Some(1_000),
                        Some(30_000),
                        Some(0),
                    ],
                    *timeout,
                ) {
                    args["timeout_ms"] = json!(t);
                }
                if let Some(dl) = pick(
                    &[None, Some("at_most_once"), Some("at_least_once")],
                    *delivery,
                ) {
                    args["delivery"] = json!(dl);
                }
                if let Some(m) = pick(
                    &[None, Some(1u32), Some(2), Some(3), Some(0)],
                    *max_attempts,
                ) {
                    args["max_attempts"] = json!(m);
                }
                self.request(
                    Who::Worker(*worker as usize % 2),
                    "function.register",
                    &args,
                )
                .await;
            }
            Action::Unregister { worker, function } => {
                let args = json!({ "function_id": pick(&FUNCTIONS, *function) });
                self.request(
                    Who::Worker(*worker as usize % 2),
                    "function.unregister",
                    &args,
                )
                .await;
            }
            Action::Submit {
                function,
                input,
                timeout,
                ..
            } if *function >= 240 => {
                let t = pick(
                    &[None, None, Some(1u64), Some(1_000), Some(60_000)],
                    *timeout,
                );
                self.stray_submit(*function, &input.0, t).await;
            }
            Action::Submit {
                session,
                function,
                input,
                key,
                timeout,
            } => {
                let mut args = json!({
                    "session_id": pick(&SESSIONS, *session),
                    "function_id": pick(&FUNCTIONS, *function),
                    "input": input.0,
                });
                if let Some(k) = pick(&[None, Some(KEYS[0]), Some(KEYS[1])], *key) {
                    args["idempotency_key"] = json!(k);
                }
                if let Some(t) = pick(
                    &[None, None, Some(1u64), Some(1_000), Some(60_000), Some(0)],
                    *timeout,
                ) {
                    args["turn_timeout_ms"] = json!(t);
                }
                self.request(Who::Client, "turn.submit", &args).await;
            }
            Action::Get { turn } => {
                let args = json!({ "turn_id": self.turn_id(*turn) });
                self.request_unknown(self.bogus_turn(*turn), Who::Client, "turn.get", &args)
                    .await;
            }
            Action::Wait { turn, timeout } => {
                let args = json!({
                    "turn_id": self.turn_id(*turn),
                    "timeout_ms": pick(&[0u64, 10, 1_000, 30_000, 300_001], *timeout),
                });
                self.request_unknown(self.bogus_turn(*turn), Who::Client, "turn.wait", &args)
                    .await;
            }
            Action::Stop { turn, reason } => {
                let mut args = json!({ "turn_id": self.turn_id(*turn) });
                if *reason {
                    args["reason"] = json!("fuzz");
                }
                self.request_unknown(self.bogus_turn(*turn), Who::Client, "turn.stop", &args)
                    .await;
            }
            Action::StopSession { session, reason } => {
                let (id, unknown) = self.session_arg(*session);
                let mut args = json!({ "session_id": id });
                if *reason {
                    args["reason"] = json!("fuzz");
                }
                self.request_unknown(unknown, Who::Client, "session.stop", &args)
                    .await;
            }
            Action::List {
                session,
                status,
                limit,
                before,
            } => {
                let (id, unknown) = self.session_arg(*session);
                let mut args = json!({ "session_id": id });
                if let Some(s) = pick(
                    &[
                        None,
                        Some("queued"),
                        Some("running"),
                        Some("completed"),
                        Some("failed"),
                        Some("cancelled"),
                    ],
                    *status,
                ) {
                    args["status"] = json!(s);
                }
                if let Some(l) = pick(&[None, Some(1u64), Some(2), Some(0), Some(1_001)], *limit) {
                    args["limit"] = json!(l);
                }
                if let Some(b) = pick(
                    &[None, Some(0u64), Some(1), Some(2), Some(3), Some(u64::MAX)],
                    *before,
                ) {
                    args["before_seq"] = json!(b);
                }
                self.request_unknown(unknown, Who::Client, "turn.list", &args)
                    .await;
            }
            Action::Inspect { session } => {
                let (id, unknown) = self.session_arg(*session);
                let args = json!({ "session_id": id });
                self.request_unknown(unknown, Who::Client, "session.inspect", &args)
                    .await;
            }
            Action::Events {
                session,
                after,
                limit,
            } => {
                let (id, unknown) = self.session_arg(*session);
                let mut args = json!({ "session_id": id });
                if let Some(x) = pick(
                    &[None, Some(0u64), Some(1), Some(3), Some(u64::MAX)],
                    *after,
                ) {
                    args["after"] = json!(x);
                }
                if let Some(l) = pick(&[None, Some(1u64), Some(2), Some(0), Some(1_001)], *limit) {
                    args["limit"] = json!(l);
                }
                self.request_unknown(unknown, Who::Client, "session.events", &args)
                    .await;
            }
            Action::Watch {
                session,
                turn,
                which,
                after,
            } => {
                let mut args = json!({});
                // A watch of a session nobody used registers the watch (live work
                // of its own) but holds no session state.
                let mut unknown = false;
                match which % 4 {
                    0 => {
                        let (id, u) = self.session_arg(*session);
                        unknown = u;
                        args["session_id"] = json!(id);
                    }
                    1 => {
                        unknown = self.bogus_turn(*turn);
                        args["turn_id"] = json!(self.turn_id(*turn));
                    }
                    2 => {
                        args["session_id"] = json!(pick(&SESSIONS, *session));
                        args["turn_id"] = json!(self.turn_id(*turn));
                    }
                    _ => {}
                }
                if let Some(x) = pick(&[None, Some(0u64), Some(2), Some(u64::MAX)], *after) {
                    args["after"] = json!(x);
                }
                self.request_unknown(unknown, Who::Client, "watch", &args)
                    .await;
            }
            Action::Unwatch { watch } => {
                let id = if self.watches.is_empty() || *watch >= 240 {
                    "w_nope".to_string()
                } else {
                    self.watches[*watch as usize % self.watches.len()].clone()
                };
                self.request(Who::Client, "unwatch", &json!({ "watch_id": id }))
                    .await;
            }
            Action::Result {
                caller,
                invocation,
                outcome,
            } => {
                let outcome = match outcome {
                    OutcomeChoice::Complete(v) => json!({ "complete": v.0 }),
                    OutcomeChoice::Continue(v) => json!({ "continue": v.0 }),
                    OutcomeChoice::Fail { code, retryable } => json!({
                        "fail": { "code": pick(&["boom", "", "e2"], *code), "message": "m", "retryable": retryable }
                    }),
                    OutcomeChoice::Cancelled { message } => {
                        json!({ "cancelled": if *message { json!({"message": "bye"}) } else { json!({}) } })
                    }
                    OutcomeChoice::Raw(v) => v.0.clone(),
                };
                let args =
                    json!({ "invocation_id": self.invocation_id(*invocation), "outcome": outcome });
                self.request(worker_or_operator(*caller), "invocation.result", &args)
                    .await;
            }
            Action::Heartbeat { caller, invocation } => {
                let args = json!({ "invocation_id": self.invocation_id(*invocation) });
                self.request(worker_or_operator(*caller), "invocation.heartbeat", &args)
                    .await;
            }
            Action::Status {
                caller,
                invocation,
                state,
            } => {
                let args = json!({
                    "invocation_id": self.invocation_id(*invocation),
                    "state": pick(&["running", "finished", "unknown"], *state),
                });
                self.request(worker_or_operator(*caller), "invocation.status", &args)
                    .await;
            }
            Action::Stats => self.request(Who::Client, "stats", &json!({})).await,
            Action::Workers => self.request(Who::Client, "workers.list", &json!({})).await,
            Action::Functions => {
                self.request(Who::Client, "functions.list", &json!({}))
                    .await
            }
            Action::Check => self.request(Who::Operator, "store.check", &json!({})).await,
            Action::Ping => self.request(Who::Client, "ping", &json!({})).await,
            Action::Advance { step } => {
                let ms = pick(
                    &[0u64, 1, 50, 500, 2_001, 5_001, 10_001, 30_001, 120_000],
                    *step,
                );
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Action::Faults { kind } => match kind % 5 {
                0 => self.d.faults.set_fail_writes(true),
                1 => self.d.faults.set_fail_writes(false),
                2 => self.d.faults.fail_nth(1),
                3 => self.d.faults.set_fail_reads(true),
                _ => self.d.faults.set_fail_reads(false),
            },
            Action::Restart => {}
            Action::Raw { role, op, args } => {
                let name = if (*op as usize) < Op::ALL.len() {
                    Op::ALL[*op as usize].name()
                } else {
                    pick(&["turn.submitt", "", "HELLO"], *op)
                };
                let who = raw_who(*role);
                let text = self.frame(name, &args.0);
                self.frame_from(who, &text).await;
            }
            Action::RawText { role, text } => {
                let who = raw_who(*role);
                self.frame_from(who, text).await;
            }
        }
    }

    fn frame(&mut self, op: &str, args: &Value) -> String {
        let id = self.d.next_req;
        self.d.next_req += 1;
        encode_request(id, op, args)
    }

    async fn request(&mut self, who: Who, op: &str, args: &Value) {
        let text = self.frame(op, args);
        self.frame_from(who, &text).await;
    }

    /// A worker connection's `hello` frame: a new connection for `wi`.
    async fn hello(&mut self, wi: usize, text: &str) {
        let req = decode_raw_request(text).expect("the harness builds valid frames");
        let (outbox, rx) = Outbox::new(Self::conn_id(self.d, "worker"), self.worker_cap);
        let r: Answered = async {
            let h: HelloArgs = router::decode(req.args_text())?;
            if h.protocol != PROTOCOL_VERSION {
                return Err(ErrorBody::new(ErrorCode::UnsupportedProtocol, "protocol"));
            }
            let rec = self.engine.worker_hello(&h, outbox.clone()).await?;
            ok(HelloOk {
                server: "turnd".into(),
                version: "fuzz".into(),
                boot_id: self.engine.boot_id().to_string(),
                connection_id: outbox.conn_id.clone(),
                heartbeat_ms: 10_000,
                max_frame_bytes: 1 << 20,
                reconciled: Some(rec),
            })
        }
        .await;
        let accepted = r.is_ok();
        self.respond(req.id, "hello", r);
        if accepted {
            let old = self.workers[wi].replace(WorkerConn {
                worker_id: WORKERS[wi].to_string(),
                outbox,
                rx,
            });
            // The superseded connection's task ends and reports its disconnect.
            if let Some(old) = old {
                self.engine.connection_closed(&old.outbox.conn_id);
                self.engine
                    .worker_disconnected(&old.worker_id, &old.outbox.conn_id)
                    .await;
            }
        }
    }

    /// Handle one text frame from a connection, as the server's reader loop does.
    async fn frame_from(&mut self, who: Who, text: &str) {
        let req = match decode_raw_request(text) {
            Ok(r) => r,
            Err(fe) => {
                self.respond_error(
                    fe.id,
                    "(frame)",
                    ErrorBody::new(ErrorCode::BadFrame, fe.message),
                );
                return;
            }
        };
        if req.op == Op::Hello.name() {
            // Every connection of the model has said hello already (or, anonymous,
            // is not worth a second model of hello): the server's answer.
            let e = ErrorBody::new(ErrorCode::Conflict, "this connection already said hello");
            self.respond_error(Some(req.id), &req.op.clone(), e);
            return;
        }
        let (role, worker_id) = match who {
            Who::Worker(i) => match &self.workers[i] {
                Some(c) => (Role::Worker, Some(c.worker_id.clone())),
                None => {
                    // That worker has no connection: as a connection without hello.
                    let e = ErrorBody::new(ErrorCode::NotAuthenticated, "send `hello` first");
                    self.respond_error(Some(req.id), &req.op.clone(), e);
                    return;
                }
            },
            Who::Client => (Role::Client, None),
            Who::Operator => (Role::Operator, None),
            Who::Anonymous => {
                let e = ErrorBody::new(ErrorCode::NotAuthenticated, "send `hello` first");
                self.respond_error(Some(req.id), &req.op.clone(), e);
                return;
            }
        };
        let caller = Caller { role, worker_id };
        let outbox = match who {
            Who::Worker(i) => self.workers[i].as_ref().map(|c| &c.outbox),
            _ => None,
        };
        let origin = Origin {
            outbox: outbox.unwrap_or(&self.client.outbox),
            max_watches: 64,
            request_id: req.id,
        };
        let r = router::dispatch(
            &self.engine,
            &caller,
            &req.op,
            req.args_text(),
            Some(&origin),
        )
        .await;
        let op = req.op.clone();
        match r {
            Ok(Answer::Reply(text)) => self.respond(req.id, &op, Ok(text)),
            // A watch: answered on the client's outbox, read by `drain`.
            Ok(Answer::Queued) => {}
            Err(e) => self.respond_error(Some(req.id), &op, e),
        }
    }

    /// Encode the answer as the server would, decode it as the SDK would, and learn
    /// the ids it names.
    fn tally(&mut self, op: &str, outcome: &str) {
        *self
            .d
            .report
            .answers
            .entry((op.to_string(), outcome.to_string()))
            .or_insert(0) += 1;
    }

    fn respond(&mut self, id: u64, op: &str, r: Answered) {
        let ok = match r {
            Ok(v) => v,
            Err(e) => return self.respond_error(Some(id), op, e),
        };
        self.tally(op, "ok");
        let text = encode_ok_text(id, &ok);
        let v = match decode_server_frame(&text) {
            Ok(ServerFrame::Ok { id: back, ok }) if back == id => ok,
            other => panic!("ok response does not decode as one: {other:?}\n{text}"),
        };
        match op {
            "hello" => {
                let _: HelloOk = decode_as(op, &v);
            }
            "function.register" => {
                let _: RegisterOk = decode_as(op, &v);
            }
            "invocation.result" => {
                let _: ResultOk = decode_as(op, &v);
            }
            "invocation.heartbeat" => {
                let _: HeartbeatOk = decode_as(op, &v);
            }
            "turn.submit" => {
                let s: SubmitOk = decode_as(op, &v);
                Self::remember(&mut self.d.turns, &s.turn.turn_id);
            }
            "turn.get" | "turn.wait" | "turn.stop" => {
                let t: TurnOk = decode_as(op, &v);
                Self::remember(&mut self.d.turns, &t.turn.turn_id);
            }
            "session.stop" => {
                let t: TurnsOk = decode_as(op, &v);
                for t in t.turns {
                    Self::remember(&mut self.d.turns, &t.turn_id);
                }
            }
            "turn.list" => {
                let t: ListOk = decode_as(op, &v);
                for t in t.turns {
                    Self::remember(&mut self.d.turns, &t.turn_id);
                }
            }
            "session.inspect" => {
                let _: SessionOk = decode_as(op, &v);
            }
            "session.events" => {
                let _: EventsOk = decode_as(op, &v);
            }
            "stats" => {
                let _: StatsOk = decode_as(op, &v);
            }
            "workers.list" => {
                let _: WorkersOk = decode_as(op, &v);
            }
            "functions.list" => {
                let _: FunctionsOk = decode_as(op, &v);
            }
            "sessions.list" => {
                let _: SessionsListOk = decode_as(op, &v);
            }
            "store.check" => {
                let c: CheckOk = decode_as(op, &v);
                assert!(
                    c.violations.is_empty(),
                    "store.check answered violations: {:#?}",
                    c.violations
                );
            }
            _ => {}
        }
    }

    fn respond_error(&mut self, id: Option<u64>, op: &str, e: ErrorBody) {
        self.tally(op, e.code.as_str());
        if self.d.strict_internal {
            assert!(
                e.code != ErrorCode::Internal,
                "internal error answered: {e}"
            );
        }
        let text = encode_error(id, &e);
        match decode_server_frame(&text) {
            Ok(ServerFrame::Error { id: back, error }) if back == id && error == e => {}
            other => panic!("error response does not decode as one: {other:?}\n{text}"),
        }
    }
}

fn worker_or_operator(c: u8) -> Who {
    match c % 3 {
        0 => Who::Worker(0),
        1 => Who::Worker(1),
        _ => Who::Operator,
    }
}

fn raw_who(r: u8) -> Who {
    match r % 5 {
        0 => Who::Worker(0),
        1 => Who::Worker(1),
        2 => Who::Client,
        3 => Who::Operator,
        _ => Who::Anonymous,
    }
}

fn ok<T: serde::Serialize>(v: T) -> Answered {
    serde_json::to_string(&v)
        .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("encode response: {e}")))
}

fn decode_as<T: DeserializeOwned>(op: &str, v: &Value) -> T {
    serde_json::from_value(v.clone())
        .unwrap_or_else(|e| panic!("the SDK cannot decode the result of {op}: {e}\n{v}"))
}
