//! The JetStream commit log against real nats-server processes: groups round
//! trip with their positions, a group larger than a message splits and a record
//! larger than one is refused with nothing written, exactly one of two racing
//! leaders leads and the other is deposed, a deposed leader's append that the
//! server lets in is void by the rule for every reader, an append that cannot
//! reach any server waits until the node's stop, trims wait for the replicas'
//! marks, and appends go out on a connection to the stream's leader, following it
//! when it moves.

mod common;

use std::time::Duration;

use common::{append, cfg, held_to, lead, record, three_with_stream};
use turnd_cluster::log::{lsn, read_valid, seq_of};
use turnd_cluster::marks::Marks;
use turnd_cluster::testing::Rig;
use turnd_cluster::{need_nats, JetStreamLog, LogConfig, LogError};
use turnd_store::log::CommitLog;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_round_trip_with_their_positions_and_large_ones_split() {
    need_nats!();
    let rig = Rig::start(1).await.expect("rig");
    let nats = rig.connect("a").await.expect("connect");
    let c = cfg(1, 1);
    let opened = lead(&nats, &c, "a", 0).await.expect("lead");
    assert!(opened.records.is_empty());
    let log = opened.log;
    let fence = log.epoch();
    assert_eq!(fence, 1, "the first message of a new stream is the fence");
    assert_eq!(log.next_lsn(), lsn(2, 0));

    let small = vec![record("g1-0", 10), record("g1-1", 1000), record("g1-2", 0)];
    let first = append(&log, small.clone()).await.expect("append");
    assert_eq!(first, lsn(2, 0));
    // Past the server's max_payload (1 MiB): two messages, one group.
    let big = vec![
        record("g2-0", 700_000),
        record("g2-1", 700_000),
        record("g2-2", 5),
    ];
    let second = append(&log, big.clone())
        .await
        .expect("append a large group");
    assert_eq!(second, lsn(3, 0));
    assert_eq!(
        log.status().last_seq,
        4,
        "the large group took two messages"
    );
    let third = append(&log, vec![record("g3", 3)]).await.expect("append");
    assert_eq!(third, lsn(5, 0));

    // A record larger than any message: refused, nothing written, the log goes on.
    let refused = append(&log, vec![record("huge", 2 << 20)]).await;
    assert!(refused.is_err(), "a record over max_payload is refused");
    assert!(!log.is_failed());
    log.heal().expect("nothing to heal after a refusal");
    assert_eq!(log.status().last_seq, 5, "nothing was written");
    let fourth = append(&log, vec![record("g4", 3)])
        .await
        .expect("append after a refusal");
    assert_eq!(fourth, lsn(6, 0));

    // Every record back, from another reader, at its position.
    let read = read_valid(&nats, &c, 0).await.expect("read");
    let got: Vec<(u64, Vec<u8>)> = read
        .records
        .iter()
        .map(|r| (r.lsn, r.payload.clone()))
        .collect();
    let mut want = Vec::new();
    for (start, group) in [
        (2, &small),
        (3, &big),
        (5, &vec![record("g3", 3)]),
        (6, &vec![record("g4", 3)]),
    ] {
        for (i, r) in group.iter().enumerate() {
            want.push((lsn(start, i as u32), r.clone()));
        }
    }
    assert_eq!(got.len(), want.len());
    assert!(got == want, "every record at its position");
    // From the middle of the large group, and a range read.
    let mid = read_valid(&nats, &c, lsn(3, 1)).await.expect("read");
    assert_eq!(mid.records.first().map(|r| r.lsn), Some(lsn(3, 2)));
    let range = {
        let log = log.clone();
        tokio::task::spawn_blocking(move || log.read_range(lsn(2, 2), lsn(5, 0)))
            .await
            .expect("thread")
            .expect("read a range")
    };
    let lsns: Vec<u64> = range.iter().map(|r| r.lsn).collect();
    assert_eq!(lsns, vec![lsn(3, 0), lsn(3, 1), lsn(3, 2), lsn(5, 0)]);
}

/// Two nodes read the stream to the same end and fence at once, many times over:
/// exactly one leads each time. The one that led before is deposed, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_racing_leaders_exactly_one_leads_and_the_other_is_deposed() {
    need_nats!();
    let rig = Rig::start(3).await.expect("rig");
    let a = rig.connect_to(0, "a").await.expect("connect");
    let b = rig.connect_to(1, "b").await.expect("connect");
    let c = cfg(2, 3);
    let first = lead(&a, &c, "a", 0).await.expect("a leads first").log;
    append(&first, vec![record("a0", 100)])
        .await
        .expect("append");
    let mut leaders = vec![first];
    let trials = 12;
    for t in 0..trials {
        let (ra, rb) = tokio::join!(lead(&a, &c, "a", 0), lead(&b, &c, "b", 0));
        let won: Vec<JetStreamLog> = [ra, rb]
            .into_iter()
            .filter_map(|r| match r {
                Ok(o) => Some(o.log),
                Err(LogError::NotLeader(_)) => None,
                Err(e) => panic!("trial {t}: {e}"),
            })
            .collect();
        assert_eq!(won.len(), 1, "trial {t}: exactly one of two leads");
        // Every earlier leader is deposed by the new fence.
        for old in leaders.drain(..) {
            let r = append(&old, vec![record("stale", 10)]).await;
            assert!(r.is_err(), "trial {t}: a deposed leader's append fails");
            assert!(old.is_failed());
            assert!(old.heal().is_err(), "deposed is for good");
            assert!(old.health().is_err_and(|e| e.contains("deposed")));
        }
        let new = won.into_iter().next().expect("the leader");
        append(&new, vec![record(&format!("t{t}"), 100)])
            .await
            .expect("the leader appends");
        leaders.push(new);
    }
    let read = read_valid(&a, &c, 0).await.expect("read");
    let payloads: Vec<String> = read
        .records
        .iter()
        .map(|r| {
            String::from_utf8_lossy(&r.payload)
                .trim_end_matches('.')
                .to_string()
        })
        .collect();
    let want: Vec<String> = std::iter::once("a0".to_string())
        .chain((0..trials).map(|t| format!("t{t}")))
        .collect();
    assert_eq!(payloads, want, "only the leaders' appends count");
}

/// A deposed leader writes what the server lets in (no expected-sequence header):
/// the server stores it, and no reader counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_append_the_server_lets_in_is_void_by_the_rule() {
    need_nats!();
    let rig = Rig::start(3).await.expect("rig");
    let a = rig.connect_to(0, "a").await.expect("connect");
    let b = rig.connect_to(2, "b").await.expect("connect");
    let c = cfg(3, 3);
    let zombie = lead(&a, &c, "a", 0).await.expect("a leads").log;
    append(&zombie, vec![record("a-acked", 50)])
        .await
        .expect("append");
    let leader = lead(&b, &c, "b", 0).await.expect("b leads").log;
    let before = read_valid(&b, &c, 0).await.expect("read");

    let stored =
        tokio::task::spawn_blocking(move || zombie.append_unchecked_for_tests(&[b"zombie-write"]))
            .await
            .expect("thread")
            .expect("the server takes a message without the expected sequence");
    assert_eq!(
        stored,
        before.last + 1,
        "the server stored it at the stream's end"
    );
    append(&leader, vec![record("b-acked", 50)])
        .await
        .expect("the leader appends after it");

    let read = read_valid(&b, &c, 0).await.expect("read");
    assert!(
        read.records.iter().all(|r| r.payload != b"zombie-write"),
        "no reader counts the zombie's write"
    );
    assert_eq!(read.void, before.void + 1, "it is counted void");
    assert_eq!(read.records.len(), 2);
    // A new leader's start and a range read apply the same rule.
    let third = lead(&a, &c, "c", 0).await.expect("c leads");
    assert_eq!(third.records.len(), 2);
    assert!(third.records.iter().all(|r| r.payload != b"zombie-write"));
    assert_eq!(third.log.status().void_records, read.void);
}

/// With no server reachable an append keeps trying; it returns only at the node's
/// stop, with the log failed for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_no_server_answers_waits_until_the_node_stops() {
    need_nats!();
    let mut rig = Rig::start(1).await.expect("rig");
    let nats = rig.connect("a").await.expect("connect");
    let c = cfg(4, 1);
    let log = lead(&nats, &c, "a", 0).await.expect("lead").log;
    append(&log, vec![record("before", 10)])
        .await
        .expect("append");
    rig.kill9(0);
    let pending = tokio::spawn({
        let log = log.clone();
        async move { append(&log, vec![record("unsettled", 10)]).await }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!pending.is_finished(), "an append in doubt does not return");
    assert!(!log.is_failed());
    log.stop();
    let r = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .expect("the stop ends the wait")
        .expect("task");
    let e = r.expect_err("stopped unsettled");
    assert!(e.to_string().contains("stopped"), "{e}");
    assert!(log.is_failed());
    assert!(log.heal().is_err());
    assert!(log.health().is_err_and(|h| h.contains("stopped")));
}

/// A trim purges only below the least mark of the nodes seen within the replica
/// timeout, at a group's start; a node whose mark stood still longer is not
/// waited for; a store behind the stream's first message is told to copy a peer's;
/// a log that was stopped trims nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trim_waits_for_a_lagging_mark() {
    need_nats!();
    let rig = Rig::start(1).await.expect("rig");
    let nats = rig.connect("a").await.expect("connect");
    let mut c = cfg(5, 1);
    c.replica_timeout = Duration::from_secs(2);
    let marks = Marks::open(&nats, 1).await.expect("marks");
    let log = {
        let (nats, c, marks) = (nats.clone(), c.clone(), marks.clone());
        tokio::task::spawn_blocking(move || JetStreamLog::lead(&nats, &c, "a", 0, Some(marks)))
            .await
            .expect("thread")
            .expect("lead")
            .log
    };
    let mut firsts = Vec::new();
    for i in 0..10 {
        firsts.push(
            append(&log, vec![record(&format!("r{i}"), 20), record("x", 5)])
                .await
                .expect("append"),
        );
    }
    // b lags at the 4th group's second record.
    marks.put(5, "b", firsts[3] + 1).await.expect("mark");
    let applied = firsts[9] + 1;
    let trim = |log: &JetStreamLog| {
        let log = log.clone();
        tokio::task::spawn_blocking(move || log.trim(applied))
    };
    let purged = trim(&log).await.expect("thread").expect("trim");
    assert_eq!(
        log.status().first_seq,
        seq_of(firsts[3]),
        "kept from b's group on"
    );
    assert_eq!(purged as u64, seq_of(firsts[3]) - 1);
    let behind = read_valid(&nats, &c, 0).await;
    assert!(
        read_valid(&nats, &c, firsts[3] + 1).await.is_ok(),
        "b can still read on"
    );
    assert!(matches!(behind, Err(LogError::Behind { .. })), "{behind:?}");

    // b's mark stands still past the replica timeout: no longer waited for.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    trim(&log).await.expect("thread").expect("trim");
    assert_eq!(
        log.status().first_seq,
        seq_of(firsts[9]),
        "trimmed to this node's own mark"
    );
    let last = read_valid(&nats, &c, applied - 1).await.expect("read");
    assert_eq!(last.records.len(), 1, "the record past the mark is kept");

    // A log that was stopped (its node hands the partition over) trims nothing.
    let more = append(&log, vec![record("y", 5)]).await.expect("append");
    let kept = log.status().first_seq;
    log.stop();
    let purged = {
        let log = log.clone();
        tokio::task::spawn_blocking(move || log.trim(more))
            .await
            .expect("thread")
            .expect("trim")
    };
    assert_eq!(
        (purged, log.status().first_seq),
        (0, kept),
        "nothing trimmed"
    );
}

/// A full stream refuses a group as a full disk does, with nothing written; the log
/// goes on, and takes groups again once a trim made room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stream_refuses_a_group_with_nothing_written() {
    need_nats!();
    let rig = Rig::start(1).await.expect("rig");
    let nats = rig.connect("a").await.expect("connect");
    let mut c = cfg(6, 1);
    c.max_bytes = 64 * 1024;
    let log = lead(&nats, &c, "a", 0).await.expect("lead").log;
    let mut acked = Vec::new();
    let refused = loop {
        assert!(acked.len() < 100, "a stream of 64 KiB fills");
        match append(&log, vec![record(&format!("r{}", acked.len()), 4000)]).await {
            Ok(first) => acked.push(first),
            Err(e) => break e,
        }
    };
    assert!(refused.is_disk_full(), "refused as a full disk: {refused}");
    let last = log.status().last_seq;
    assert!(!log.is_failed());
    log.heal().expect("nothing to heal");
    let again = append(&log, vec![record("again", 4000)]).await;
    assert!(again.is_err_and(|e| e.is_disk_full()));
    assert_eq!(log.status().last_seq, last, "nothing written");
    let read = read_valid(&nats, &c, 0).await.expect("read");
    assert_eq!(
        read.records.len(),
        acked.len(),
        "only the acknowledged groups"
    );
    // A trim makes room; groups go again.
    let applied = acked[acked.len() - 1];
    let purged = {
        let log = log.clone();
        tokio::task::spawn_blocking(move || log.trim(applied))
            .await
            .expect("thread")
            .expect("trim")
    };
    assert!(purged > 0);
    append(&log, vec![record("after", 4000)])
        .await
        .expect("a group after the trim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_go_out_on_the_stream_leaders_own_connection_and_follow_it_when_it_moves() {
    need_nats!();
    let c = LogConfig {
        follow_leader_every: Duration::from_millis(100),
        ..cfg(40, 3)
    };
    let (rig, probe, leader) = three_with_stream(&c).await;
    let stream = turnd_cluster::log::stream_name(40);
    let at = rig.index_of(&leader).expect("a server of the rig");
    // The main connection on another server than the stream's leader, and one held
    // to each server.
    let nats = rig.connect_to((at + 1) % 3, "w").await.expect("connect");
    let direct = held_to(&rig, &nats, "w", &leader).await;
    let log = lead(&nats, &c, "w", 0).await.expect("lead").log;
    assert_eq!(log.status().appends_on.as_deref(), Some(leader.as_str()));

    let sent = |c: &async_nats::Client| {
        c.statistics()
            .out_messages
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let (direct_before, main_before) = (sent(&direct), sent(nats.client()));
    let n = 20;
    for i in 0..n {
        append(&log, vec![record(&format!("g{i}"), 100)])
            .await
            .expect("append");
    }
    assert!(
        sent(&direct) - direct_before >= n,
        "{} of {n} appends went out on the leader's own connection",
        sent(&direct) - direct_before
    );
    assert!(
        sent(nats.client()) - main_before < n,
        "the main connection carried {} messages for {n} appends",
        sent(nats.client()) - main_before
    );

    // The stream's leader moves: the appends follow it, and every one counts.
    let moved = Rig::move_leader(&probe, &stream, |l| l != leader)
        .await
        .expect("move the leader");
    let mut i = n;
    let mut followed = false;
    for _ in 0..100 {
        append(&log, vec![record(&format!("g{i}"), 100)])
            .await
            .expect("append while the leader moves");
        i += 1;
        if log.status().appends_on.as_deref() == Some(moved.as_str()) {
            followed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        followed,
        "the appends did not follow the stream's leader to {moved} (on {:?})",
        log.status().appends_on
    );
    let read = read_valid(&probe, &c, 0).await.expect("read");
    assert_eq!(read.records.len() as u64, i, "every append counted once");
}
