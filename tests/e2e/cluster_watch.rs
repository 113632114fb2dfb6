//! Watches on a cluster, through the real binaries (three `nats-server`, three
//! `turnd` on loopback, each process started here and ended by its PID): a caller
//! on any node watches any session, relayed from its partition's leader, and the
//! watch goes on across the leader's death with every event once, in order.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::StreamExt;
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;
use turnd_client::{Caller, ClientError, FunctionSpec, Worker};
use turnd_cluster::testing::Rig;
use turnd_proto::{Event, Failure, Outcome, SubmitArgs, TurnStatus, WatchArgs};
use turnd_tests::cluster::{
    all_led, echo_worker_on_all, leader_of, placed, signal, start_three, status, PARTITIONS,
};
use turnd_tests::{all_events, eventually};

/// Submit `n` echo turns to `session` through `url` (each try on a new caller, with
/// an idempotency key, while the partition has no leader) and wait until each
/// completed.
async fn echo_turns(url: &str, session: &str, tag: &str, n: usize) -> anyhow::Result<()> {
    run_turns(url, session, ("echo", TurnStatus::Completed), tag, n).await
}

/// Submit `n` turns of `function` as [`echo_turns`] does; each must end `status`.
async fn run_turns(
    url: &str,
    session: &str,
    (function, status): (&str, TurnStatus),
    tag: &str,
    n: usize,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for i in 0..n {
        let key = format!("{tag}-{i}");
        let turn_id = loop {
            let tried = async {
                let c = Caller::connect(url, None).await?;
                c.submit(SubmitArgs {
                    session_id: session.to_string(),
                    function_id: function.into(),
                    input: json!({ "i": i }),
                    idempotency_key: Some(key.clone()),
                    turn_timeout_ms: None,
                    on_busy: None,
                })
                .await
            };
            match tried.await {
                Ok(ok) => break ok.turn.turn_id,
                Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e).context(format!("submit {key}")),
            }
        };
        let t = loop {
            let waited = async {
                let c = Caller::connect(url, None).await?;
                c.wait_terminal(&turn_id, Duration::from_secs(20)).await
            };
            match waited.await {
                Ok(t) => break t,
                Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e).context(format!("wait for {turn_id}")),
            }
        };
        if t.status != status {
            bail!("turn {turn_id} ended {:?}", t.status);
        }
    }
    Ok(())
}

/// A session whose partition `leader` leads now.
async fn session_led_by(admin: &str, leader: &str) -> anyhow::Result<String> {
    let st = status(admin).await?;
    (0..1000)
        .map(|i| format!("w{i}"))
        .find(|s| {
            let p = turnd_proto::session_partition(s, PARTITIONS);
            leader_of(&st, p).as_deref() == Some(leader)
        })
        .with_context(|| format!("no session led by {leader}: {st}"))
}

/// Wait until the placement stops moving partitions (they go to their preferred
/// leaders once those caught up): the same leaders twice, half a second apart.
async fn settled(admin: &str) -> anyhow::Result<()> {
    let mut last = String::new();
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let st = status(admin).await?;
        let now: String = (0..PARTITIONS)
            .map(|p| format!("{:?},", leader_of(&st, p)))
            .collect();
        if now == last {
            return Ok(());
        }
        last = now;
    }
    bail!("the placement did not settle within 20 s")
}

/// Read `stream` until it delivered the event `seq == last` (at most 30 s).
async fn events_until(
    stream: &mut turnd_client::WatchStream,
    last: u64,
) -> anyhow::Result<Vec<Event>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while got.last().is_none_or(|e: &Event| e.seq < last) {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(e)) => got.push(e),
            Ok(None) => bail!("the watch ended after {} events", got.len()),
            Err(_) => bail!(
                "the watch delivered up to seq {:?}, not {last}, within 30 s",
                got.last().map(|e| e.seq)
            ),
        }
    }
    Ok(got)
}

/// A watch made on a node that does not lead its session's partition gets every
/// event of the session, relayed; its node paused while the leader is killed and
/// turns commit on the next leader, it resumes from the last event it delivered:
/// the events it delivers are exactly the session's, each once, in order. A watch
/// made while the partition has no leader waits for the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_any_node_sees_every_event_once_across_a_killed_leader() -> anyhow::Result<()> {
    turnd_tests::need_nats!();
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let mut nodes = start_three(&rig, root.path(), &[]).await?;
    let pids: Vec<u32> = nodes.iter().filter_map(|n| n.child.id()).collect();
    eprintln!("nats-server pids {:?}, turnd pids {pids:?}", rig.pids());
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let admin = nodes[2].admin.clone();
    all_led(&admin, &["n0", "n1", "n2"], 30).await?;
    let worker = echo_worker_on_all(&urls).await;
    // Let the placement settle on n0 leading something.
    let session = {
        let mut found = None;
        for _ in 0..100 {
            if let Ok(s) = session_led_by(&admin, "n0").await {
                found = Some(s);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        found.context("n0 leads no partition")?
    };
    let watcher = Caller::connect(&urls[1], None).await?;
    let mut stream = watcher
        .watch(WatchArgs {
            session_id: Some(session.clone()),
            turn_id: None,
            after: None,
            progress: false,
        })
        .await?;
    echo_turns(&urls[2], &session, "a", 4).await?;

    // The watcher's node stops reading; the leader dies; turns commit on the next
    // leader (n2) while the watch is not there to see them.
    signal(pids[1], "STOP")?;
    let n0 = nodes.remove(0);
    n0.kill().await?;
    let killed = std::time::Instant::now();
    // A watch made while nobody leads the partition yet (n0's lease still runs)
    // waits for the next leader rather than being refused.
    let second = Caller::connect(&urls[2], None).await?;
    let mut replayed = second
        .watch(WatchArgs {
            session_id: Some(session.clone()),
            turn_id: None,
            after: Some(0),
            progress: false,
        })
        .await?;
    eprintln!(
        "a watch made at the kill answered {:?} after it",
        killed.elapsed()
    );
    let p = turnd_proto::session_partition(&session, PARTITIONS);
    eventually(30, "n2 leads the session's partition", || async {
        let st = status(&admin).await.ok()?;
        (leader_of(&st, p).as_deref() == Some("n2")).then_some(())
    })
    .await?;
    eprintln!(
        "partition {p} led by n2 {:?} after the kill",
        killed.elapsed()
    );
    echo_turns(&urls[2], &session, "b", 4).await?;
    signal(pids[1], "CONT")?;
    eprintln!("n1 woke {:?} after the kill", killed.elapsed());
    all_led(&admin, &["n1", "n2"], 30).await?;
    echo_turns(&urls[2], &session, "c", 4).await?;

    let reader = Caller::connect(&urls[2], None).await?;
    let stored = all_events(&reader, &session).await?;
    let last = stored.last().map(|e| e.seq).context("no events stored")?;
    let got = events_until(&mut stream, last).await?;
    let seqs = |v: &[Event]| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(
        seqs(&got),
        seqs(&stored),
        "the watch's events are the session's, each once, in order"
    );
    assert_eq!(got, stored, "and the same events");
    let again = events_until(&mut replayed, last).await?;
    assert_eq!(
        seqs(&again),
        seqs(&stored),
        "a watch from the start made during the takeover"
    );
    let st = status(&nodes[0].admin).await?;
    eprintln!(
        "n1: {} watch(es), {} resume(s)",
        st["watches"], st["watch_resumes"]
    );
    assert!(st["watch_resumes"].as_u64().is_some_and(|n| n >= 1), "{st}");

    // `unwatch` ends it on the node that relays it.
    watcher.unwatch(&stream.watch_id).await?;
    let again = watcher.unwatch(&stream.watch_id).await;
    assert!(
        matches!(&again, Err(ClientError::Protocol(e)) if e.code == turnd_proto::ErrorCode::NotFound),
        "{again:?}"
    );
    worker.shutdown();
    for n in nodes {
        n.kill().await?;
    }
    Ok(())
}

/// A relayed watcher that stops reading holds bounded buffers: the leader's queue
/// for it (`server.outbox_frames`, 16 here) overflows and its feed ends; read
/// again, the watcher gets the events it was sent, from the first with no gap, and
/// then its connection closes with 1008 as a slow reader's; the relaying node
/// holds no watch after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_watcher_that_does_not_read_is_closed_as_a_slow_reader() -> anyhow::Result<()> {
    turnd_tests::need_nats!();
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    // A small queue per connection; the peer's silence, or a writer that cannot
    // write, would close it only after a minute or two.
    let small = [
        ("TURND_SERVER__OUTBOX_FRAMES", "16"),
        ("TURND_SERVER__HEARTBEAT_MS", "20000"),
        ("TURND_SERVER__WRITE_STALL_MS", "120000"),
    ];
    let nodes = start_three(&rig, root.path(), &small).await?;
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let admin = nodes[2].admin.clone();
    all_led(&admin, &["n0", "n1", "n2"], 30).await?;
    // The hand-overs that follow the start are over: the leader it reads stays.
    placed(&admin, &["n0", "n1", "n2"], 30).await?;
    // Its turns fail with a 40 KB message, carried by their `failed` events.
    let mut o = turnd_tests::worker_options(&urls[0], "w");
    o.also = urls[1..].to_vec();
    let worker = Worker::new(o)
        .function(FunctionSpec::new("big").concurrency(16), |_| async move {
            Outcome::Fail(Failure {
                code: "big".into(),
                message: "x".repeat(40_000),
                retryable: false,
            })
        })
        .spawn(tokio_util::sync::CancellationToken::new());
    worker.connected().await;
    settled(&admin).await?;
    let session = "w0".to_string();
    let p = turnd_proto::session_partition(&session, PARTITIONS);
    let leads = leader_of(&status(&admin).await?, p).context("no leader")?;
    let l: usize = leads.trim_start_matches('n').parse()?;
    let relaying = (l + 1) % 3;
    eprintln!("{leads} leads partition {p}; the watcher is on n{relaying}");
    let mut slow = turnd_tests::small_buffer_peer(&urls[relaying]).await?;
    slow.ok(
        "hello",
        json!({"protocol": 1, "role": "client", "token": "t"}),
    )
    .await?;
    slow.ok("watch", json!({"session_id": session, "after": 0}))
        .await?;
    let feeds = |admin: String| async move { status(&admin).await.ok()?["feeds"].as_u64() };
    let leader = nodes[l].admin.clone();
    assert_eq!(feeds(leader.clone()).await, Some(1), "the leader feeds it");
    // Far more events than the buffers between hold: 16 + 256 frames in flight + 16,
    // and the sockets' (6 MB of `failed` events).
    run_turns(&urls[2], &session, ("big", TurnStatus::Failed), "slow", 150).await?;
    eventually(10, "the leader to end the overflowed feed", || {
        let leader = leader.clone();
        async move { (feeds(leader).await == Some(0)).then_some(()) }
    })
    .await?;
    // Read again: events from the first, in order with no gap, then the close.
    let mut seqs = Vec::new();
    let code = loop {
        let m = tokio::time::timeout(Duration::from_secs(10), slow.ws.next())
            .await
            .context("no frame or close within 10 s")?;
        match m {
            Some(Ok(Message::Text(t))) => {
                let f: serde_json::Value = serde_json::from_str(t.as_str())?;
                if let Some(seq) = f["event"]["seq"].as_u64() {
                    seqs.push(seq);
                }
            }
            Some(Ok(Message::Close(c))) => break c.map(|c| u16::from(c.code)),
            Some(Ok(_)) => {}
            Some(Err(e)) => bail!("socket error instead of a close: {e}"),
            None => break None,
        }
    };
    eprintln!(
        "the slow watcher got {} events, then close {code:?}",
        seqs.len()
    );
    assert_eq!(code, Some(1008), "closed as a slow reader");
    assert!(!seqs.is_empty());
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "no gap before the close"
    );
    eventually(10, "the relaying node to hold no watch", || {
        let admin = nodes[relaying].admin.clone();
        async move { (status(&admin).await.ok()?["watches"] == 0).then_some(()) }
    })
    .await?;
    worker.shutdown();
    for n in nodes {
        n.kill().await?;
    }
    Ok(())
}
