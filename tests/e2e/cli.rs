//! The turnd command line against a real daemon: the built binary is run as a child
//! process against an in-process daemon, and what it prints (and its exit code) is
//! compared with what the SDK sees.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use turnd_proto::{
    Event, EventKind, EventsOk, Function, ListArgs, ListOk, Role, Session, Turn, TurnStatus,
    WaitState,
};
use turnd_server::config::TokenConfig;
use turnd_tests::{client_example, echo_worker, turnd_bin, wait_done, BinDaemon, TestDaemon};

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
    // use the online one, and leaves the directory alone: a snapshot sled is writing
    // (`snap.<lsn>.generating`, removed by an open only when a kill left it) stays.
    let generating = data.join("snap.7FFFFFFFFFFFFFFF.generating");
    std::fs::write(&generating, [0x5au8; 40])?;
    let o = turnd(&["check", "--data-dir", &data_arg]).await?;
    expect_code(&o, 2, "check --data-dir on a running daemon")?;
    assert!(stderr(&o).contains("check it online"), "{}", stderr(&o));
    assert!(
        generating.exists(),
        "the check touched a running daemon's files"
    );

    w.shutdown();
    drop(c);
    let dir = d.dir.clone();
    d.shutdown().await?;
    // Stopped, the leftover is what a kill leaves: the open removes it and goes on.
    let o = turnd(&["check", "--data-dir", &data_arg, "--json"]).await?;
    expect_code(&o, 0, "check --data-dir on a stopped daemon")?;
    let v = json_out(&o)?;
    assert_eq!(v, json!({"violations": []}));
    assert!(!generating.exists());

    // A directory that holds no store is an error, not a clean store.
    let empty = dir.path().join("nothing-here");
    let o = turnd(&["check", "--data-dir", &empty.to_string_lossy()]).await?;
    expect_code(&o, 2, "check --data-dir on a directory without a store")?;
    assert!(!empty.exists(), "the check must not create a store");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_daemon_is_one_line_and_exit_2() -> anyhow::Result<()> {
    let url = dead_url()?;
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

/// A port nobody listens on (bound, then released), as a URL.
fn dead_url() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(format!("ws://127.0.0.1:{}/v1", l.local_addr()?.port()))
}

/// `--url` (and `TURND_URL`) take a cluster's nodes' URLs separated by commas: the
/// first that answers is used; when none does, the error names each, exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_list_uses_the_first_live_url_and_names_each_dead_one() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let (dead1, dead2) = (dead_url()?, dead_url()?);
    let list = format!("{dead1},{}", d.url);
    let o = turnd(&["ping", "--json", "--url", &list]).await?;
    expect_code(&o, 0, "ping over [dead, live]")?;
    assert_eq!(json_out(&o)?["url"], d.url.as_str());
    // Through TURND_URL, with spaces after the commas.
    let o = command(&["ping", "--json"])
        .await?
        .env("TURND_URL", format!("{dead1}, {}", d.url))
        .output()
        .await?;
    expect_code(&o, 0, "ping over TURND_URL [dead, live]")?;
    assert_eq!(json_out(&o)?["url"], d.url.as_str());

    let o = turnd(&["ping", "--url", &format!("{dead1},{dead2}")]).await?;
    expect_code(&o, 2, "only dead URLs")?;
    let err = stderr(&o);
    assert!(
        err.starts_with(&format!(
            "turnd: cannot reach the daemon at any of its URLs: {dead1}: "
        )),
        "{err}"
    );
    assert!(err.contains(&format!("; {dead2}: ")), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    // An empty entry is bad usage, said before anything is tried.
    let o = turnd(&["ping", "--url", &format!("{dead1},,{}", d.url)]).await?;
    expect_code(&o, 2, "an empty entry")?;
    assert!(stderr(&o).contains("URL 2 of 3"), "{}", stderr(&o));
    assert!(stdout(&o).is_empty());
    d.shutdown().await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_a_taken_port_says_how_to_move_it_once_and_without_colour() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let data = dir.path().join("data");
    let data_arg = data.to_string_lossy().into_owned();
    for (args, want) in [
        (
            vec!["--listen", addr.as_str(), "--admin-listen", "127.0.0.1:0"],
            "address in use: pass --listen or set TURND_SERVER__LISTEN",
        ),
        (
            vec!["--listen", "127.0.0.1:0", "--admin-listen", addr.as_str()],
            "address in use: pass --admin-listen or set TURND_SERVER__ADMIN_LISTEN",
        ),
    ] {
        let mut all = vec!["serve", "--data-dir", data_arg.as_str()];
        all.extend(args);
        // `sync = never` logs a warning before the listeners bind: a text log line
        // to check for colour codes (stderr is a pipe here, not a terminal).
        let o = tokio::time::timeout(
            Duration::from_secs(30),
            command(&all)
                .await?
                .env("TURND_STORAGE__SYNC", "never")
                .env_remove("NO_COLOR")
                .output(),
        )
        .await??;
        expect_code(&o, 1, "serve on a taken port")?;
        let err = stderr(&o);
        assert_eq!(err.matches(want).count(), 1, "{want:?} once in\n{err}");
        assert!(err.contains(&addr), "{err}");
        assert!(err.contains("WARN"), "the sync warning is logged: {err}");
        assert!(!err.contains('\x1b'), "colour codes on a pipe: {err:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_says_plainly_that_keys_are_unknown_and_strict_refuses_them(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "[server]\nlisten = \"127.0.0.1:7500\"\n")?;
    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, "[server]\nlisten_addr = \"127.0.0.1:7500\"\n")?;
    let good_arg = good.to_string_lossy().into_owned();
    let typo_arg = typo.to_string_lossy().into_owned();

    for strict in [false, true] {
        let mut args = vec!["check-config", "--config", good_arg.as_str()];
        if strict {
            args.push("--strict");
        }
        let o = turnd(&args).await?;
        expect_code(&o, 0, "check-config of a clean file")?;
        assert_eq!(stdout(&o), "configuration ok\n");
        assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    }

    // Without --strict: valid, but it says so plainly on stdout, not "ok".
    let o = turnd(&["check-config", "--config", &typo_arg]).await?;
    expect_code(&o, 0, "check-config with an unknown key")?;
    let out = stdout(&o);
    assert!(!out.contains("configuration ok"), "{out}");
    assert!(out.contains("1 unknown key(s) are ignored"), "{out}");
    assert!(out.contains("--strict"), "{out}");
    assert!(
        stderr(&o)
            .contains("unknown config key server.listen_addr ignored; did you mean server.listen?"),
        "{}",
        stderr(&o)
    );

    // --strict: exit 2, nothing on stdout. An unknown TURND_ variable counts too.
    let o = turnd(&["check-config", "--config", &typo_arg, "--strict"]).await?;
    expect_code(&o, 2, "check-config --strict with an unknown key")?;
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    let err = stderr(&o);
    assert!(err.contains("server.listen_addr"), "{err}");
    assert!(err.contains("1 unknown key(s)"), "{err}");
    let o = command(&["check-config", "--config", &good_arg, "--strict"])
        .await?
        .env("TURND_SERVER__LISTEN_ADDR", "127.0.0.1:7500")
        .output()
        .await?;
    expect_code(&o, 2, "check-config --strict with an unknown variable")?;
    assert!(
        stderr(&o)
            .contains("TURND_SERVER__LISTEN_ADDR) ignored; did you mean TURND_SERVER__LISTEN?"),
        "{}",
        stderr(&o)
    );
    Ok(())
}

/// `check-config` refuses what `serve` would fail on at start, in words that say what
/// to write: a data directory that is a file, or that cannot be created or written by
/// the user it runs as, and a listen address with a host name instead of an IP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_refuses_an_unusable_data_dir_and_says_to_write_an_ip() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    // World-enterable, so that another user can reach what is inside.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let check = |data_dir: PathBuf| async move {
        let o = command(&["check-config"])
            .await?
            .env("TURND_STORAGE__DATA_DIR", &data_dir)
            .output()
            .await?;
        anyhow::Ok(o)
    };
    // Usable: missing (created by serve) or an empty directory.
    for ok in [dir.path().join("a/b/data"), dir.path().to_path_buf()] {
        let o = check(ok.clone()).await?;
        expect_code(
            &o,
            0,
            &format!("check-config with data_dir {}", ok.display()),
        )?;
        assert_eq!(stdout(&o), "configuration ok\n");
    }
    // A file where the directory should be, and a file where a parent should be.
    let file = dir.path().join("file");
    std::fs::write(&file, "x")?;
    let o = check(file.clone()).await?;
    expect_code(&o, 2, "check-config with data_dir a file")?;
    assert!(stderr(&o).contains("is not a directory"), "{}", stderr(&o));
    assert!(stdout(&o).is_empty(), "{}", stdout(&o));
    let o = check(file.join("data")).await?;
    expect_code(&o, 2, "check-config with data_dir under a file")?;
    assert!(stderr(&o).contains("cannot be created"), "{}", stderr(&o));
    // Not writable by the user it runs as. root may write anywhere, so as root the
    // check runs as `nobody` (setpriv), as systemd runs the unit's ExecStartPre.
    let locked = dir.path().join("locked");
    std::fs::create_dir(&locked)?;
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555))?;
    let as_user = |data_dir: PathBuf| async move {
        let mut cmd = if is_root() {
            let mut c = tokio::process::Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(bin().await?);
            c
        } else {
            tokio::process::Command::new(bin().await?)
        };
        let o = cmd
            .arg("check-config")
            .env("TURND_STORAGE__DATA_DIR", &data_dir)
            .env_remove("TURND_LOG")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await?;
        anyhow::Ok(o)
    };
    let o = as_user(locked.clone()).await?;
    expect_code(&o, 2, "check-config with a data_dir it cannot write")?;
    assert!(
        stderr(&o).contains("is not writable by this user"),
        "{}",
        stderr(&o)
    );
    let o = as_user(locked.join("data")).await?;
    expect_code(&o, 2, "check-config with a data_dir it cannot create")?;
    assert!(
        stderr(&o).contains("does not exist and cannot be created"),
        "{}",
        stderr(&o)
    );
    // A host name for a listen address: the hint says to write an IP.
    let o = command(&["check-config"])
        .await?
        .env("TURND_STORAGE__DATA_DIR", dir.path())
        .env("TURND_SERVER__LISTEN", "localhost:7420")
        .output()
        .await?;
    expect_code(&o, 2, "check-config with listen = localhost:7420")?;
    assert!(
        stderr(&o).contains("host names such as \"localhost\" are not resolved")
            && stderr(&o).contains("127.0.0.1:7420"),
        "{}",
        stderr(&o)
    );
    Ok(())
}

/// Whether this process runs as root (who may write anywhere).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_pages_and_filters_and_turn_stop_and_submit_say_what_happened() -> anyhow::Result<()>
{
    let d = TestDaemon::start(|_| {}).await?;
    let _w = echo_worker(&d.url, "w-turns", 1).await;
    let c = d.caller().await?;
    let mut done = Vec::new();
    for n in 0..3 {
        let t = c.submit_simple("s-turns", "echo", json!(n)).await?;
        done.push(wait_done(&c, &t.turn_id, 10).await?);
    }
    // A cancelled turn in the same session: `nobody` has no worker, stop it.
    let stuck = c.submit_simple("s-turns", "nobody", json!("x")).await?;
    c.stop(&stuck.turn_id, "cli test").await?;
    let cancelled = wait_done(&c, &stuck.turn_id, 10).await?;
    assert_eq!(cancelled.status, TurnStatus::Cancelled);

    // `turns --json` is what `turn.list` answers.
    let o = turnd(&["turns", "s-turns", "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "turns --json")?;
    let shown: ListOk = serde_json::from_value(json_out(&o)?)?;
    let all = c
        .list(ListArgs {
            session_id: "s-turns".into(),
            status: None,
            limit: None,
            before_seq: None,
        })
        .await?;
    assert_eq!(shown, all);
    assert_eq!(shown.turns.len(), 4);

    // Paging: two per page, newest first, with the command for the next page.
    let o = turnd(&["turns", "s-turns", "--url", &d.url, "--limit", "2"]).await?;
    expect_code(&o, 0, "turns --limit 2")?;
    let text = stdout(&o);
    assert!(
        text.contains(&stuck.turn_id) && text.contains(&done[2].turn_id),
        "{text}"
    );
    assert!(!text.contains(&done[0].turn_id), "{text}");
    let next = format!("turnd turns s-turns --before {} --limit 2", done[2].seq);
    assert!(stderr(&o).contains(&next), "{next:?} in {}", stderr(&o));
    let before = done[2].seq.to_string();
    let o = turnd(&[
        "turns", "s-turns", "--url", &d.url, "--limit", "2", "--before", &before, "--json",
    ])
    .await?;
    expect_code(&o, 0, "turns --before")?;
    let page: ListOk = serde_json::from_value(json_out(&o)?)?;
    let ids: Vec<&str> = page.turns.iter().map(|t| t.turn_id.as_str()).collect();
    assert_eq!(ids, [done[1].turn_id.as_str(), done[0].turn_id.as_str()]);
    // A status filter, and an empty answer in words.
    let o = turnd(&["turns", "s-turns", "--url", &d.url, "--status", "cancelled"]).await?;
    expect_code(&o, 0, "turns --status cancelled")?;
    let text = stdout(&o);
    assert!(
        text.contains(&stuck.turn_id) && !text.contains(&done[0].turn_id),
        "{text}"
    );
    let o = turnd(&["turns", "s-turns", "--url", &d.url, "--status", "running"]).await?;
    expect_code(&o, 0, "turns --status running")?;
    assert_eq!(stdout(&o), "no running turns in session s-turns\n");
    let o = turnd(&["turns", "s-turns", "--url", &d.url, "--status", "done"]).await?;
    expect_code(&o, 2, "turns --status with a bad status")?;
    assert!(
        stderr(&o).contains("one of queued, running, completed"),
        "{}",
        stderr(&o)
    );

    // `turn` exits as `wait` does: 0 completed, 1 cancelled.
    let o = turnd(&["turn", &done[0].turn_id, "--url", &d.url]).await?;
    expect_code(&o, 0, "turn of a completed turn")?;
    let o = turnd(&["turn", &stuck.turn_id, "--url", &d.url]).await?;
    expect_code(&o, 1, "turn of a cancelled turn")?;
    assert!(stdout(&o).contains("cancelled"), "{}", stdout(&o));
    assert!(stderr(&o).contains("cancelled"), "{}", stderr(&o));

    // `stop` of a finished turn says that nothing was stopped.
    let o = turnd(&["stop", &done[0].turn_id, "--url", &d.url]).await?;
    expect_code(&o, 0, "stop of a completed turn")?;
    assert!(
        stderr(&o).contains(&format!(
            "turn {} had already completed: nothing to stop",
            done[0].turn_id
        )),
        "{}",
        stderr(&o)
    );
    assert_eq!(c.get(&done[0].turn_id).await?, done[0]);
    let o = turnd(&["stop", &stuck.turn_id, "--url", &d.url]).await?;
    expect_code(&o, 0, "stop of a cancelled turn")?;
    assert!(
        stderr(&o).contains("had already been cancelled"),
        "{}",
        stderr(&o)
    );

    // `submit --json` says whether the key found an earlier turn.
    let mut seen = Vec::new();
    for _ in 0..2 {
        let o = turnd(&[
            "submit",
            "--url",
            &d.url,
            "--session",
            "s-turns",
            "--function",
            "echo",
            "--input",
            "7",
            "--idempotency-key",
            "k-1",
            "--json",
        ])
        .await?;
        expect_code(&o, 0, "submit --json")?;
        let v = json_out(&o)?;
        let t: Turn = serde_json::from_value(v.clone())?;
        seen.push((t.turn_id, v["deduplicated"].clone()));
    }
    assert_eq!(seen[0].0, seen[1].0);
    assert_eq!((&seen[0].1, &seen[1].1), (&json!(false), &json!(true)));

    // A bare word is not JSON: the error shows how to quote it.
    let o = turnd(&[
        "submit",
        "--url",
        &d.url,
        "--session",
        "s-turns",
        "--function",
        "echo",
        "--input",
        "hello",
    ])
    .await?;
    expect_code(&o, 2, "submit --input hello")?;
    assert!(
        stderr(&o).contains(r#"--input '"hello"'"#),
        "{}",
        stderr(&o)
    );
    // No event detail here is long: no hint about cut details.
    let o = turnd(&["events", "s-turns", "--url", &d.url]).await?;
    expect_code(&o, 0, "events")?;
    assert!(!stderr(&o).contains("cut to fit"), "{}", stderr(&o));
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_no_worker_registered_is_named_as_such() -> anyhow::Result<()> {
    let d = TestDaemon::start(|_| {}).await?;
    let _w = echo_worker(&d.url, "w-reg", 1).await;
    let c = d.caller().await?;
    let o = turnd(&[
        "submit",
        "--url",
        &d.url,
        "--session",
        "s-ghost",
        "--function",
        "ghost",
    ])
    .await?;
    expect_code(&o, 0, "submit to ghost")?;
    let text = stdout(&o);
    assert!(text.contains("why"), "{text}");
    assert!(text.contains("no worker has registered ghost"), "{text}");
    let o = turnd(&["inspect", "s-ghost", "--url", &d.url]).await?;
    expect_code(&o, 0, "inspect")?;
    assert!(
        stdout(&o).contains("no worker has registered ghost"),
        "{}",
        stdout(&o)
    );

    // functions.list marks it; the table shows no settings for it.
    let fs = c.functions().await?;
    let by_id = |id: &str| fs.iter().find(|f| f.function_id == id).cloned();
    let ghost: Function = by_id("ghost").context("ghost listed")?;
    assert!(!ghost.registered);
    assert_eq!(ghost.queued, 1);
    assert!(by_id("echo").context("echo listed")?.registered);
    let o = turnd(&["functions", "--url", &d.url, "--json"]).await?;
    expect_code(&o, 0, "functions --json")?;
    let shown: Vec<Function> = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(shown, fs);
    let o = turnd(&["functions", "--url", &d.url]).await?;
    expect_code(&o, 0, "functions")?;
    let text = stdout(&o);
    let ghost_row = text
        .lines()
        .find(|l| l.starts_with("ghost"))
        .context("ghost row")?;
    assert!(ghost_row.starts_with("ghost*"), "{text}");
    assert!(!ghost_row.contains("at_most_once"), "{text}");
    let echo_row = text
        .lines()
        .find(|l| l.starts_with("echo"))
        .context("echo row")?;
    assert!(!echo_row.contains('*'), "{text}");
    assert!(text.contains("* no worker has registered it"), "{text}");

    // A long stop reason makes a long event detail: the table cuts it and says how
    // to see it whole.
    let ghost_turn = c.inspect("s-ghost").await?.lock.context("lock")?.turn_id;
    let reason = "r".repeat(300);
    c.stop(&ghost_turn, &reason).await?;
    wait_done(&c, &ghost_turn, 10).await?;
    let o = turnd(&["events", "s-ghost", "--url", &d.url]).await?;
    expect_code(&o, 0, "events")?;
    assert!(!stdout(&o).contains(&reason), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("turnd events s-ghost --json shows them whole"),
        "{}",
        stderr(&o)
    );
    let o = turnd(&["events", "s-ghost", "--url", &d.url, "--json"]).await?;
    assert!(stdout(&o).contains(&reason));
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_path_and_refused_token_say_what_to_do() -> anyhow::Result<()> {
    let d = TestDaemon::start(|cfg| {
        cfg.auth.tokens = vec![
            TokenConfig {
                role: Role::Client,
                token: "client-secret-1".into(),
            },
            TokenConfig {
                role: Role::Operator,
                token: "operator-secret-1".into(),
            },
        ];
    })
    .await?;
    // The server's answer to a wrong path is shown.
    let wrong = d.url.replace("/v1", "/v2");
    let o = turnd(&["ping", "--url", &wrong]).await?;
    expect_code(&o, 2, "ping on a wrong path")?;
    let err = stderr(&o);
    assert!(err.contains("404"), "{err}");
    assert!(err.contains("protocol v1 is served at /v1"), "{err}");

    // No token, a wrong token, a client token for `check`: each names the flag, the
    // variable and the role.
    let o = turnd(&["ping", "--url", &d.url]).await?;
    expect_code(&o, 1, "ping without a token")?;
    let err = stderr(&o);
    assert!(err.starts_with("turnd: not_authenticated: "), "{err}");
    assert!(err.contains("no token was given"), "{err}");
    assert!(
        err.contains("--token") && err.contains("TURND_TOKEN"),
        "{err}"
    );
    assert!(err.contains("client (or operator) token"), "{err}");
    let o = turnd(&["ping", "--url", &d.url, "--token", "wrong-secret-1"]).await?;
    expect_code(&o, 1, "ping with a wrong token")?;
    assert!(stderr(&o).contains("was not accepted"), "{}", stderr(&o));
    let o = command(&["check", "--url", &d.url])
        .await?
        .env("TURND_TOKEN", "client-secret-1")
        .output()
        .await?;
    expect_code(&o, 1, "check with a client token")?;
    assert!(
        stderr(&o).contains("needs an operator token"),
        "{}",
        stderr(&o)
    );
    let o = turnd(&["ping", "--url", &d.url, "--token", "client-secret-1"]).await?;
    expect_code(&o, 0, "ping with the client token")?;
    d.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_a_data_dir_is_told_which_process_holds_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let first = BinDaemon::start(&data, &[]).await?;
    let pid = first.child.id().context("pid")?;
    let data_arg = data.to_string_lossy().into_owned();
    let o = turnd(&[
        "serve",
        "--data-dir",
        &data_arg,
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .await?;
    expect_code(&o, 1, "a second serve on the same data dir")?;
    let err = stderr(&o);
    let want = format!("another turnd holds {data_arg} (pid {pid})");
    assert_eq!(err.matches(&want).count(), 1, "{want:?} once in\n{err}");
    assert!(!err.contains("WouldBlock"), "{err}");
    // The first one still serves, and after it stops the directory is free again.
    let c = turnd_client::Caller::connect(&first.url, None).await?;
    c.ping().await?;
    drop(c);
    assert!(first.terminate().await?.success());
    let again = BinDaemon::start(&data, &[]).await?;
    assert!(again.terminate().await?.success());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ci_script_runs_a_command_with_turnd_on_path_and_stops_the_daemon() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("scripts/ci-turnd.sh");
    let logs = tempfile::tempdir()?;
    let kept = logs.path().join("turnd-ci.log");
    let run = |cmd: &'static str| {
        let script = script.clone();
        let kept = kept.clone();
        async move {
            let bin = bin().await?;
            // A PATH without turnd: the script must put it there itself.
            let o = tokio::time::timeout(
                Duration::from_secs(60),
                tokio::process::Command::new("bash")
                    .arg(&script)
                    .args(["sh", "-c", cmd])
                    .env("TURND", &bin)
                    .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                    .env("TURND_STORAGE__SYNC", "never")
                    .env("TURND_SERVER__LISTEN_ADR", "127.0.0.1:7500")
                    .env("TURND_CI_LOG", &kept)
                    .env_remove("TURND_URL")
                    .env_remove("TURND_TOKEN")
                    .stdin(Stdio::null())
                    .kill_on_drop(true)
                    .output(),
            )
            .await??;
            anyhow::Ok(o)
        }
    };
    let o = run(r#"turnd ping --url "$TURND_URL" && echo "url=$TURND_URL""#).await?;
    expect_code(&o, 0, "ci-turnd.sh turnd ping")?;
    let out = stdout(&o);
    assert!(out.contains("pong from turnd"), "{out}");
    // The daemon's warning about an unknown variable reaches the job's own log.
    assert!(
        stderr(&o).contains(
            "unknown config key server.listen_adr (from TURND_SERVER__LISTEN_ADR) ignored; \
             did you mean TURND_SERVER__LISTEN?"
        ),
        "{}",
        stderr(&o)
    );
    assert!(!kept.exists(), "a log kept after a command that passed");
    let url = out
        .lines()
        .find_map(|l| l.strip_prefix("url="))
        .context("the URL printed")?
        .to_string();
    // The daemon is gone once the script returns.
    let o = turnd(&["ping", "--url", &url]).await?;
    expect_code(&o, 2, "ping after the script ended")?;
    // COMMAND's status is the script's.
    let o = run("exit 7").await?;
    expect_code(&o, 7, "ci-turnd.sh exit 7")?;
    // When COMMAND fails, the daemon's log is kept and its end shown.
    let err = stderr(&o);
    assert!(err.contains("the daemon's log is kept at"), "{err}");
    let log = std::fs::read_to_string(&kept).context("the kept log")?;
    assert!(log.contains("turnd listening on"), "{log}");
    // The ready line leads to the operator page.
    assert!(
        log.lines().any(|l| l.contains("turnd listening on")
            && l.contains("admin http://127.0.0.1:")
            && l.contains("(operator page http://127.0.0.1:")
            && l.contains("/ui)")),
        "{log}"
    );
    assert!(err.contains("turnd listening on"), "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn make_install_puts_the_binary_unit_and_config_under_destdir() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dest = tempfile::tempdir()?;
    let bin = bin().await?;
    let install = || {
        let mut cmd = tokio::process::Command::new("make");
        cmd.arg("-C")
            .arg(&root)
            .arg("--no-print-directory")
            .arg("install")
            .arg(format!("DESTDIR={}", dest.path().display()))
            .arg("PREFIX=/opt/turnd")
            .arg(format!("INSTALL_BIN={}", bin.display()))
            // Not the flags of a `make test` this runs under.
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("MAKELEVEL")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    };
    let o = tokio::time::timeout(Duration::from_secs(60), install().output()).await??;
    expect_code(&o, 0, "make install")?;
    let at = |p: &str| dest.path().join(p.trim_start_matches('/'));
    let mode = |p: &str| -> anyhow::Result<u32> {
        Ok(std::fs::metadata(at(p))
            .with_context(|| format!("{p} installed"))?
            .permissions()
            .mode()
            & 0o777)
    };
    assert_eq!(mode("/opt/turnd/bin/turnd")?, 0o755);
    assert_eq!(mode("/usr/lib/debug/opt/turnd/bin/turnd.debug")?, 0o644);
    // The installed binary carries no debug info; it is kept apart, where the
    // binary's debug link points.
    let sections = |p: &std::path::Path| -> anyhow::Result<String> {
        let o = std::process::Command::new("readelf")
            .args(["-S", "-W"])
            .arg(p)
            .output()
            .context("readelf")?;
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    assert!(
        sections(&bin)?.contains(".debug_info"),
        "the built binary has debug info"
    );
    let installed = sections(&at("/opt/turnd/bin/turnd"))?;
    assert!(!installed.contains(".debug_info"), "{installed}");
    assert!(installed.contains(".gnu_debuglink"), "{installed}");
    let debug = sections(&at("/usr/lib/debug/opt/turnd/bin/turnd.debug"))?;
    assert!(debug.contains(".debug_info"), "{debug}");
    assert!(
        std::fs::metadata(at("/opt/turnd/bin/turnd"))?.len() * 2 < std::fs::metadata(&bin)?.len(),
        "the installed binary is not much smaller than the built one"
    );
    assert_eq!(mode("/etc/systemd/system/turnd.service")?, 0o644);
    assert_eq!(mode("/etc/turnd/turnd.toml")?, 0o644);
    assert_eq!(mode("/etc/default/turnd")?, 0o600);
    // The unit runs the installed binary.
    let unit = std::fs::read_to_string(at("/etc/systemd/system/turnd.service"))?;
    assert!(
        unit.contains("ExecStart=/opt/turnd/bin/turnd serve --config /etc/turnd/turnd.toml"),
        "{unit}"
    );
    assert!(!unit.contains("/usr/local/bin"), "{unit}");
    let o = tokio::process::Command::new(at("/opt/turnd/bin/turnd"))
        .arg("--version")
        .output()
        .await?;
    expect_code(&o, 0, "the installed turnd --version")?;
    // A second install keeps the operator's configuration.
    std::fs::write(at("/etc/turnd/turnd.toml"), "# mine\n")?;
    let o = tokio::time::timeout(Duration::from_secs(60), install().output()).await??;
    expect_code(&o, 0, "make install again")?;
    assert_eq!(
        std::fs::read_to_string(at("/etc/turnd/turnd.toml"))?,
        "# mine\n"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_examples_run_a_multi_step_turn() -> anyhow::Result<()> {
    let (worker_bin, caller_bin) = tokio::task::spawn_blocking(|| {
        anyhow::Ok((client_example("worker")?, client_example("caller")?))
    })
    .await??;
    // The worker example, pointed at nothing, says so on stderr.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let nowhere = format!("ws://127.0.0.1:{port}/v1");
    let mut lost = tokio::process::Command::new(&worker_bin)
        .args([nowhere.as_str(), "w-nowhere"])
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut err = BufReader::new(lost.stderr.take().context("stderr")?).lines();
    let line = tokio::time::timeout(Duration::from_secs(15), err.next_line())
        .await
        .context("no warning within 15s")??
        .context("stderr ended")?;
    assert!(
        line.contains("failed to connect worker") && line.contains(&nowhere),
        "{line}"
    );
    lost.start_kill()?;
    lost.wait().await?;

    let d = TestDaemon::start(|_| {}).await?;
    let mut worker = tokio::process::Command::new(&worker_bin)
        .args([d.url.as_str(), "w-example"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let caller = |args: &'static [&'static str]| {
        let mut cmd = tokio::process::Command::new(&caller_bin);
        cmd.args(args)
            .env("TURND_URL", &d.url)
            .env_remove("TURND_TOKEN")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        tokio::time::timeout(Duration::from_secs(30), async move { cmd.output().await })
    };
    let o = caller(&["countdown", r#"{"from":3}"#, "s-example"]).await??;
    expect_code(&o, 0, "the caller example")?;
    let turn: Turn = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(turn.status, TurnStatus::Completed);
    assert_eq!(turn.output, Some(json!({"done": true})));
    assert_eq!(turn.step, 3, "three continues, then the completing step");
    // Run as the README runs it, without a session: the turn lands in `s-1`, the
    // session the README's tour inspects next.
    let o = caller(&["echo", r#"{"hello":"world"}"#]).await??;
    expect_code(&o, 0, "the caller example without a session")?;
    let turn: Turn = serde_json::from_value(json_out(&o)?)?;
    assert_eq!(turn.session_id, "s-1");
    let o = turnd(&["inspect", "s-1", "--url", &d.url]).await?;
    expect_code(&o, 0, "turnd inspect s-1 after the caller example")?;
    worker.start_kill()?;
    worker.wait().await?;
    d.shutdown().await
}
