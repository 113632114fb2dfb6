//! Human views of the protocol's objects: one function per object, each returning
//! the text to print, so the commands stay about talking to the daemon and the views
//! can be tested without one.

use std::collections::BTreeMap;

use turnd_proto::{
    Delivery, Event, Function, Session, Stats, Turn, TurnCounts, TurnStatus, Violation, Wait,
    WaitState, Worker,
};

use super::fmt::{compact, duration, log_time, relative, truncate, when, width, Fields, Table};

/// Longest JSON value shown inline before it is cut.
const MAX_INLINE_JSON: usize = 200;
/// Longest event detail shown in an events table row.
const MAX_DETAIL: usize = 160;
/// Column width of the event kind (the longest kinds: `retry_scheduled`,
/// `outcome_unknown`).
const KIND_WIDTH: usize = 15;
/// Column width of a turn id (`t_` + 32 hex digits).
const TURN_ID_WIDTH: usize = 34;

pub fn on_deadline(o: turnd_proto::OnDeadline) -> &'static str {
    o.as_str()
}

fn delivery(d: Delivery) -> &'static str {
    match d {
        Delivery::AtMostOnce => "at_most_once",
        Delivery::AtLeastOnce => "at_least_once",
    }
}

/// Why a turn awaiting a worker of `function_id` has none, from `functions.list`:
/// no worker has registered the function, its workers are gone, or all are busy.
pub fn worker_note(function_id: &str, fs: &[Function]) -> String {
    match fs.iter().find(|f| f.function_id == function_id) {
        None => format!("no worker has registered {function_id}"),
        Some(f) if !f.registered => format!("no worker has registered {function_id}"),
        Some(f) if f.workers == 0 => format!(
            "no connected worker serves {function_id} (the workers that registered it are gone)"
        ),
        Some(f) => format!(
            "all {} connected worker(s) serving {function_id} are busy",
            f.workers
        ),
    }
}

/// The lines of a wait: a `wait` line at `indent`, its details indented under it;
/// `note` says more about why (see [`worker_note`]).
fn wait_fields(f: &mut Fields, indent: usize, w: &Wait, note: Option<&str>, now: u64) {
    f.at(
        indent,
        "wait",
        format!("{} since {}", w.state.as_str(), relative(w.since_ms, now)),
    );
    let sub = indent + 2;
    f.at(sub, "reason", w.reason.clone());
    if let Some(n) = note {
        f.at(sub, "why", n.to_string());
    }
    match w.deadline_ms {
        Some(d) => {
            let then = w
                .on_deadline
                .map(|o| format!(", then {}", on_deadline(o)))
                .unwrap_or_default();
            f.at(sub, "deadline", format!("{}{then}", when(d, now)));
        }
        None => f.at(sub, "deadline", "none (waits until something changes)"),
    }
    if let Some(inv) = &w.invocation_id {
        f.at(sub, "invocation", inv.clone());
    }
    if let Some(wk) = &w.worker_id {
        f.at(sub, "worker", wk.clone());
    }
    if let Some(a) = w.ahead {
        f.at(sub, "ahead", a.to_string());
    }
    if let Some(e) = &w.last_error {
        f.at(sub, "last error", e.clone());
    }
}

/// One turn, every field a human may want; `note` says more about why it waits
/// (see [`worker_note`]).
pub fn turn(t: &Turn, note: Option<&str>, now: u64) -> String {
    let mut f = Fields::new();
    f.add("turn", t.turn_id.clone());
    f.add("session", format!("{} (seq {})", t.session_id, t.seq));
    f.add("function", t.function_id.clone());
    let recovered = if t.recovered {
        " (recovered by a late result)"
    } else {
        ""
    };
    let superseded = if t.superseded {
        " (superseded by a later message)"
    } else {
        ""
    };
    f.add(
        "status",
        format!("{}{recovered}{superseded}", t.status.as_str()),
    );
    f.add("step", t.step.to_string());
    f.add("attempt", t.attempt.to_string());
    f.add("created", when(t.created_at_ms, now));
    f.add("updated", when(t.updated_at_ms, now));
    if let Some(fin) = t.finished_at_ms {
        f.add(
            "finished",
            format!(
                "{} (took {})",
                when(fin, now),
                duration(fin.saturating_sub(t.created_at_ms))
            ),
        );
    }
    f.add("input", truncate(&compact(&t.input), MAX_INLINE_JSON));
    if let Some(o) = &t.output {
        f.add("output", truncate(&compact(o), MAX_INLINE_JSON));
    }
    if let Some(e) = &t.error {
        f.add("error", e.cause.as_str());
        if !e.code.is_empty() {
            f.sub("code", e.code.clone());
        }
        if !e.message.is_empty() {
            f.sub("message", e.message.clone());
        }
        f.sub("at step", e.step.to_string());
        if let Some(inv) = &e.invocation_id {
            f.sub("invocation", inv.clone());
        }
    }
    if let Some(s) = &t.stop {
        f.add(
            "stop",
            format!("requested {}", when(s.requested_at_ms, now)),
        );
        f.sub("reason", s.reason.clone());
    }
    agent_fields(&mut f, t, now);
    if let Some(w) = &t.wait {
        wait_fields(&mut f, 0, w, note, now);
    }
    f.render()
}

/// What a turn of an agent shows beyond the rest: the input it waits for, and its
/// step's last progress.
fn agent_fields(f: &mut Fields, t: &Turn, now: u64) {
    if let Some(r) = &t.input_request {
        let asks = r
            .prompt
            .as_ref()
            .map_or("(no prompt)".to_string(), |p| match p {
                serde_json::Value::String(s) => s.clone(),
                other => compact(other),
            });
        f.add("asks", truncate(&asks, MAX_INLINE_JSON));
        f.sub(
            "resume with",
            format!("turnd resume {} --input JSON", t.turn_id),
        );
    }
    if let Some(p) = &t.progress {
        f.add(
            "progress",
            format!(
                "#{} {}",
                p.seq,
                truncate(&compact(&p.data), MAX_INLINE_JSON)
            ),
        );
        f.sub("at", when(p.at_ms, now));
    }
}

/// Several turns, one line each (e.g. what `session.stop` answered).
pub fn turns_table(turns: &[Turn], now: u64) -> String {
    let mut t = Table::new(&["SEQ", "TURN", "FUNCTION", "STATUS", "WAIT", "UPDATED"]).right(0);
    for x in turns {
        t.row(vec![
            x.seq.to_string(),
            x.turn_id.clone(),
            x.function_id.clone(),
            x.status.as_str().to_string(),
            x.wait
                .as_ref()
                .map(|w| w.state.as_str().to_string())
                .unwrap_or_else(|| "-".into()),
            relative(x.updated_at_ms, now),
        ]);
    }
    t.render()
}

/// "queued 1  running 1  completed 7  failed 0  cancelled 0".
pub fn counts(c: &TurnCounts) -> String {
    TurnStatus::ALL
        .iter()
        .map(|s| format!("{} {}", s.as_str(), c.get(*s)))
        .collect::<Vec<_>>()
        .join("  ")
}

/// What `turnd inspect` shows besides the session itself: the holder turn (when it
/// could be read) and the last event (when it could be read).
#[derive(Debug, Default)]
pub struct SessionExtras {
    pub holder: Option<Turn>,
    pub last_event: Option<Event>,
    /// Why the lock holder awaits a worker (see [`worker_note`]).
    pub worker_note: Option<String>,
}

/// A session: its lock, its queue, its counts and its last event.
pub fn session(s: &Session, extras: &SessionExtras, now: u64) -> String {
    let mut f = Fields::new();
    f.add("session", s.session_id.clone());
    match &s.lock {
        None => f.add("lock", "free (no turn running)"),
        Some(l) => {
            let about = extras
                .holder
                .as_ref()
                .filter(|h| h.turn_id == l.turn_id)
                .map(|h| {
                    format!(
                        " ({}, {}, step {}, attempt {})",
                        h.function_id,
                        h.status.as_str(),
                        h.step,
                        h.attempt
                    )
                })
                .unwrap_or_default();
            f.add("lock", format!("held by {}{about}", l.turn_id));
            f.sub("since", when(l.since_ms, now));
            wait_fields(&mut f, 2, &l.wait, extras.worker_note.as_deref(), now);
        }
    }
    f.add("turns", counts(&s.turns));
    match (&extras.last_event, s.last_event) {
        (_, 0) => f.add("last event", "none"),
        (Some(e), _) => f.add(
            "last event",
            format!(
                "#{} {} of {} {}",
                e.seq,
                kind(e),
                e.turn_id,
                relative(e.at_ms, now)
            ),
        ),
        (None, seq) => f.add("last event", format!("#{seq}")),
    }
    f.add("queue", queue_line(s.queued.len()));
    let mut out = f.render();
    if !s.queued.is_empty() {
        let mut t = Table::new(&["SEQ", "TURN", "FUNCTION", "CREATED"]).right(0);
        for q in &s.queued {
            t.row(vec![
                q.seq.to_string(),
                q.turn_id.clone(),
                q.function_id.clone(),
                relative(q.created_at_ms, now),
            ]);
        }
        out.push('\n');
        out.push_str(&t.render());
    }
    out
}

/// The `queue` row of `turnd inspect`: the turns waiting behind the lock holder,
/// which is itself counted in `turns` under its status (`queued` until its first
/// dispatch), so the two rows never read as one number said twice.
fn queue_line(behind: usize) -> String {
    match behind {
        0 => "empty (no turn waits behind the lock holder)".into(),
        1 => "1 turn waits behind the lock holder".into(),
        n => format!("{n} turns wait behind the lock holder"),
    }
}

/// Whether [`EventColumns::event`] cuts this event's detail to fit.
pub fn detail_is_cut(e: &Event) -> bool {
    match &e.detail {
        serde_json::Value::Null => false,
        d => width(&compact(d)) > MAX_DETAIL,
    }
}

fn kind(e: &Event) -> String {
    // The wire spelling, from the serializer so it cannot drift.
    serde_json::to_value(e.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", e.kind))
}

/// Fixed column widths for event lines, so lines printed as they arrive (`--follow`)
/// stay aligned with the ones printed before.
#[derive(Debug, Clone, Copy)]
pub struct EventColumns {
    seq: usize,
    time: usize,
}

impl EventColumns {
    /// Widths fitting `events` and anything up to a few orders of magnitude later.
    pub fn fit(events: &[Event], now: u64) -> EventColumns {
        let max_seq = events.iter().map(|e| e.seq).max().unwrap_or(0);
        let time = events
            .iter()
            .map(|e| log_time(e.at_ms, now).chars().count())
            .max()
            .unwrap_or(0)
            .max(log_time(now, now).chars().count());
        EventColumns {
            seq: (max_seq.to_string().len() + 1).max(4),
            time,
        }
    }

    pub fn header(&self) -> String {
        self.line("SEQ", "TIME", "TURN", "KIND", "DETAIL")
    }

    pub fn event(&self, e: &Event, now: u64) -> String {
        let detail = match &e.detail {
            serde_json::Value::Null => String::new(),
            serde_json::Value::Object(m) if m.is_empty() => String::new(),
            d => truncate(&compact(d), MAX_DETAIL),
        };
        self.line(
            &e.seq.to_string(),
            &log_time(e.at_ms, now),
            &e.turn_id,
            &kind(e),
            &detail,
        )
    }

    fn line(&self, seq: &str, time: &str, turn: &str, kind: &str, detail: &str) -> String {
        let line = format!(
            "{seq:>sw$}  {time:<tw$}  {turn:<TURN_ID_WIDTH$}  {kind:<KIND_WIDTH$}  {detail}",
            sw = self.seq,
            tw = self.time
        );
        line.trim_end().to_string()
    }
}

pub fn workers_table(ws: &[Worker], now: u64) -> String {
    let mut t = Table::new(&[
        "WORKER",
        "NAME",
        "STATE",
        "SINCE",
        "INFLIGHT",
        "FUNCTIONS",
        "INSTANCE",
    ])
    .right(4);
    for w in ws {
        t.row(vec![
            w.worker_id.clone(),
            w.name.clone(),
            if w.connected {
                "connected"
            } else {
                "disconnected"
            }
            .to_string(),
            relative(w.since_ms, now),
            w.inflight.to_string(),
            if w.functions.is_empty() {
                "-".to_string()
            } else {
                w.functions.join(",")
            },
            w.instance_id.clone(),
        ]);
    }
    t.render()
}

pub fn functions_table(fs: &[Function]) -> String {
    let mut t = Table::new(&[
        "FUNCTION",
        "WORKERS",
        "QUEUED",
        "CONCURRENCY",
        "TIMEOUT",
        "DELIVERY",
        "MAX_ATTEMPTS",
    ])
    .right(1)
    .right(2)
    .right(3)
    .right(4)
    .right(6);
    let mut unregistered = false;
    for f in fs {
        if !f.registered {
            // Known only from turns waiting for it: it has no settings to show.
            unregistered = true;
            t.row(vec![
                format!("{}*", f.function_id),
                f.workers.to_string(),
                f.queued.to_string(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
            continue;
        }
        t.row(vec![
            f.function_id.clone(),
            f.workers.to_string(),
            f.queued.to_string(),
            f.concurrency.to_string(),
            if f.timeout_ms == 0 {
                "-".to_string()
            } else {
                duration(f.timeout_ms)
            },
            delivery(f.delivery).to_string(),
            f.max_attempts.to_string(),
        ]);
    }
    let mut out = t.render();
    if unregistered {
        out.push_str(
            "* no worker has registered it: known only from turns waiting for it, no settings yet\n",
        );
    }
    out
}

/// Blocked sessions by wait state, in the protocol's order, then any state this CLI
/// does not know: "awaiting_worker 2, awaiting_result 1".
pub fn blocked(b: &BTreeMap<String, u64>) -> String {
    let known: Vec<&str> = WaitState::ALL.iter().map(|s| s.as_str()).collect();
    let mut parts: Vec<String> = known
        .iter()
        .filter_map(|k| b.get(*k).filter(|n| **n > 0).map(|n| format!("{k} {n}")))
        .collect();
    parts.extend(
        b.iter()
            .filter(|(k, n)| !known.contains(&k.as_str()) && **n > 0)
            .map(|(k, n)| format!("{k} {n}")),
    );
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(", ")
    }
}

/// The daemon line of `turnd status`.
pub struct DaemonInfo<'a> {
    pub url: &'a str,
    pub server: &'a str,
    pub version: &'a str,
    pub boot_id: &'a str,
}

/// `turnd status`: the daemon's counters, then its workers.
pub fn status(d: &DaemonInfo<'_>, s: &Stats, workers: &[Worker], now: u64) -> String {
    let mut f = Fields::new();
    f.add(
        "daemon",
        format!(
            "{} {} at {} (boot {})",
            d.server, d.version, d.url, d.boot_id
        ),
    );
    f.add(
        "storage",
        if s.storage.writable {
            "writable".to_string()
        } else {
            format!(
                "NOT WRITABLE: {}",
                s.storage
                    .last_error
                    .as_deref()
                    .unwrap_or("no error reported")
            )
        },
    );
    f.add("sessions active", s.sessions.active.to_string());
    f.sub("by wait state", blocked(&s.sessions.blocked));
    f.add(
        "oldest wait",
        match s.oldest_wait_ms {
            Some(ms) => format!(
                "{} (the longest any active session has been in its current wait state)",
                duration(ms)
            ),
            None => "none (no session is waiting)".to_string(),
        },
    );
    f.add("turns", counts(&s.turns));
    f.add("invocations in flight", s.invocations_inflight.to_string());
    f.add("workers connected", s.workers_connected.to_string());
    let mut out = f.render();
    out.push('\n');
    if workers.is_empty() {
        out.push_str("no workers known to the daemon\n");
    } else {
        out.push_str(&workers_table(workers, now));
    }
    out
}

pub fn violations_table(vs: &[Violation]) -> String {
    let mut t = Table::new(&["INVARIANT", "SESSION", "TURN", "DETAIL"]);
    for v in vs {
        t.row(vec![
            v.invariant.clone(),
            v.session_id.clone().unwrap_or_else(|| "-".into()),
            v.turn_id.clone().unwrap_or_else(|| "-".into()),
            v.detail.clone(),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use turnd_proto::{EventKind, SessionLock};

    fn wait() -> Wait {
        Wait {
            state: WaitState::AwaitingWorker,
            reason: "no connected worker serving echo has free capacity".into(),
            since_ms: 10_000,
            deadline_ms: Some(40_000),
            on_deadline: Some(turnd_proto::OnDeadline::Fail),
            invocation_id: None,
            worker_id: None,
            ahead: None,
            last_error: None,
        }
    }

    #[test]
    fn session_view_names_wait_state_reason_and_deadline() {
        let s = Session {
            session_id: "s-1".into(),
            lock: Some(SessionLock {
                turn_id: "t_1".into(),
                since_ms: 10_000,
                wait: wait(),
            }),
            queued: vec![],
            turns: TurnCounts {
                queued: 1,
                ..Default::default()
            },
            last_event: 1,
        };
        let extras = SessionExtras {
            holder: None,
            last_event: Some(Event {
                seq: 1,
                session_id: "s-1".into(),
                turn_id: "t_1".into(),
                at_ms: 10_000,
                kind: EventKind::Admitted,
                detail: json!({}),
            }),
            worker_note: Some("no worker has registered echo".into()),
        };
        let out = session(&s, &extras, 22_000);
        assert!(out.contains("awaiting_worker since 12s ago"), "{out}");
        assert!(out.contains("why"), "{out}");
        assert!(out.contains("no worker has registered echo"), "{out}");
        assert!(out.contains("no connected worker serving echo"), "{out}");
        assert!(out.contains("in 18s"), "{out}");
        assert!(out.contains("then fail"), "{out}");
        assert!(out.contains("#1 admitted of t_1 12s ago"), "{out}");
        // The holder is the one `queued` turn; the queue behind it is empty, and the
        // two rows say so in different words.
        let row = |key: &str| {
            out.lines()
                .find(|l| l.split_whitespace().next() == Some(key))
                .map(|l| l[key.len()..].trim().to_string())
        };
        assert_eq!(
            row("turns").as_deref(),
            Some("queued 1  running 0  completed 0  failed 0  cancelled 0"),
            "{out}"
        );
        assert_eq!(
            row("queue").as_deref(),
            Some("empty (no turn waits behind the lock holder)"),
            "{out}"
        );
        assert_eq!(row("queued"), None, "{out}");
    }

    #[test]
    fn blocked_lists_known_states_in_order() {
        let mut b = BTreeMap::new();
        b.insert("awaiting_result".to_string(), 1);
        b.insert("awaiting_worker".to_string(), 2);
        b.insert("backing_off".to_string(), 0);
        assert_eq!(blocked(&b), "awaiting_worker 2, awaiting_result 1");
        assert_eq!(blocked(&BTreeMap::new()), "none");
    }
}
