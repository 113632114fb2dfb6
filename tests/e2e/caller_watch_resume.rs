//! A Rust caller's watches across a daemon killed (SIGKILL) and started again on the
//! same data directory and port: each opens its watch again on the new connection
//! from the last event it delivered, so its reader gets every event once, in order,
//! as `session.events` reads them back.

use std::time::Duration;

use serde_json::json;
use turnd_client::{Caller, WatchStream};
use turnd_proto::{Event, EventKind, WatchArgs};
use turnd_tests::{all_events, echo_turns, echo_worker, BinDaemon};

/// Longest wait for one event of a watch.
const EVENT_WITHIN: Duration = Duration::from_secs(30);

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Read `stream` until it delivered `n` events.
async fn read_events(stream: &mut WatchStream, n: usize) -> anyhow::Result<Vec<Event>> {
    let mut got = Vec::new();
    while got.len() < n {
        match tokio::time::timeout(EVENT_WITHIN, stream.next()).await {
            Ok(Some(e)) => got.push(e),
            Ok(None) => anyhow::bail!("the watch ended after {} events: {got:?}", got.len()),
            Err(_) => anyhow::bail!("no event within {EVENT_WITHIN:?} after {got:?}"),
        }
    }
    Ok(got)
}

fn seqs(events: &[Event]) -> Vec<u64> {
    events.iter().map(|e| e.seq).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_go_on_across_a_killed_and_restarted_daemon() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let listen = format!("127.0.0.1:{}", free_port()?);
    let env = [("TURND_TURNS__RECONNECT_GRACE_MS", "30000")];
    let a = BinDaemon::start_on(&data, &listen, &env).await?;
    let url = a.url.clone();
    let worker = echo_worker(&url, "w-resume", 4).await;
    let c = Caller::connect(&url, None).await?;

    // Two turns before the watch: a watch without `after` starts after them.
    echo_turns(&c, "s-w", 0, 2).await?;
    let before = all_events(&c, "s-w").await?;
    let mut watch = c
        .watch(WatchArgs {
            session_id: Some("s-w".into()),
            turn_id: None,
            after: None,
            progress: false,
        })
        .await?;
    // A turn nobody serves yet, watched on its own, delivers nothing before the kill.
    let held = c.submit_simple("s-held", "later", json!("h")).await?;
    let mut turn_watch = c.watch_turn(&held.turn_id).await?;

    echo_turns(&c, "s-w", 2, 3).await?;
    let live_before = all_events(&c, "s-w").await?.len() - before.len();
    // The reader goes on through the kill: its stream opens the watch again by itself.
    let reader = tokio::spawn(async move {
        let got = read_events(&mut watch, live_before).await?;
        anyhow::Ok((got, watch))
    });
    let (mut got, mut watch) = reader.await??;

    a.kill().await?;
    let reading = tokio::spawn(async move {
        // Blocks on the lost connection until the daemon is back and more turns ran.
        let next = tokio::time::timeout(EVENT_WITHIN, watch.next()).await;
        (next, watch)
    });
    let b = BinDaemon::start_on(&data, &listen, &env).await?;
    assert_eq!(b.url, url);
    echo_turns(&c, "s-w", 5, 3).await?;
    let (first_after, mut watch) = reading.await?;
    got.push(first_after?.ok_or_else(|| anyhow::anyhow!("the watch ended at the kill"))?);

    let stored = all_events(&c, "s-w").await?;
    let expected: Vec<Event> = stored[before.len()..].to_vec();
    got.extend(read_events(&mut watch, expected.len() - got.len()).await?);
    assert_eq!(seqs(&got), seqs(&expected), "each event once, in order");
    assert_eq!(got, expected);
    assert_eq!(watch.starts(), 2, "opened again once, after the kill");
    // Nothing more: no repeat of an event delivered before the kill.
    let more = tokio::time::timeout(Duration::from_millis(300), watch.next()).await;
    assert!(more.is_err(), "an event past the session's last: {more:?}");

    // The turn watch: the turn runs once a worker serves its function, after the
    // restart; the stream, which delivered nothing before the kill, gets every event
    // of the turn from its start to its terminal event.
    let later = turnd_client::Worker::new(turnd_tests::worker_options(&url, "w-later"))
        .function(turnd_client::FunctionSpec::new("later"), |ctx| async move {
            turnd_proto::Outcome::Complete(ctx.invoke.input.clone())
        })
        .spawn(tokio_util::sync::CancellationToken::new());
    later.connected().await;
    let mut of_turn = Vec::new();
    while of_turn.last().map(|e: &Event| e.kind) != Some(EventKind::Completed) {
        of_turn.extend(read_events(&mut turn_watch, 1).await?);
    }
    let stored = all_events(&c, "s-held").await?;
    let start = turn_watch_start(&stored, &held.turn_id);
    let expected: Vec<Event> = stored
        .into_iter()
        .filter(|e| e.turn_id == held.turn_id && e.seq > start)
        .collect();
    assert_eq!(of_turn, expected);
    assert!(
        of_turn.iter().any(|e| e.kind == EventKind::Dispatched),
        "{of_turn:?}"
    );
    assert_eq!(turn_watch.starts(), 2, "opened again once, after the kill");

    // Unwatched by the id it was first opened with, the resumed stream ends.
    c.unwatch(&watch.watch_id).await?;
    let end = tokio::time::timeout(EVENT_WITHIN, watch.next()).await?;
    assert_eq!(end, None);
    turn_watch.unwatch().await?;
    assert_eq!(
        tokio::time::timeout(EVENT_WITHIN, turn_watch.next()).await?,
        None
    );

    drop((worker, later));
    Ok(())
}

/// Where a turn watch opened right after the turn's submission starts: its
/// `admitted` event, the session's last then.
fn turn_watch_start(stored: &[Event], turn_id: &str) -> u64 {
    stored
        .iter()
        .find(|e| e.turn_id == turn_id && e.kind == EventKind::Admitted)
        .map_or(0, |e| e.seq)
}
