//! A caller: submits a turn, waits for it and prints it as JSON.
//!
//!     cargo run -p turnd-client --example caller -- [FUNCTION] [INPUT_JSON] [SESSION]
//!
//! FUNCTION defaults to `echo`, INPUT_JSON to `{"hello":"world"}`, SESSION to
//! `s-1` (the session the README's tour then inspects). The daemon's URL comes from `$TURND_URL` (default
//! `ws://127.0.0.1:7420/v1`; a cluster's nodes' URLs separated by commas), the token from `$TURND_TOKEN` (a client token). Run the
//! `worker` example first, or the turn waits for a worker (up to 30 s here).
//! Exits 0 when the turn completed, 1 otherwise.

use std::time::Duration;

use turnd_client::turnd_proto::{SubmitArgs, TurnStatus};
use turnd_client::url::parse_url_list;
use turnd_client::Caller;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let function = args.next().unwrap_or_else(|| "echo".to_string());
    let input = match args.next() {
        Some(s) => serde_json::from_str(&s).map_err(|e| {
            format!("INPUT_JSON is not JSON ({e}); a string is written with its quotes: '\"{s}\"'")
        })?,
        None => serde_json::json!({"hello": "world"}),
    };
    let session = args.next().unwrap_or_else(|| "s-1".to_string());
    let url = std::env::var("TURND_URL").unwrap_or_else(|_| "ws://127.0.0.1:7420/v1".to_string());
    let urls = parse_url_list(&url).map_err(|e| format!("TURND_URL: {e}"))?;
    let token = std::env::var("TURND_TOKEN").ok().filter(|t| !t.is_empty());

    // The first URL that answers; fails at once, naming each URL and the reason, when
    // no daemon can be reached.
    let caller = Caller::connect_any(&urls, token.as_deref()).await?;
    let submitted = caller
        .submit(SubmitArgs {
            session_id: session,
            function_id: function,
            input,
            idempotency_key: None,
            turn_timeout_ms: None,
            on_busy: None,
        })
        .await?;
    eprintln!(
        "submitted turn {} to session {}",
        submitted.turn.turn_id, submitted.turn.session_id
    );
    let turn = caller
        .wait_terminal(&submitted.turn.turn_id, Duration::from_secs(30))
        .await?;
    println!("{}", serde_json::to_string_pretty(&turn)?);
    if turn.status != TurnStatus::Completed {
        std::process::exit(1);
    }
    Ok(())
}
