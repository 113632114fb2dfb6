//! The commands of agent turns: `resume` (the input a suspended turn waits for) and
//! `watch` (one turn's events, and with `--progress` its steps' progress, until it
//! is finished).

use turnd_client::WatchItem;
use turnd_proto::{EventKind, Turn, TurnStatus, WatchArgs};

use super::commands::{emit, emit_json, emit_turn, turn_exit, wait_for, Printer};
use super::{At, Conn, Failure, ResumeCmd, WatchCmd};

pub async fn resume(c: &Conn, a: &ResumeCmd) -> Result<i32, Failure> {
    let ok = c
        .caller
        .resume(&a.turn_id, a.input.clone(), a.idempotency_key.as_deref())
        .await
        .at(&c.url)?;
    if ok.deduplicated {
        eprintln!(
            "turnd: turn {} was already resumed with idempotency key {:?}: this is the turn now",
            a.turn_id,
            a.idempotency_key.as_deref().unwrap_or("")
        );
    }
    let (turn, code) = if a.waiting.wait {
        let secs = a.waiting.timeout_secs;
        let (turn, timed_out) = wait_for(c, &a.turn_id, secs).await?;
        let code = turn_exit(&turn, timed_out, secs);
        (turn, code)
    } else {
        (ok.turn, 0)
    };
    emit_turn(c, &turn, a.common.json).await?;
    Ok(code)
}

/// The exit code of a turn that finished with `kind`'s event.
fn finished(kind: EventKind) -> Option<i32> {
    match kind {
        EventKind::Completed => Some(0),
        EventKind::Failed | EventKind::Cancelled => Some(1),
        _ => None,
    }
}

pub async fn watch(c: &Conn, a: &WatchCmd) -> Result<i32, Failure> {
    let json = a.common.json;
    let mut p = Printer {
        json,
        cols: None,
        last: 0,
    };
    // From its first event: a turn that is finished already prints its history.
    let args = WatchArgs {
        session_id: None,
        turn_id: Some(a.turn_id.clone()),
        after: Some(0),
        progress: a.progress,
    };
    let mut stream = c.caller.watch(args).await.at(&c.url)?;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let item = tokio::select! {
            _ = &mut ctrl_c => return Ok(0),
            item = stream.next_item() => item,
        };
        match item {
            Some(WatchItem::Event(e)) => {
                p.print(std::slice::from_ref(&e))?;
                if let Some(code) = finished(e.kind) {
                    return Ok(code);
                }
            }
            Some(WatchItem::Progress(pr)) if json => emit_json(&pr)?,
            Some(WatchItem::Progress(pr)) => {
                let data = match &pr.data {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                emit(&format!("progress step {} #{}: {data}\n", pr.step, pr.seq))?;
            }
            Some(WatchItem::ProgressDropped { count, .. }) => {
                eprintln!("turnd: {count} progress frame(s) lost: this terminal reads too slowly");
            }
            None => return lost(c, &a.turn_id).await,
        }
    }
}

/// The watch ended before the turn did: say how the turn stands.
async fn lost(c: &Conn, turn_id: &str) -> Result<i32, Failure> {
    let t: Turn = c.caller.get(turn_id).await.at(&c.url)?;
    eprintln!(
        "turnd: the watch of turn {turn_id} ended; the turn is {}",
        t.status.as_str()
    );
    Ok(match t.status {
        TurnStatus::Completed => 0,
        s if s.is_terminal() => 1,
        _ => 3,
    })
}
