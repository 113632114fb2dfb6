//! The turnd command line against a real daemon: the built binary is run as a child
//! process against an in-process daemon, and what it prints (and its exit code) is
//! compared with what the SDK sees.

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use turnd_proto::{Event, EventKind, EventsOk, Session, Turn, TurnStatus, WaitState};
use turnd_tests::{echo_worker, turnd_bin, wait_done, TestDaemon};

async fn bin() -> anyhow::Result<PathBuf> {
    // `turnd_bin` may run `cargo build` the first time: keep it off the runtime.
    tokio::task::spawn_blocking(turnd_bin).await?
}

/// A `turnd` command with a clean environment (no TURND_URL / TURND_TOKEN from the
/// shell running the tests).
async fn command(args: &[&str]) -> anyhow::Result<tokio::process::Command> {
    let mut cmd = tokio::process::Command::new(bin().await?);
    cmd.args(args)
        .env_remove("TURND_URL")
        .env_remove("TURND_TOKEN")
        .env_remove("TURND_LOG")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    Ok(cmd)
}

/// Run `turnd ARGS` to the end (at most 30 s).
async fn turnd(args: &[&str]) -> anyhow::Result<Output> {
    let out = tokio::time::timeout(Duration::from_secs(30), command(args).await?.output())
        .await
        .with_context(|| format!("turnd {args:?} did not finish within 30s"))??;
    Ok(out)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The exit code, failing the test (with both streams) when it is not `want`.
fn expect_code(o: &Output, want: i32, what: &str) -> anyhow::Result<()> {
    if o.status.code() != Some(want) {
        bail!(
            "{what}: exit {:?}, wanted {want}\n--- stdout\n{}--- stderr\n{}",
            o.status.code(),
            stdout(o),
            stderr(o)
        );
    }
    Ok(())
}

/// Stdout as JSON (turn it into a typed object with `serde_json::from_value`).
fn json_out(o: &Output) -> anyhow::Result<Value> {
    serde_json::from_slice(&o.stdout).with_context(|| format!("stdout is not JSON:\n{}", stdout(o)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_and_json_views_match_the_sdk() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let _w = echo_worker(&d.url, "w-cli", 1).await;
    let c = d.caller().await?;

    let o = turnd(&[
        "submit",
        "--url",
        &d.url,
        "--session",
        "s-cli",
        "--function",
        "echo",
        "--input",
        r#"{"hello":[1,2]}"#,
        "--wait",
        "--timeout-secs",
        "20",
        "--json",
    ])
    .await?;
    expect_code(&o, 0, "submit --wait")?;
    let turn: Turn = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(turn.status, TurnStatus::Completed);
    assert_eq!(turn.output, Some(json!({"hello": [1, 2]})));
    assert_eq!(turn.session_id, "s-cli");

    // `turn --json` is the Turn the SDK gets.
    let o = turnd(&["turn", &turn.turn_id, "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "turn --json")?;
    let shown: Turn = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(shown, c.get(&turn.turn_id).await?);
    assert_eq!(shown, turn);

    // The human view names the status and the output.
    let o = turnd(&["turn", &turn.turn_id, "--url", &d.url]).await?;
    expect_code(&o, 0, "turn")?;
    let text = stdout(&o);
    assert!(text.contains("completed"), "{text}");
    assert!(text.contains(r#"{"hello":[1,2]}"#), "{text}");

    // `events --json` is what `session.events` answers, and ends with `completed`.
    let o = turnd(&["events", "s-cli", "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "events --json")?;
    let shown: EventsOk = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(shown, c.events("s-cli", None, None).await?);
    assert_eq!(
        shown.events.last().map(|e| e.kind),
        Some(EventKind::Completed)
    );
    // `--after` and `--limit` reach the daemon.
    let o = turnd(&[
        "events", "s-cli", "--url", &d.url, "--json", "--after", "1", "--limit", "1",
    ])
    .await?;
    expect_code(&o, 0, "events --after --limit")?;
    let page: EventsOk = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(page, c.events("s-cli", Some(1), Some(1)).await?);
    assert_eq!(page.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [2]);

    // `inspect --json` is the Session the SDK gets (nothing moves in it any more).
    let o = turnd(&["inspect", "s-cli", "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "inspect --json")?;
    let shown: Session = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(shown, c.inspect("s-cli").await?);
    assert_eq!(shown.turns.completed, 1);
    assert!(shown.lock.is_none());

    // The tables show up too.
    let o = turnd(&["workers", "--url", &d.url]).await?;
    expect_code(&o, 0, "workers")?;
    assert!(stdout(&o).contains("w-cli"), "{}", stdout(&o));
    let o = turnd(&["functions", "--url", &d.url]).await?;
    expect_code(&o, 0, "functions")?;
    assert!(stdout(&o).contains("echo"), "{}", stdout(&o));
    let o = turnd(&["status", "--url", &d.url]).await?;
    expect_code(&o, 0, "status")?;
    let text = stdout(&o);
    assert!(text.contains("completed 1"), "{text}");
    assert!(text.contains("workers connected      1"), "{text}");
    let o = turnd(&["ping", "--url", &d.url]).await?;
    expect_code(&o, 0, "ping")?;
    assert!(stdout(&o).starts_with("pong from turnd"), "{}", stdout(&o));

    // A refusal by the daemon: `turnd: <code>: <message>`, exit 1.
    let o = turnd(&["turn", "t_nosuchturn", "--url", &d.url]).await?;
    expect_code(&o, 1, "turn of an unknown id")?;
    assert!(
        stderr(&o).starts_with("turnd: not_found: "),
        "{}",
        stderr(&o)
    );

    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_why_a_session_waits_and_stop_session_ends_it() -> anyhow::Result<()> {
    // No worker serves `echo`: the first turn holds the lock awaiting a worker.
    let d = TestDaemon::start(|_| {}).await?;
    let c = d.caller().await?;
    let o = turnd(&[
        "submit",
        "--url",
        &d.url,
        "--session",
        "s-wait",
        "--function",
        "echo",
        "--turn-timeout-ms",
        "60000",
    ])
    .await?;
    expect_code(&o, 0, "submit")?;
    assert!(stdout(&o).contains("awaiting_worker"), "{}", stdout(&o));
    let second = c.submit_simple("s-wait", "echo", json!(2)).await?;

    let session = c.inspect("s-wait").await?;
    let lock = session.lock.context("the first turn holds the lock")?;
    assert_eq!(lock.wait.state, WaitState::AwaitingWorker);
    let o = turnd(&["inspect", "s-wait", "--url", &d.url]).await?;
    expect_code(&o, 0, "inspect")?;
    let text = stdout(&o);
    assert!(text.contains("awaiting_worker"), "{text}");
    assert!(text.contains(&lock.turn_id), "{text}");
    // The reason ends with a time the daemon formats on every call; the rest of it
    // must be shown as the daemon gave it.
    let stable = lock.wait.reason.split(" (").next().unwrap_or_default();
    assert!(
        !stable.is_empty() && text.contains(stable),
        "{stable:?} in\n{text}"
    );
    // The queued second turn is listed.
    assert!(text.contains(&second.turn_id), "{text}");

    // `wait` on an unfinished turn times out with exit 3.
    let o = turnd(&[
        "wait",
        &lock.turn_id,
        "--url",
        &d.url,
        "--timeout-secs",
        "1",
    ])
    .await?;
    expect_code(&o, 3, "wait on a turn that cannot run")?;

    // `stop TURN_ID` stops the queued one; `stop --session` the rest. Both end
    // cancelled with the reason given.
    let o = turnd(&[
        "stop",
        &second.turn_id,
        "--reason",
        "cli test",
        "--url",
        &d.url,
        "--json",
    ])
    .await?;
    expect_code(&o, 0, "stop TURN_ID")?;
    let stopped: Turn = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(stopped.turn_id, second.turn_id);
    assert_eq!(stopped.stop.map(|s| s.reason).as_deref(), Some("cli test"));
    let o = turnd(&[
        "stop",
        "--session",
        "s-wait",
        "--reason",
        "cli test",
        "--url",
        &d.url,
        "--json",
    ])
    .await?;
    expect_code(&o, 0, "stop --session")?;
    let stopped: Value = json_out(&o)?;
    let ids: Vec<&str> = stopped["turns"]
        .as_array()
        .context("turns array")?
        .iter()
        .filter_map(|t| t["turn_id"].as_str())
        .collect();
    assert!(ids.contains(&lock.turn_id.as_str()), "{ids:?}");
    for id in [&lock.turn_id, &second.turn_id] {
        let t = wait_done(&c, id, 10).await?;
        assert_eq!(t.status, TurnStatus::Cancelled);
        assert_eq!(t.stop.map(|s| s.reason).as_deref(), Some("cli test"));
    }
    // `wait` on a cancelled turn: exit 1.
    let o = turnd(&["wait", &lock.turn_id, "--url", &d.url]).await?;
    expect_code(&o, 1, "wait on a cancelled turn")?;
    assert!(stdout(&o).contains("cancelled"), "{}", stdout(&o));

    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_online_and_offline_on_a_stopped_daemon() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let w = echo_worker(&d.url, "w-check", 1).await;
    let c = d.caller().await?;
    let t = c.submit_simple("s-check", "echo", json!({"n": 1})).await?;
    assert_eq!(
        wait_done(&c, &t.turn_id, 10).await?.status,
        TurnStatus::Completed
    );
    let data = d.dir.path().join("data");
    let data_arg = data.to_string_lossy().into_owned();

    let o = turnd(&["check", "--url", &d.url]).await?;
    expect_code(&o, 0, "check online")?;
    assert!(stdout(&o).contains("no violations"), "{}", stdout(&o));

    // sled locks its directory: on a running daemon's store the offline form says to
    // use the online one.
    let o = turnd(&["check", "--data-dir", &data_arg]).await?;
    expect_code(&o, 2, "check --data-dir on a running daemon")?;
    assert!(stderr(&o).contains("check it online"), "{}", stderr(&o));

    w.shutdown();
    drop(c);
    let dir = d.dir.clone();
    d.shutdown().await?;
    let o = turnd(&["check", "--data-dir", &data_arg, "--json"]).await?;
    expect_code(&o, 0, "check --data-dir on a stopped daemon")?;
    let v = json_out(&o)?;
    assert_eq!(v, json!({"violations": []}));

    // A directory that holds no store is an error, not a clean store.
    let empty = dir.path().join("nothing-here");
    let o = turnd(&["check", "--data-dir", &empty.to_string_lossy()]).await?;
    expect_code(&o, 2, "check --data-dir on a directory without a store")?;
    assert!(!empty.exists(), "the check must not create a store");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_daemon_is_one_line_and_exit_2() -> anyhow::Result<()> {
    // A port nobody listens on (bound, then released).
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let url = format!("ws://127.0.0.1:{port}/v1");
    for args in [
        vec!["ping", "--url", url.as_str()],
        vec!["inspect", "s-1", "--url", url.as_str()],
    ] {
        let o = turnd(&args).await?;
        expect_code(&o, 2, "unreachable")?;
        let err = stderr(&o);
        assert!(
            err.starts_with(&format!("turnd: cannot reach the daemon at {url}: ")),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(stdout(&o).is_empty());
    }
    // TURND_URL is honoured.
    let o = command(&["ping"])
        .await?
        .env("TURND_URL", &url)
        .output()
        .await?;
    expect_code(&o, 2, "unreachable via TURND_URL")?;
    assert!(stderr(&o).contains(&url), "{}", stderr(&o));
    Ok(())
}

/// Read JSON event lines from `events --follow --json` until `until` holds for one.
async fn read_events(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    seen: &mut Vec<Event>,
    until: impl Fn(&Event) -> bool,
) -> anyhow::Result<()> {
    loop {
        let line = tokio::time::timeout(Duration::from_secs(15), lines.next_line())
            .await
            .context("no event line within 15s")??
            .context("events --follow ended")?;
        let e: Event = serde_json::from_str(&line).with_context(|| line.clone())?;
        let done = until(&e);
        seen.push(e);
        if done {
            return Ok(());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_resumes_after_a_daemon_restart_without_gaps_or_repeats() -> anyhow::Result<()>
{
    let d = TestDaemon::start(|_| {}).await?;
    let addr = d
        .url
        .strip_prefix("ws://")
        .and_then(|s| s.strip_suffix("/v1"))
        .context("ws url")?
        .to_string();
    let dir = d.dir.clone();
    let w = echo_worker(&d.url, "w-follow", 1).await;
    let c = d.caller().await?;
    let first = c.submit_simple("s-follow", "echo", json!(1)).await?;
    wait_done(&c, &first.turn_id, 10).await?;

    let mut child = command(&["events", "s-follow", "--follow", "--json", "--url", &d.url])
        .await?
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let mut seen = Vec::new();
    // The history, then a live event.
    let first_id = first.turn_id.clone();
    read_events(&mut lines, &mut seen, |e| {
        e.turn_id == first_id && e.kind == EventKind::Completed
    })
    .await?;
    let second = c.submit_simple("s-follow", "echo", json!(2)).await?;
    let second_id = second.turn_id.clone();
    read_events(&mut lines, &mut seen, |e| {
        e.turn_id == second_id && e.kind == EventKind::Completed
    })
    .await?;

    // Restart the daemon on the same address and data; the follower reconnects.
    w.shutdown();
    drop(c);
    d.shutdown().await?;
    let d = TestDaemon::start_in(
        dir,
        |cfg| {
            cfg.server.listen = addr.clone();
        },
        false,
    )
    .await?;
    let _w = echo_worker(&d.url, "w-follow-2", 1).await;
    let c = d.caller().await?;
    let third = c.submit_simple("s-follow", "echo", json!(3)).await?;
    let third_id = third.turn_id.clone();
    read_events(&mut lines, &mut seen, |e| {
        e.turn_id == third_id && e.kind == EventKind::Completed
    })
    .await?;

    // Every event once, in order, none missing: exactly what the store holds.
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, expected);
    let stored = c.events("s-follow", None, Some(1000)).await?.events;
    assert_eq!(seen, stored[..seen.len()].to_vec());

    child.start_kill()?;
    child.wait().await?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        tokio::io::AsyncReadExt::read_to_string(&mut e, &mut err).await?;
    }
    assert!(err.contains("reconnected"), "{err}");
    d.shutdown().await
}
