//! `turnd sessions`: the sessions with unfinished work (`sessions.list`), and the
//! oldest waits shown by `turnd status`.

use clap::{Args, ValueEnum};
use turnd_proto::{
    SessionOrder, SessionRow, SessionsListArgs, SessionsListOk, WaitState, PAGE_MAX,
};

use super::fmt::{duration, relative, truncate, Table};
use super::render::{blocked, on_deadline};
use super::{At, Common, Conn, Failure};

/// Rows of oldest waits in `turnd status`.
pub const STATUS_OLDEST: u64 = 5;
/// Longest wait reason shown in a table row.
const MAX_REASON: usize = 100;

#[derive(Args, Debug)]
pub struct SessionsCmd {
    /// Only sessions whose lock holder waits in this state.
    #[arg(long, value_enum)]
    pub state: Option<StateArg>,
    /// Only sessions whose lock holder runs this function.
    #[arg(long)]
    pub function: Option<String>,
    /// Only sessions that look stuck: past their wait's deadline, waiting for a
    /// function no connected worker serves, or silent for more than half the step's
    /// timeout.
    #[arg(long)]
    pub stuck: bool,
    /// Order by session id instead of oldest wait first.
    #[arg(long)]
    pub by_id: bool,
    /// At most this many sessions (1 to 1000). Without it, every matching session,
    /// page by page.
    #[arg(long)]
    pub limit: Option<u64>,
    #[command(flatten)]
    pub common: Common,
}

/// The wait states a lock holder can be in.
#[derive(ValueEnum, Debug, Clone, Copy)]
#[value(rename_all = "snake_case")]
pub enum StateArg {
    AwaitingWorker,
    Held,
    AwaitingResult,
    AwaitingReconnect,
    BackingOff,
    Cancelling,
    Finalizing,
}

impl StateArg {
    fn wait_state(self) -> WaitState {
        match self {
            StateArg::AwaitingWorker => WaitState::AwaitingWorker,
            StateArg::Held => WaitState::Held,
            StateArg::AwaitingResult => WaitState::AwaitingResult,
            StateArg::AwaitingReconnect => WaitState::AwaitingReconnect,
            StateArg::BackingOff => WaitState::BackingOff,
            StateArg::Cancelling => WaitState::Cancelling,
            StateArg::Finalizing => WaitState::Finalizing,
        }
    }
}

/// `turnd sessions`. Exit 0, whether or not sessions are listed.
pub async fn run(c: &Conn, a: &SessionsCmd) -> Result<i32, Failure> {
    if let Some(l) = a.limit {
        if l == 0 || l > PAGE_MAX {
            return Err(Failure::Usage(format!("--limit must be 1 to {PAGE_MAX}")));
        }
    }
    let mut args = SessionsListArgs {
        state: a.state.map(StateArg::wait_state),
        function_id: a.function.clone(),
        stuck: a.stuck.then_some(true),
        order: Some(if a.by_id {
            SessionOrder::Id
        } else {
            SessionOrder::Wait
        }),
        limit: Some(a.limit.unwrap_or(PAGE_MAX)),
        after: None,
    };
    let mut rows: Vec<SessionRow> = Vec::new();
    let first = loop {
        let page = c.caller.sessions(&args).await.at(&c.url)?;
        let done = page.next.is_none() || a.limit.is_some();
        args.after = page.next.clone();
        let head = (page.total, page.counts.clone(), page.next.clone());
        rows.extend(page.sessions);
        if done {
            break head;
        }
    };
    let (total, counts, next) = first;
    if a.common.json {
        super::commands::emit_json(&SessionsListOk {
            sessions: rows,
            next: if a.limit.is_some() { next } else { None },
            total,
            counts,
        })?;
        return Ok(0);
    }
    let now = super::fmt::now_ms();
    let mut out = String::new();
    if rows.is_empty() {
        out.push_str("no sessions match\n");
    } else {
        out.push_str(&table(&rows, now));
    }
    out.push_str(&format!(
        "\n{} of {total} matching session{}; by wait state{}: {}\n",
        rows.len(),
        if total == 1 { "" } else { "s" },
        if a.state.is_some() {
            " (any state)"
        } else {
            ""
        },
        blocked(&counts)
    ));
    super::commands::emit(&out)?;
    Ok(0)
}

/// The table of sessions.
pub fn table(rows: &[SessionRow], now: u64) -> String {
    let mut t = Table::new(&[
        "SESSION", "STATE", "WAITING", "FUNCTION", "ATTEMPT", "QUEUED", "DEADLINE", "TURN",
        "REASON",
    ])
    .right(4)
    .right(5);
    for r in rows {
        let deadline = match (r.wait.deadline_ms, r.wait.on_deadline) {
            (Some(d), Some(o)) => format!("{}, {}", relative(d, now), on_deadline(o)),
            (Some(d), None) => relative(d, now),
            (None, _) => "-".to_string(),
        };
        t.row(vec![
            r.session_id.clone(),
            if r.stuck {
                format!("{} (stuck)", r.wait.state.as_str())
            } else {
                r.wait.state.as_str().to_string()
            },
            duration(now.saturating_sub(r.wait.since_ms)),
            r.function_id.clone(),
            r.attempt.to_string(),
            r.queued.to_string(),
            deadline,
            r.turn_id.clone(),
            truncate(&r.wait.reason, MAX_REASON),
        ]);
    }
    t.render()
}

/// The "oldest waits" part of `turnd status`.
pub async fn oldest_waits(c: &Conn) -> Result<SessionsListOk, Failure> {
    c.caller
        .sessions(&SessionsListArgs {
            limit: Some(STATUS_OLDEST),
            ..Default::default()
        })
        .await
        .at(&c.url)
}

pub fn oldest_waits_text(page: &SessionsListOk, now: u64) -> String {
    if page.sessions.is_empty() {
        return "no session is waiting\n".to_string();
    }
    let mut out = format!(
        "oldest waits ({} of {} active session{}; `turnd sessions` lists them all):\n",
        page.sessions.len(),
        page.total,
        if page.total == 1 { "" } else { "s" }
    );
    out.push_str(&table(&page.sessions, now));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnd_proto::{OnDeadline, Wait};

    #[test]
    fn rows_show_state_age_deadline_and_reason() {
        let row = SessionRow {
            session_id: "s-1".into(),
            turn_id: "t_1".into(),
            function_id: "echo".into(),
            step: 0,
            attempt: 2,
            locked_since_ms: 1_000,
            queued: 3,
            stuck: true,
            wait: Wait {
                state: WaitState::AwaitingWorker,
                reason: "no connected worker serving echo".into(),
                since_ms: 10_000,
                deadline_ms: Some(70_000),
                on_deadline: Some(OnDeadline::Fail),
                invocation_id: None,
                worker_id: None,
                ahead: None,
                last_error: None,
            },
        };
        let text = table(&[row], 40_000);
        let line = text.lines().nth(1).expect("a row");
        for part in [
            "s-1",
            "awaiting_worker (stuck)",
            "30s",
            "echo",
            "2",
            "3",
            "in 30s, fail",
            "t_1",
            "no connected worker serving echo",
        ] {
            assert!(line.contains(part), "{part:?} missing in {line:?}");
        }
    }
}
