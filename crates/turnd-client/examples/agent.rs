//! A chat agent on turnd, worker and caller in one process: each user message is a
//! turn of session `chat-1`.
//!
//! - The worker's `chat` function is a streaming echo "model": step 0 streams its
//!   reply word by word with `ctx.progress`, then asks for approval before its
//!   "tool" (a suspend, its draft kept as state); step 1, resumed with the answer,
//!   completes. A turn that interrupted another gets that turn's state as `previous`
//!   and says so.
//! - The caller sends a message, prints the tokens as they come, approves, then
//!   sends a second message while the first is still waiting for approval, with
//!   `on_busy: interrupt`: the first is stopped and the second carries on from it.
//!
//!     cargo run -p turnd-client --example agent -- [URL]
//!
//! URL defaults to `$TURND_URL`, else `ws://127.0.0.1:7420/v1`; a token, if the
//! daemon needs one, comes from `$TURND_TOKEN`. Prints the conversation; exits 0
//! when both turns ended as described.

use std::time::Duration;

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::{EventKind, OnBusy, Outcome, Suspend, TurnStatus, WatchArgs};
use turnd_client::{
    Caller, FunctionSpec, InvocationCtx, WatchItem, WatchStream, Worker, WorkerOptions,
};

const SESSION: &str = "chat-1";

/// The `chat` function: stream a reply, ask before the tool, then finish.
async fn chat(ctx: InvocationCtx) -> Outcome {
    let input = ctx.invoke.input.clone();
    if ctx.invoke.step > 0 {
        // Resumed: `{"state": <draft>, "input": <the answer>}`.
        let approved = input["input"]["approve"] == json!(true);
        let draft = input["state"]["draft"].clone();
        return Outcome::Complete(json!({"reply": draft, "tool_ran": approved}));
    }
    let message = input.as_str().unwrap_or_default().to_string();
    let mut reply = match &ctx.invoke.previous {
        Some(p) => format!("(after {} was {}) ", p.turn_id, p.status.as_str()),
        None => String::new(),
    };
    for word in message.split_whitespace() {
        reply.push_str(word);
        reply.push(' ');
        if ctx.progress(json!({"token": word})).await.is_err() {
            // Not current any more (stopped or interrupted): nothing to finish.
            return Outcome::Cancelled(Default::default());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Suspend::new(json!({"draft": reply.trim_end()}))
        .prompt(format!("run the tool for {message:?}?"))
        .into()
}

/// Print the tokens of turn `turn_id` as they come, until it asks for input; the
/// tokens.
async fn until_suspended(watch: &mut WatchStream, turn_id: &str) -> Vec<Value> {
    let mut tokens = Vec::new();
    while let Some(item) = watch.next_item().await {
        match item {
            WatchItem::Progress(p) if p.turn_id == turn_id => {
                println!("token {}: {}", p.seq, p.data["token"]);
                tokens.push(p.data["token"].clone());
            }
            WatchItem::ProgressDropped { count, .. } => println!("({count} tokens lost)"),
            WatchItem::Event(e) if e.turn_id == turn_id && e.kind == EventKind::Suspended => break,
            _ => {}
        }
    }
    tokens
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("TURND_URL").ok())
        .unwrap_or_else(|| "ws://127.0.0.1:7420/v1".to_string());
    let token = std::env::var("TURND_TOKEN").ok().filter(|t| !t.is_empty());
    let shutdown = CancellationToken::new();
    let mut opts = WorkerOptions::new(&url, "w-chat");
    opts.token = token.clone();
    let worker = Worker::new(opts)
        .function(FunctionSpec::new("chat"), chat)
        .spawn(shutdown.clone());
    worker.connected_within(Duration::from_secs(10)).await?;
    let caller = Caller::connect(&url, token.as_deref()).await?;

    // The conversation's events and tokens, from before its first message.
    let mut watch = caller
        .watch(WatchArgs {
            session_id: Some(SESSION.to_string()),
            turn_id: None,
            after: None,
            progress: true,
        })
        .await?;

    // First message: print its tokens, then approve the tool.
    let first = caller
        .submit_on_busy(SESSION, "chat", json!("hello there agent"), OnBusy::Enqueue)
        .await?
        .turn;
    let tokens = until_suspended(&mut watch, &first.turn_id).await;
    let waiting = caller.get(&first.turn_id).await?;
    let prompt = waiting.input_request.and_then(|r| r.prompt);
    println!("asks: {}", prompt.unwrap_or(Value::Null));
    caller
        .resume(&first.turn_id, json!({"approve": true}), Some("approve-1"))
        .await?;
    let done = caller
        .wait_terminal(&first.turn_id, Duration::from_secs(10))
        .await?;
    println!("first: {}", serde_json::to_string(&done.output)?);

    // A second message, then a third that interrupts it while it waits for approval.
    let second = caller
        .submit_on_busy(SESSION, "chat", json!("delete everything"), OnBusy::Enqueue)
        .await?
        .turn;
    until_suspended(&mut watch, &second.turn_id).await;
    let third = caller
        .submit_on_busy(SESSION, "chat", json!("never mind"), OnBusy::Interrupt)
        .await?
        .turn;
    let stopped = caller.get(&second.turn_id).await?;
    println!("second: {}", stopped.status.as_str());
    until_suspended(&mut watch, &third.turn_id).await;
    caller
        .resume(&third.turn_id, json!({"approve": false}), None)
        .await?;
    let last = caller
        .wait_terminal(&third.turn_id, Duration::from_secs(10))
        .await?;
    println!("third: {}", serde_json::to_string(&last.output)?);
    shutdown.cancel();
    worker.join().await?;
    let ok = tokens.len() == 3
        && done.status == TurnStatus::Completed
        && stopped.status == TurnStatus::Cancelled
        && last.status == TurnStatus::Completed;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
