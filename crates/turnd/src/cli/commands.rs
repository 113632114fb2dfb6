//! One function per client command: ask the daemon through the SDK, print the
//! answer (a human view, or the protocol's JSON with `--json`), return the exit code.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;
use turnd_proto::{
    ErrorCode, Event, ListArgs, Role, SubmitArgs, Turn, TurnStatus, WaitState, WatchArgs, PAGE_MAX,
    WAIT_MAX_MS,
};
use turnd_store::{check_store, LoggedKv, LoggedOptions, Store};

use super::fmt::{duration, now_ms};
use super::render::{self, EventColumns, SessionExtras};
use super::{
    At, Common, Conn, EventsCmd, Failure, InspectCmd, StopCmd, SubmitCmd, TurnCmd, TurnsCmd,
    WaitCmd,
};

/// Extra time given to the daemon's answer of a `turn.wait` beyond its own timeout.
const WAIT_ANSWER_GRACE: Duration = Duration::from_secs(2);
/// First and longest pause between reconnection attempts of `events --follow`.
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);
/// The SDK's (and daemon's) default page size of `session.events`.
const EVENTS_PAGE_DEFAULT: u64 = 100;

/// Write to stdout. A reader that went away (`turnd events … | head`) ends the
/// command quietly.
pub(super) fn emit(text: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Failure::Quiet(0)),
        Err(e) => Err(Failure::Other(format!("failed to write to stdout: {e}"))),
    }
}

pub(super) fn emit_json<T: Serialize>(v: &T) -> Result<(), Failure> {
    let mut s = serde_json::to_string_pretty(v)
        .map_err(|e| Failure::Other(format!("failed to encode JSON: {e}")))?;
    s.push('\n');
    emit(&s)
}

/// Print a turn: its JSON, or the human view, which says why a turn awaiting a
/// worker has none (from `functions.list`, best effort).
pub(super) async fn emit_turn(c: &Conn, t: &Turn, json: bool) -> Result<(), Failure> {
    if json {
        return emit_json(t);
    }
    let note = match &t.wait {
        Some(w) if w.state == WaitState::AwaitingWorker => worker_note(c, &t.function_id).await,
        _ => None,
    };
    emit(&render::turn(t, note.as_deref(), now_ms()))
}

/// [`render::worker_note`] for `function_id`, or `None` when the functions cannot be
/// read.
async fn worker_note(c: &Conn, function_id: &str) -> Option<String> {
    let fs = c.caller.functions().await.ok()?;
    Some(render::worker_note(function_id, &fs))
}

/// Exit code for a finished (or not) turn: 0 completed, 1 failed/cancelled,
/// 3 still unfinished after the wait.
pub(super) fn turn_exit(t: &Turn, timed_out: bool, waited_secs: u64) -> i32 {
    if !t.status.is_terminal() || timed_out {
        eprintln!(
            "turnd: turn {} is still {} after waiting {waited_secs}s",
            t.turn_id,
            t.status.as_str()
        );
        return 3;
    }
    match t.status {
        TurnStatus::Completed => 0,
        s => {
            eprintln!("turnd: turn {} {}", t.turn_id, s.as_str());
            1
        }
    }
}

/// Repeat `turn.wait` until the turn is terminal or `secs` pass. Returns the turn as
/// last seen and whether time ran out first.
pub(super) async fn wait_for(c: &Conn, turn_id: &str, secs: u64) -> Result<(Turn, bool), Failure> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let ms = u64::try_from(remaining.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, WAIT_MAX_MS);
        let answer = tokio::time::timeout(
            remaining + WAIT_ANSWER_GRACE,
            c.caller.wait(turn_id, Some(ms)),
        )
        .await;
        let turn = match answer {
            Ok(r) => r.at(&c.url)?,
            // The daemon did not answer its own wait in time; report the turn as it is.
            Err(_) => return Ok((c.caller.get(turn_id).await.at(&c.url)?, true)),
        };
        if turn.status.is_terminal() {
            return Ok((turn, false));
        }
        if Instant::now() >= deadline {
            return Ok((turn, true));
        }
    }
}

pub async fn submit(c: &Conn, a: &SubmitCmd) -> Result<i32, Failure> {
    let args = SubmitArgs {
        session_id: a.session.clone(),
        function_id: a.function.clone(),
        input: a.input.clone(),
        idempotency_key: a.idempotency_key.clone(),
        turn_timeout_ms: a.turn_timeout_ms,
        on_busy: a.on_busy,
    };
    let ok = c.caller.submit(args).await.at(&c.url)?;
    if ok.deduplicated {
        eprintln!(
            "turnd: idempotency key {:?} was already used in session {}: this is the existing turn",
            a.idempotency_key.as_deref().unwrap_or(""),
            a.session
        );
    }
    let (turn, code) = if a.waiting.wait {
        let secs = a.waiting.timeout_secs;
        let (turn, timed_out) = wait_for(c, &ok.turn.turn_id, secs).await?;
        let code = turn_exit(&turn, timed_out, secs);
        (turn, code)
    } else {
        (ok.turn, 0)
    };
    if a.common.json {
        // The turn, and whether this submit made it or found it by its key.
        let mut v = serde_json::to_value(&turn)
            .map_err(|e| Failure::Other(format!("failed to encode JSON: {e}")))?;
        if let Some(m) = v.as_object_mut() {
            m.insert("deduplicated".to_string(), json!(ok.deduplicated));
        }
        emit_json(&v)?;
    } else {
        emit_turn(c, &turn, false).await?;
    }
    Ok(code)
}

pub async fn turn(c: &Conn, a: &TurnCmd) -> Result<i32, Failure> {
    let t = c.caller.get(&a.turn_id).await.at(&c.url)?;
    emit_turn(c, &t, a.common.json).await?;
    Ok(match t.status {
        TurnStatus::Failed | TurnStatus::Cancelled => {
            eprintln!("turnd: turn {} {}", t.turn_id, t.status.as_str());
            1
        }
        _ => 0,
    })
}

pub async fn turns(c: &Conn, a: &TurnsCmd) -> Result<i32, Failure> {
    let ok = c
        .caller
        .list(ListArgs {
            session_id: a.session.clone(),
            status: a.status,
            limit: a.limit,
            before_seq: a.before,
        })
        .await
        .at(&c.url)?;
    if a.common.json {
        emit_json(&ok)?;
        return Ok(0);
    }
    if ok.turns.is_empty() {
        let which = a
            .status
            .map(|s| format!("{} ", s.as_str()))
            .unwrap_or_default();
        let below = a
            .before
            .map(|b| format!(" before seq {b}"))
            .unwrap_or_default();
        emit(&format!(
            "no {which}turns in session {}{below}\n",
            a.session
        ))?;
        return Ok(0);
    }
    emit(&render::turns_table(&ok.turns, now_ms()))?;
    if let Some(next) = ok.next_before_seq {
        let mut more = format!("turnd turns {} --before {next}", a.session);
        if let Some(s) = a.status {
            more.push_str(&format!(" --status {}", s.as_str()));
        }
        if let Some(l) = a.limit {
            more.push_str(&format!(" --limit {l}"));
        }
        eprintln!("turnd: more turns may follow: {more}");
    }
    Ok(0)
}

pub async fn wait(c: &Conn, a: &WaitCmd) -> Result<i32, Failure> {
    let (turn, timed_out) = wait_for(c, &a.turn_id, a.timeout_secs).await?;
    emit_turn(c, &turn, a.common.json).await?;
    Ok(turn_exit(&turn, timed_out, a.timeout_secs))
}

pub async fn stop(c: &Conn, a: &StopCmd) -> Result<i32, Failure> {
    match (&a.turn_id, &a.session) {
        (Some(turn_id), None) => {
            // `turn.stop` of a finished turn changes nothing and answers the turn as it
            // is; read it first so that can be said.
            let before = c.caller.get(turn_id).await.at(&c.url)?;
            let t = c.caller.stop(turn_id, &a.reason).await.at(&c.url)?;
            emit_turn(c, &t, a.common.json).await?;
            // Completed or failed right after a stop: it finished before the stop did.
            if before.status.is_terminal()
                || matches!(t.status, TurnStatus::Completed | TurnStatus::Failed)
            {
                eprintln!(
                    "turnd: turn {turn_id} had already {}: nothing to stop",
                    match t.status {
                        TurnStatus::Completed => "completed",
                        TurnStatus::Failed => "failed",
                        _ => "been cancelled",
                    }
                );
            }
        }
        (None, Some(session)) => {
            let turns = c.caller.stop_session(session, &a.reason).await.at(&c.url)?;
            if a.common.json {
                emit_json(&json!({ "turns": turns }))?;
            } else if turns.is_empty() {
                emit(&format!(
                    "session {session} has no unfinished turns: nothing to stop\n"
                ))?;
            } else {
                emit(&format!(
                    "stopping {} turn(s) of session {session}:\n{}",
                    turns.len(),
                    render::turns_table(&turns, now_ms())
                ))?;
            }
        }
        _ => {
            return Err(Failure::Usage(
                "give either a TURN_ID or --session SESSION".to_string(),
            ))
        }
    }
    Ok(0)
}

pub async fn inspect(c: &Conn, a: &InspectCmd) -> Result<i32, Failure> {
    let s = c.caller.inspect(&a.session).await.at(&c.url)?;
    if a.common.json {
        emit_json(&s)?;
        return Ok(0);
    }
    // Context for the human view; the session itself is what matters, so these two
    // reads are best effort and their absence only shortens the output.
    let mut extras = SessionExtras::default();
    if let Some(lock) = &s.lock {
        extras.holder = c.caller.get(&lock.turn_id).await.ok();
        if lock.wait.state == WaitState::AwaitingWorker {
            if let Some(h) = &extras.holder {
                extras.worker_note = worker_note(c, &h.function_id).await;
            }
        }
    }
    if s.last_event > 0 {
        extras.last_event = c
            .caller
            .events(&a.session, Some(s.last_event - 1), Some(1))
            .await
            .ok()
            .and_then(|ok| ok.events.into_iter().next());
    }
    emit(&render::session(&s, &extras, now_ms()))?;
    Ok(0)
}

pub async fn events(c: &Conn, a: &EventsCmd) -> Result<i32, Failure> {
    if a.follow {
        return follow(c, a).await;
    }
    let ok = c
        .caller
        .events(&a.session, a.after, a.limit)
        .await
        .at(&c.url)?;
    if a.common.json {
        emit_json(&ok)?;
        return Ok(0);
    }
    let now = now_ms();
    if ok.events.is_empty() {
        emit(&format!(
            "no events in session {} after seq {}\n",
            a.session,
            a.after.unwrap_or(0)
        ))?;
        return Ok(0);
    }
    let cols = EventColumns::fit(&ok.events, now);
    let mut out = cols.header();
    out.push('\n');
    for e in &ok.events {
        out.push_str(&cols.event(e, now));
        out.push('\n');
    }
    emit(&out)?;
    if ok.events.iter().any(render::detail_is_cut) {
        eprintln!(
            "turnd: details ending in … are cut to fit; turnd events {} --json shows them whole",
            a.session
        );
    }
    if ok.events.len() as u64 >= a.limit.unwrap_or(EVENTS_PAGE_DEFAULT) {
        eprintln!(
            "turnd: more events may follow: turnd events {} --after {}",
            a.session, ok.next
        );
    }
    Ok(0)
}

/// Prints events as they come, remembering the last sequence number printed so that
/// nothing is printed twice and, after a reconnect, nothing is missed.
pub(super) struct Printer {
    pub(super) json: bool,
    pub(super) cols: Option<EventColumns>,
    pub(super) last: u64,
}

impl Printer {
    pub(super) fn print(&mut self, events: &[Event]) -> Result<(), Failure> {
        let fresh: Vec<&Event> = events.iter().filter(|e| e.seq > self.last).collect();
        if fresh.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let mut out = String::new();
        if self.json {
            for e in &fresh {
                let line = serde_json::to_string(e)
                    .map_err(|err| Failure::Other(format!("failed to encode JSON: {err}")))?;
                out.push_str(&line);
                out.push('\n');
            }
        } else {
            let cols = match self.cols {
                Some(c) => c,
                None => {
                    let owned: Vec<Event> = fresh.iter().map(|e| (*e).clone()).collect();
                    let c = EventColumns::fit(&owned, now);
                    out.push_str(&c.header());
                    out.push('\n');
                    self.cols = Some(c);
                    c
                }
            };
            for e in &fresh {
                out.push_str(&cols.event(e, now));
                out.push('\n');
            }
        }
        emit(&out)?;
        if let Some(e) = fresh.last() {
            self.last = e.seq;
        }
        Ok(())
    }
}

/// `events --follow`: the history after `--after`, then a `watch` resuming after the
/// last event printed; on connection loss, reconnect (with backoff) and watch again
/// from the last event printed. Ends on Ctrl-C (exit 0).
async fn follow(c: &Conn, a: &EventsCmd) -> Result<i32, Failure> {
    let mut p = Printer {
        json: a.common.json,
        cols: None,
        last: a.after.unwrap_or(0),
    };
    let page = a.limit.unwrap_or(PAGE_MAX);
    // The history, page by page. A session with no events yet is not an error here:
    // following it waits for its first turn.
    loop {
        match c.caller.events(&a.session, Some(p.last), Some(page)).await {
            Ok(ok) => {
                let n = ok.events.len() as u64;
                p.print(&ok.events)?;
                if n < page {
                    break;
                }
            }
            Err(turnd_client::ClientError::Protocol(b)) if b.code == ErrorCode::NotFound => {
                if !a.common.json {
                    eprintln!(
                        "turnd: session {} has no events yet; waiting for them (Ctrl-C to stop)",
                        a.session
                    );
                }
                break;
            }
            Err(e) => return Err(Failure::from_client(&c.url, e)),
        }
    }

    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut owned: Option<Conn> = None;
    loop {
        let conn = owned.as_ref().unwrap_or(c);
        let args = WatchArgs {
            session_id: Some(a.session.clone()),
            turn_id: None,
            after: Some(p.last),
            progress: false,
        };
        match conn.caller.watch(args).await.at(&conn.url) {
            Ok(mut stream) => {
                loop {
                    tokio::select! {
                        _ = &mut ctrl_c => return Ok(0),
                        ev = stream.next() => match ev {
                            Some(e) => p.print(std::slice::from_ref(&e))?,
                            None => break,
                        },
                    }
                }
                eprintln!(
                    "turnd: lost the connection to the daemon at {}; reconnecting to resume after seq {}",
                    conn.url, p.last
                );
            }
            Err(f) if f.is_transient() => eprintln!("turnd: {f}; reconnecting"),
            Err(f) => return Err(f),
        }
        let Some(fresh) = reconnect(&a.common, &mut ctrl_c).await? else {
            return Ok(0);
        };
        eprintln!(
            "turnd: reconnected to {}; resuming after seq {}",
            fresh.url, p.last
        );
        if let Some(old) = owned.replace(fresh) {
            old.close().await;
        }
    }
}

/// Connect again, pausing between attempts (doubling up to [`RECONNECT_MAX`]) while
/// the daemon is unreachable or draining. `None` when Ctrl-C came first.
async fn reconnect<F>(
    common: &Common,
    ctrl_c: &mut std::pin::Pin<&mut F>,
) -> Result<Option<Conn>, Failure>
where
    F: std::future::Future<Output = std::io::Result<()>>,
{
    let mut backoff = RECONNECT_MIN;
    loop {
        tokio::select! {
            _ = &mut *ctrl_c => return Ok(None),
            _ = tokio::time::sleep(backoff) => {}
        }
        let opened = tokio::select! {
            _ = &mut *ctrl_c => return Ok(None),
            r = Conn::open(common, Role::Client) => r,
        };
        match opened {
            Ok(conn) => return Ok(Some(conn)),
            Err(f) if f.is_transient() => {
                backoff = (backoff * 2).min(RECONNECT_MAX);
                eprintln!("turnd: {f}; retrying in {}", duration(backoff_ms(backoff)));
            }
            Err(f) => return Err(f),
        }
    }
}

fn backoff_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub async fn workers(c: &Conn, common: &Common) -> Result<i32, Failure> {
    let ws = c.caller.workers().await.at(&c.url)?;
    if common.json {
        emit_json(&ws)?;
    } else if ws.is_empty() {
        emit("no workers known to the daemon\n")?;
    } else {
        emit(&render::workers_table(&ws, now_ms()))?;
    }
    Ok(0)
}

pub async fn functions(c: &Conn, common: &Common) -> Result<i32, Failure> {
    let fs = c.caller.functions().await.at(&c.url)?;
    if common.json {
        emit_json(&fs)?;
    } else if fs.is_empty() {
        emit("no functions registered\n")?;
    } else {
        emit(&render::functions_table(&fs))?;
    }
    Ok(0)
}

pub async fn status(c: &Conn, common: &Common) -> Result<i32, Failure> {
    let stats = c.caller.stats().await.at(&c.url)?;
    let ws = c.caller.workers().await.at(&c.url)?;
    let oldest = super::sessions::oldest_waits(c).await?;
    if common.json {
        emit_json(&json!({
            "daemon": {
                "url": c.url,
                "server": c.hello.server,
                "version": c.hello.version,
                "boot_id": c.hello.boot_id,
            },
            "stats": stats,
            "workers": ws,
            "oldest_waits": oldest.sessions,
        }))?;
        return Ok(0);
    }
    let info = render::DaemonInfo {
        url: &c.url,
        server: &c.hello.server,
        version: &c.hello.version,
        boot_id: &c.hello.boot_id,
    };
    let now = now_ms();
    let mut text = render::status(&info, &stats, &ws, now);
    text.push('\n');
    text.push_str(&super::sessions::oldest_waits_text(&oldest, now));
    emit(&text)?;
    Ok(0)
}

pub async fn ping(c: &Conn, common: &Common) -> Result<i32, Failure> {
    let started = Instant::now();
    c.caller.ping().await.at(&c.url)?;
    let rtt = started.elapsed();
    let rtt_ms = rtt.as_secs_f64() * 1000.0;
    if common.json {
        emit_json(&json!({
            "url": c.url,
            "server": c.hello.server,
            "version": c.hello.version,
            "boot_id": c.hello.boot_id,
            "rtt_ms": rtt_ms,
        }))?;
    } else {
        emit(&format!(
            "pong from {} {} at {} in {rtt_ms:.1}ms (boot {})\n",
            c.hello.server, c.hello.version, c.url, c.hello.boot_id
        ))?;
    }
    Ok(0)
}

fn report_violations(
    vs: &[turnd_proto::Violation],
    json: bool,
    what: &str,
) -> Result<i32, Failure> {
    if json {
        emit_json(&json!({ "violations": vs }))?;
    } else if vs.is_empty() {
        emit(&format!("{what}: no violations\n"))?;
    } else {
        emit(&render::violations_table(vs))?;
        emit(&format!("{what}: {} violation(s)\n", vs.len()))?;
    }
    Ok(if vs.is_empty() { 0 } else { 1 })
}

pub async fn check_online(c: &Conn, common: &Common) -> Result<i32, Failure> {
    let vs = c.caller.store_check().await.at(&c.url)?;
    report_violations(
        &vs,
        common.json,
        &format!("store of the daemon at {}", c.url),
    )
}

/// `check --data-dir`: open the stopped daemon's store directly and check it.
pub fn check_offline(dir: &Path, json: bool) -> Result<i32, Failure> {
    // sled creates a missing directory; a typo must not pass as an empty, clean store.
    if !dir.join("db").is_file() {
        return Err(Failure::Usage(format!(
            "no turnd store in {}: give the data directory (storage.data_dir) of a stopped daemon",
            dir.display()
        )));
    }
    // Opening writes what the commit log holds past sled's applied mark to sled, as
    // a start of the daemon would, so the check sees every acknowledged change.
    let (kv, _) = LoggedKv::open(dir, LoggedOptions::default()).map_err(|e| {
        let msg = e.to_string();
        if msg.contains("could not acquire lock") {
            let pid = crate::serve::data_dir_holder(dir)
                .map(|p| format!(" (pid {p})"))
                .unwrap_or_default();
            Failure::Usage(format!(
                "the store in {} is in use by a running daemon{pid}; check it online instead: \
                 turnd check --url ws://HOST:PORT/v1 (operator role)",
                dir.display()
            ))
        } else {
            Failure::Usage(format!("cannot open the store in {}: {msg}", dir.display()))
        }
    })?;
    let store = Store::new(Arc::new(kv));
    let vs = check_store(&store).map_err(|e| {
        Failure::Other(format!(
            "failed to read the store in {}: {e}",
            dir.display()
        ))
    })?;
    report_violations(&vs, json, &format!("store in {}", dir.display()))
}
