//! The client commands of the `turnd` binary: submit, inspect, stop and follow turns
//! and sessions on a running daemon, list its workers and functions, show its status,
//! and check a store (online through the daemon, or offline on a stopped daemon's
//! data directory).
//!
//! Every daemon call goes through the SDK (`turnd-client`), so the CLI is one more
//! well-behaved peer of protocol v1. `--url` may name a cluster's nodes, separated
//! by commas: the first that answers is used, and when none does the error names
//! each and why. This module owns the arguments, the connection
//! and the mapping of failures to messages and exit codes; [`commands`] has one
//! function per command, [`render`] the human views and [`fmt`] the text helpers.
//!
//! Exit codes: 0 success; 1 the daemon refused the request (`turnd: <code>:
//! <message>`), a turn did not complete (`submit --wait`, `wait`, `turn` of a failed
//! or cancelled turn), or `check` found violations; 2 the daemon
//! cannot be reached (or the connection was lost), bad usage, or an offline store
//! cannot be opened; 3 a wait timed out with the turn still unfinished.

mod agent;
mod commands;
mod fmt;
mod render;
mod sessions;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::Value;
use turnd_client::{Caller, ClientError, Connection};
use turnd_proto::{
    ErrorBody, ErrorCode, HelloArgs, HelloOk, OnBusy, Role, TurnStatus, PROTOCOL_VERSION,
};

/// Where the daemon listens unless told otherwise (its embedded default).
pub const DEFAULT_URL: &str = "ws://127.0.0.1:7420/v1";

/// How long connecting (TCP, WebSocket upgrade and `hello`) may take before the
/// daemon is taken to be unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Options every client command takes.
#[derive(Args, Debug, Clone)]
pub struct Common {
    /// The daemon's WebSocket URL, or a cluster's nodes' URLs separated by commas:
    /// the first that answers is used.
    #[arg(long, env = "TURND_URL", default_value = DEFAULT_URL, value_parser = parse_urls)]
    pub url: Urls,
    /// Token sent in `hello` (a client token, or an operator token).
    #[arg(long, env = "TURND_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON (the protocol's objects) instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Submit a turn to a session's queue and print it.
    ///
    /// With --json the turn object gets one more member, "deduplicated": true when an
    /// earlier submit with the same --idempotency-key made it. With --wait, wait until
    /// the turn is finished: exit 0 when it completed, 1 when it failed or was
    /// cancelled, 3 when --timeout-secs passed first.
    Submit(SubmitCmd),
    /// Show one turn: status, step, attempt, times, output or error, and its wait.
    ///
    /// Exit 0 when the turn completed or is not finished yet, 1 when it failed or was
    /// cancelled (as `wait`).
    Turn(TurnCmd),
    /// List a session's turns, newest first, a page at a time.
    ///
    /// --status keeps one status; --limit sets the page size (1 to 1000, default
    /// 100); --before SEQ pages back (the command prints the next one when more
    /// turns may follow).
    Turns(TurnsCmd),
    /// Wait until a turn is finished and print it.
    ///
    /// Exit 0 when it completed, 1 when it failed or was cancelled, 3 when
    /// --timeout-secs passed with the turn still unfinished.
    Wait(WaitCmd),
    /// Give a turn that waits for input (its step suspended it) the input.
    ///
    /// Prints the turn once the resume is durable; with --wait, waits until it is
    /// finished (exit codes as `wait`). Exit 1 (`conflict`) when the turn is not
    /// awaiting input.
    Resume(ResumeCmd),
    /// Follow one turn's events as they come until it is finished; with --progress
    /// also the progress its steps stream (a model's tokens).
    ///
    /// Exit 0 when it completed, 1 when it failed or was cancelled.
    Watch(WatchCmd),
    /// Stop a turn, or every unfinished turn of a session (--session).
    ///
    /// Stopping a turn that had already finished changes nothing; the command says so
    /// and exits 0.
    Stop(StopCmd),
    /// Show a session: who holds its lock and why it waits, its queue, its counts.
    Inspect(InspectCmd),
    /// List a session's events; --follow keeps printing new ones until Ctrl-C.
    ///
    /// The table cuts long details; --json prints every event whole.
    Events(EventsCmd),
    /// List the workers the daemon knows.
    Workers(PlainCmd),
    /// List the registered functions and their settings.
    Functions(PlainCmd),
    /// One screen of daemon health: sessions, waits, turns, workers, storage, and
    /// the sessions waiting longest.
    Status(PlainCmd),
    /// List the sessions with unfinished work: what each lock holder waits for, since
    /// when, until when and what happens then; oldest wait first.
    Sessions(sessions::SessionsCmd),
    /// Check the store's invariants: online through the daemon (operator role), or
    /// offline on a stopped daemon's data directory (--data-dir).
    ///
    /// Exit 0 when there are no violations, 1 when there are.
    Check(CheckCmd),
    /// Check that the daemon answers, and show its version.
    Ping(PlainCmd),
}

#[derive(Args, Debug)]
pub struct SubmitCmd {
    /// The session whose FIFO queue the turn joins.
    #[arg(long)]
    pub session: String,
    /// The function that runs the turn's steps.
    #[arg(long)]
    pub function: String,
    /// The turn's input, as JSON.
    #[arg(long, default_value = "null", value_parser = parse_json)]
    pub input: Value,
    /// Resubmitting with the same key in the same session returns the existing turn.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// The whole turn's time limit (the daemon's default when absent).
    #[arg(long)]
    pub turn_timeout_ms: Option<u64>,
    /// When the session already has an unfinished turn: queue behind it
    /// (`enqueue`, the default), fail with `busy` storing nothing (`reject`), stop
    /// it and run this one with what it had (`interrupt`), or the same, marking it
    /// superseded (`rollback`).
    #[arg(long, value_parser = parse_on_busy)]
    pub on_busy: Option<OnBusy>,
    #[command(flatten)]
    pub waiting: WaitOpts,
    #[command(flatten)]
    pub common: Common,
}

/// `--wait` and `--timeout-secs` of a command that may wait for its turn to finish.
#[derive(Args, Debug)]
pub struct WaitOpts {
    /// Wait until the turn is finished.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up waiting after this long (exit 3).
    #[arg(long, default_value_t = 30, requires = "wait")]
    pub timeout_secs: u64,
}

#[derive(Args, Debug)]
pub struct ResumeCmd {
    /// The turn's id (`t_…`).
    pub turn_id: String,
    /// The input, as JSON (a string with its quotes); the next step gets
    /// `{"state", "input"}`.
    #[arg(long, value_parser = parse_json, default_value = "null")]
    pub input: Value,
    /// Makes a resend of this resume harmless: answered with the turn it resumed.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    #[command(flatten)]
    pub waiting: WaitOpts,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct WatchCmd {
    /// The turn's id (`t_…`).
    pub turn_id: String,
    /// Also print the progress of its steps (with --json, each `progress` push).
    #[arg(long)]
    pub progress: bool,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct TurnCmd {
    /// The turn's id (`t_…`).
    pub turn_id: String,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct TurnsCmd {
    /// The session's id.
    pub session: String,
    /// Only turns with this status.
    #[arg(long, value_parser = parse_status)]
    pub status: Option<TurnStatus>,
    /// At most this many turns (1 to 1000; the daemon's default is 100).
    #[arg(long)]
    pub limit: Option<u64>,
    /// Only turns with a sequence number below this (the next page).
    #[arg(long)]
    pub before: Option<u64>,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct WaitCmd {
    /// The turn's id (`t_…`).
    pub turn_id: String,
    /// Give up waiting after this long (exit 3).
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["turn_id", "session"])))]
pub struct StopCmd {
    /// The turn to stop.
    pub turn_id: Option<String>,
    /// Stop every unfinished turn of this session instead.
    #[arg(long)]
    pub session: Option<String>,
    /// Why; recorded with the stop and shown on the turn.
    #[arg(long, default_value = "stopped with turnd stop")]
    pub reason: String,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct InspectCmd {
    /// The session's id.
    pub session: String,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct EventsCmd {
    /// The session's id.
    pub session: String,
    /// Only events with a sequence number greater than this.
    #[arg(long)]
    pub after: Option<u64>,
    /// At most this many events (1 to 1000; the daemon's default is 100). With
    /// --follow, the page size used to read the history.
    #[arg(long)]
    pub limit: Option<u64>,
    /// Keep printing new events until Ctrl-C, reconnecting and resuming after the
    /// last one printed if the connection is lost. With --json, one event per line.
    #[arg(long)]
    pub follow: bool,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct PlainCmd {
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug)]
pub struct CheckCmd {
    /// Check the store in this directory (a stopped daemon's storage.data_dir)
    /// without a daemon.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub common: Common,
}

/// The URLs of `--url`, in the order they are tried (never empty).
#[derive(Debug, Clone)]
pub struct Urls(pub Vec<String>);

fn parse_urls(s: &str) -> Result<Urls, String> {
    turnd_client::url::parse_url_list(s).map(Urls)
}

fn parse_json(s: &str) -> Result<Value, String> {
    serde_json::from_str(s).map_err(|e| {
        // A bare word is the usual slip: say how to give it as a JSON string.
        let quoted = serde_json::to_string(s).unwrap_or_default();
        format!(
            "not valid JSON ({e}); inputs are JSON: a string is written with its quotes, \
             --input '{quoted}'"
        )
    })
}

fn parse_on_busy(s: &str) -> Result<OnBusy, String> {
    serde_json::from_value(Value::String(s.to_string()))
        .map_err(|_| "one of enqueue, reject, interrupt, rollback".to_string())
}

fn parse_status(s: &str) -> Result<TurnStatus, String> {
    TurnStatus::ALL
        .iter()
        .copied()
        .find(|t| t.as_str() == s)
        .ok_or_else(|| {
            let all: Vec<&str> = TurnStatus::ALL.iter().map(|t| t.as_str()).collect();
            format!("one of {}", all.join(", "))
        })
}

/// Why a command did not succeed; each maps to one message line and an exit code.
#[derive(Debug)]
pub enum Failure {
    /// Connecting failed: refused, unresolvable, timed out, not a WebSocket server.
    Unreachable { url: String, reason: String },
    /// Connecting to each of several URLs failed: each URL and why.
    NoneReachable(Vec<(String, String)>),
    /// The connection ended before an answer arrived.
    Lost { url: String },
    /// The daemon refused the request.
    Protocol(ErrorBody),
    /// Bad usage, or something the command needs is missing (exit 2).
    Usage(String),
    /// Anything else (exit 1).
    Other(String),
    /// Exit with this code without a message (the output was already printed, or
    /// stdout was closed by its reader).
    Quiet(i32),
}

impl Failure {
    pub fn exit_code(&self) -> i32 {
        match self {
            Failure::Unreachable { .. }
            | Failure::NoneReachable(_)
            | Failure::Lost { .. }
            | Failure::Usage(_) => 2,
            Failure::Protocol(_) | Failure::Other(_) => 1,
            Failure::Quiet(code) => *code,
        }
    }

    /// Whether reconnecting may help (used by `events --follow`).
    fn is_transient(&self) -> bool {
        match self {
            Failure::Unreachable { .. } | Failure::NoneReachable(_) | Failure::Lost { .. } => true,
            Failure::Protocol(body) => body.retryable || body.code.retryable(),
            _ => false,
        }
    }

    fn from_client(url: &str, e: ClientError) -> Failure {
        match e {
            ClientError::Protocol(body) => Failure::Protocol(body),
            ClientError::Connect(msg) => Failure::Unreachable {
                url: url.to_string(),
                // The SDK prefixes the URL; it is in our message already.
                reason: msg
                    .strip_prefix(&format!("{url}: "))
                    .unwrap_or(&msg)
                    .to_string(),
            },
            ClientError::Closed => Failure::Lost {
                url: url.to_string(),
            },
            ClientError::Decode(msg) => {
                Failure::Other(format!("could not understand the daemon's answer: {msg}"))
            }
            ClientError::Timeout => Failure::Other("timed out".to_string()),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Unreachable { url, reason } => {
                write!(f, "cannot reach the daemon at {url}: {reason}")
            }
            Failure::NoneReachable(each) => {
                f.write_str("cannot reach the daemon at any of its URLs: ")?;
                for (i, (url, reason)) in each.iter().enumerate() {
                    let sep = if i == 0 { "" } else { "; " };
                    write!(f, "{sep}{url}: {reason}")?;
                }
                Ok(())
            }
            Failure::Lost { url } => write!(
                f,
                "lost the connection to the daemon at {url} before it answered"
            ),
            Failure::Protocol(body) => write!(f, "{}: {}", body.code, body.message),
            Failure::Usage(m) | Failure::Other(m) => f.write_str(m),
            Failure::Quiet(_) => Ok(()),
        }
    }
}

/// Attach the daemon's URL to an SDK result.
trait At<T> {
    fn at(self, url: &str) -> Result<T, Failure>;
}

impl<T> At<T> for Result<T, ClientError> {
    fn at(self, url: &str) -> Result<T, Failure> {
        self.map_err(|e| Failure::from_client(url, e))
    }
}

/// A greeted connection to the daemon.
pub struct Conn {
    pub caller: Caller,
    pub hello: HelloOk,
    pub url: String,
}

impl Conn {
    /// Connect to the first of `common.url`'s URLs that answers and say hello as
    /// `role`. A refusal of the `hello` other than a retryable one ends the search:
    /// every node would give it.
    pub async fn open(common: &Common, role: Role) -> Result<Conn, Failure> {
        let mut unreachable = Vec::new();
        for url in &common.url.0 {
            match Conn::open_one(common, role, url).await {
                Ok(conn) => return Ok(conn),
                Err(Failure::Unreachable { url, reason }) => unreachable.push((url, reason)),
                Err(f) if f.is_transient() => unreachable.push((url.clone(), f.to_string())),
                Err(f) => return Err(f),
            }
        }
        // One URL fails as it always did; several name each.
        if let [(url, reason)] = unreachable.as_slice() {
            return Err(Failure::Unreachable {
                url: url.clone(),
                reason: reason.clone(),
            });
        }
        Err(Failure::NoneReachable(unreachable))
    }

    /// Connect to `url` and say hello as `role`.
    async fn open_one(common: &Common, role: Role, url: &str) -> Result<Conn, Failure> {
        let url = url.to_string();
        let hello = HelloArgs {
            protocol: PROTOCOL_VERSION,
            role,
            token: common.token.clone().filter(|t| !t.is_empty()),
            name: Some("turnd-cli".to_string()),
            worker_id: None,
            instance_id: None,
            inflight: Vec::new(),
            finished: Vec::new(),
        };
        let (conn, hello) =
            match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(&url, hello)).await {
                Ok(Ok(x)) => x,
                Ok(Err(ClientError::Closed)) => {
                    return Err(Failure::Unreachable {
                        url,
                        reason: "the connection closed before `hello` was answered".to_string(),
                    })
                }
                Ok(Err(ClientError::Protocol(body)))
                    if body.code == ErrorCode::NotAuthenticated =>
                {
                    return Err(Failure::Other(token_refused(common, role, &body)))
                }
                Ok(Err(e)) => return Err(Failure::from_client(&url, e)),
                Err(_) => {
                    return Err(Failure::Unreachable {
                        url,
                        reason: format!("no answer within {}s", CONNECT_TIMEOUT.as_secs()),
                    })
                }
            };
        Ok(Conn {
            caller: Caller::from_connection(conn),
            hello,
            url,
        })
    }

    /// Close the connection politely (close handshake) and wait for it to end.
    pub async fn close(self) {
        self.caller.connection().close().await;
    }
}

/// A refused `hello`: what was refused, and where the token goes.
fn token_refused(common: &Common, role: Role, body: &ErrorBody) -> String {
    let needs = match role {
        Role::Operator => "this command needs an operator token",
        _ => "this command needs a client (or operator) token",
    };
    let given = if common.token.as_deref().is_some_and(|t| !t.is_empty()) {
        "the token given was not accepted"
    } else {
        "no token was given"
    };
    format!(
        "{}: {}: {given}; {needs}: pass it with --token or set TURND_TOKEN",
        body.code, body.message
    )
}

/// Logs only when `TURND_LOG` asks for them: the CLI's own messages go to stderr
/// directly, and the SDK's debug logs would only get in their way.
fn init_tracing() {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("TURND_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(crate::serve::log_colours())
            .with_writer(std::io::stderr)
            .init();
    }
}

/// Run a client command; returns the process exit code.
pub fn main(c: ClientCommand) -> i32 {
    init_tracing();
    let result = match c {
        // Offline: no daemon, no runtime.
        ClientCommand::Check(CheckCmd {
            data_dir: Some(dir),
            common,
        }) => commands::check_offline(&dir, common.json),
        c => match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(run(c)),
            Err(e) => Err(Failure::Other(format!("failed to start the runtime: {e}"))),
        },
    };
    match result {
        Ok(code) => code,
        Err(f) => {
            if !matches!(f, Failure::Quiet(_)) {
                eprintln!("turnd: {f}");
            }
            f.exit_code()
        }
    }
}

async fn run(c: ClientCommand) -> Result<i32, Failure> {
    let (common, role) = match &c {
        ClientCommand::Submit(a) => (&a.common, Role::Client),
        ClientCommand::Turn(a) => (&a.common, Role::Client),
        ClientCommand::Turns(a) => (&a.common, Role::Client),
        ClientCommand::Wait(a) => (&a.common, Role::Client),
        ClientCommand::Stop(a) => (&a.common, Role::Client),
        ClientCommand::Resume(a) => (&a.common, Role::Client),
        ClientCommand::Watch(a) => (&a.common, Role::Client),
        ClientCommand::Inspect(a) => (&a.common, Role::Client),
        ClientCommand::Events(a) => (&a.common, Role::Client),
        ClientCommand::Workers(a)
        | ClientCommand::Functions(a)
        | ClientCommand::Status(a)
        | ClientCommand::Ping(a) => (&a.common, Role::Client),
        ClientCommand::Check(a) => (&a.common, Role::Operator),
        ClientCommand::Sessions(a) => (&a.common, Role::Client),
    };
    let conn = Conn::open(common, role).await?;
    let result = match &c {
        ClientCommand::Submit(a) => commands::submit(&conn, a).await,
        ClientCommand::Turn(a) => commands::turn(&conn, a).await,
        ClientCommand::Turns(a) => commands::turns(&conn, a).await,
        ClientCommand::Wait(a) => commands::wait(&conn, a).await,
        ClientCommand::Stop(a) => commands::stop(&conn, a).await,
        ClientCommand::Resume(a) => agent::resume(&conn, a).await,
        ClientCommand::Watch(a) => agent::watch(&conn, a).await,
        ClientCommand::Inspect(a) => commands::inspect(&conn, a).await,
        ClientCommand::Events(a) => commands::events(&conn, a).await,
        ClientCommand::Workers(a) => commands::workers(&conn, &a.common).await,
        ClientCommand::Functions(a) => commands::functions(&conn, &a.common).await,
        ClientCommand::Status(a) => commands::status(&conn, &a.common).await,
        ClientCommand::Check(a) => commands::check_online(&conn, &a.common).await,
        ClientCommand::Ping(a) => commands::ping(&conn, &a.common).await,
        ClientCommand::Sessions(a) => sessions::run(&conn, a).await,
    };
    conn.close().await;
    result
}
