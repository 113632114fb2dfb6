//! `turnd sessions` and the oldest waits of `turnd status`: the built binary run
//! against an in-process daemon, its output and exit code compared with what
//! `sessions.list` answers through the SDK.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use turnd_proto::{SessionsListArgs, SessionsListOk, WaitState};
use turnd_tests::{eventually, turnd_bin, Raw, TestDaemon};

async fn turnd(args: &[&str]) -> anyhow::Result<Output> {
    // `turnd_bin` may run `cargo build` the first time: keep it off the runtime.
    let bin: PathBuf = tokio::task::spawn_blocking(turnd_bin).await??;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .env_remove("TURND_URL")
        .env_remove("TURND_TOKEN")
        .env_remove("TURND_LOG")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .with_context(|| format!("turnd {args:?} did not finish within 30s"))??;
    Ok(out)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn expect_code(o: &Output, want: i32, what: &str) -> anyhow::Result<()> {
    if o.status.code() != Some(want) {
        bail!(
            "{what}: exit {:?}, wanted {want}\n--- stdout\n{}--- stderr\n{}",
            o.status.code(),
            stdout(o),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}

fn json_out(o: &Output) -> anyhow::Result<Value> {
    serde_json::from_slice(&o.stdout).with_context(|| format!("stdout is not JSON:\n{}", stdout(o)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_lists_filters_and_status_shows_the_oldest_waits() -> anyhow::Result<()> {
    // The raw worker below reads nothing while the CLI runs (a dozen processes):
    // a long heartbeat keeps the daemon from closing it as silent meanwhile.
    let d = TestDaemon::start(|c| {
        c.turns.dispatch_timeout_ms = Some(60_000);
        turnd_tests::quiet_raw_peers(c);
    })
    .await?;
    let c = d.caller().await?;
    // Two sessions wait for `nobody`; one runs `hold` on a worker that keeps it.
    c.submit_simple("s-old", "nobody", json!(1)).await?;
    tokio::time::sleep(Duration::from_millis(5)).await;
    c.submit_simple("s-new", "nobody", json!(2)).await?;
    c.submit_simple("s-new", "nobody", json!(3)).await?;
    let (mut w, _) = Raw::hello(
        &d.url,
        "worker",
        json!({"worker_id": "w-cli-s", "instance_id": "i1"}),
    )
    .await?;
    w.ok(
        "function.register",
        json!({"function_id": "hold", "timeout_ms": 60_000}),
    )
    .await?;
    c.submit_simple("s-run", "hold", json!(null)).await?;
    w.next_push().await?;
    eventually(15, "s-run awaiting its result", || async {
        let p = c
            .sessions(&SessionsListArgs {
                state: Some(WaitState::AwaitingResult),
                ..Default::default()
            })
            .await
            .ok()?;
        (p.total == 1).then_some(())
    })
    .await?;

    // --json is what sessions.list answers.
    let o = turnd(&["sessions", "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "sessions --json")?;
    let shown: SessionsListOk = serde_json::from_value(json_out(&o)?)?;
    let sdk = c.sessions(&SessionsListArgs::default()).await?;
    let names = |p: &SessionsListOk| -> Vec<String> {
        p.sessions.iter().map(|r| r.session_id.clone()).collect()
    };
    assert_eq!(names(&shown), ["s-old", "s-new", "s-run"]);
    assert_eq!(names(&shown), names(&sdk));
    assert_eq!((shown.total, shown.next.clone()), (3, None));
    assert_eq!(shown.counts, sdk.counts);

    // The table: one line per session, the filters reach the daemon.
    let o = turnd(&["sessions", "--url", &d.url]).await?;
    expect_code(&o, 0, "sessions")?;
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("SESSION"), "{text}");
    assert!(lines[1].starts_with("s-old"), "{text}");
    assert!(
        lines[1].contains("awaiting_worker (stuck)"),
        "nobody serves it: {text}"
    );
    assert!(lines[1].contains("fail"), "on_deadline shown: {text}");
    assert!(lines[3].starts_with("s-run"), "{text}");
    assert!(lines[3].contains("awaiting_result"), "{text}");
    assert!(lines[3].contains("probe"), "{text}");
    assert!(text.contains("3 of 3 matching sessions"), "{text}");

    let o = turnd(&[
        "sessions",
        "--url",
        &d.url,
        "--state",
        "awaiting_worker",
        "--json",
    ])
    .await?;
    expect_code(&o, 0, "sessions --state")?;
    let p: SessionsListOk = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(names(&p), ["s-old", "s-new"]);
    assert_eq!(p.sessions[1].queued, 1);
    let o = turnd(&["sessions", "--url", &d.url, "--function", "hold", "--json"]).await?;
    expect_code(&o, 0, "sessions --function")?;
    let p: SessionsListOk = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(names(&p), ["s-run"]);
    let o = turnd(&["sessions", "--url", &d.url, "--stuck"]).await?;
    expect_code(&o, 0, "sessions --stuck")?;
    let text = stdout(&o);
    assert!(text.contains("s-old") && text.contains("s-new"), "{text}");
    assert!(!text.contains("s-run"), "{text}");
    let o = turnd(&[
        "sessions", "--url", &d.url, "--by-id", "--limit", "2", "--json",
    ])
    .await?;
    expect_code(&o, 0, "sessions --by-id --limit")?;
    let p: SessionsListOk = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(names(&p), ["s-new", "s-old"]);
    assert!(p.next.is_some(), "a third session follows");
    let o = turnd(&["sessions", "--url", &d.url, "--function", "other"]).await?;
    expect_code(&o, 0, "sessions with no match")?;
    assert!(
        stdout(&o).starts_with("no sessions match"),
        "{}",
        stdout(&o)
    );

    // Bad usage: exit 2, nothing asked.
    let o = turnd(&["sessions", "--url", &d.url, "--state", "asleep"]).await?;
    expect_code(&o, 2, "sessions --state asleep")?;
    let o = turnd(&["sessions", "--url", &d.url, "--limit", "0"]).await?;
    expect_code(&o, 2, "sessions --limit 0")?;
    // No daemon: exit 2.
    let o = turnd(&["sessions", "--url", "ws://127.0.0.1:9/v1"]).await?;
    expect_code(&o, 2, "sessions without a daemon")?;

    // status: the oldest waits, oldest first, as in `sessions`.
    let o = turnd(&["status", "--url", &d.url]).await?;
    expect_code(&o, 0, "status")?;
    let text = stdout(&o);
    let at = text
        .find("oldest waits (3 of 3 active sessions")
        .with_context(|| format!("no oldest waits in\n{text}"))?;
    let tail = &text[at..];
    let (old, new, run) = (
        tail.find("s-old").context("s-old")?,
        tail.find("s-new").context("s-new")?,
        tail.find("s-run").context("s-run")?,
    );
    assert!(old < new && new < run, "{tail}");
    assert!(!text.contains("has no op that lists sessions"), "{text}");
    let o = turnd(&["status", "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "status --json")?;
    let v = json_out(&o)?;
    assert_eq!(v["oldest_waits"][0]["session_id"], "s-old");
    assert_eq!(v["oldest_waits"].as_array().map(Vec::len), Some(3));
    d.shutdown().await
}
