//! The primitives beside the log, against real servers: the owners' lease (taken
//! once, taken over only when expired or at the revision seen, renewed by
//! revision, handed over at once on release) and the checks that the servers sync
//! before they acknowledge.

use turnd_cluster::checks::check_servers;
use turnd_cluster::lease::{Lease, Owner, Owners};
use turnd_cluster::need_nats;
use turnd_cluster::testing::{Rig, RigOptions};

/// The time the lease tests run at (their leases' ends are set from it).
const NOW: u64 = 1_000_000;

/// The owners bucket (on `replicas` servers) through `nats`, with partition `p`
/// taken by `a` until `NOW + 3000`.
async fn a_holds(
    nats: &std::sync::Arc<turnd_cluster::Nats>,
    replicas: usize,
    p: u32,
) -> (Owners, Lease) {
    let owners = Owners::open(nats, replicas).await.expect("owners");
    let a = owners
        .acquire(p, owner("a", 0, Some(NOW + 3000)), NOW)
        .await
        .expect("acquire")
        .expect("a takes a free partition");
    (owners, a)
}

fn owner(node: &str, epoch: u64, until_ms: Option<u64>) -> Owner {
    Owner {
        node: node.into(),
        epoch,
        until_ms,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_held_by_one_renewed_by_revision_and_handed_over_on_release() {
    need_nats!();
    let rig = Rig::start(1).await.expect("rig");
    let nats = rig.connect("a").await.expect("connect");
    let (owners, a) = a_holds(&nats, 1, 7).await;
    let now = NOW;
    assert!(
        owners
            .acquire(7, owner("b", 0, Some(now + 3000)), now + 10)
            .await
            .expect("acquire")
            .is_none(),
        "b cannot take a lease that runs"
    );
    // a renews (its epoch now known); the revision moves.
    let a2 = owners
        .renew(&a, owner("a", 42, Some(now + 6000)))
        .await
        .expect("renew")
        .expect("a renews its own lease");
    assert!(a2.revision > a.revision);
    assert_eq!(owners.get(7).await.expect("get"), Some(a2.clone()));
    // Expired by its holder's own time: b takes it over by revision.
    let b = owners
        .acquire(7, owner("b", 0, Some(now + 9000)), now + 6001)
        .await
        .expect("acquire")
        .expect("b takes an expired lease");
    assert!(
        owners
            .renew(&a2, owner("a", 42, Some(now + 9000)))
            .await
            .expect("renew")
            .is_none(),
        "a's renewal fails once b took it"
    );
    // A clean stop hands over at once.
    assert!(owners.release(&b).await.expect("release"));
    assert_eq!(owners.get(7).await.expect("get"), None);
    let c = owners
        .acquire(7, owner("c", 0, None), now + 6002)
        .await
        .expect("acquire")
        .expect("c takes a released lease at once");
    assert!(
        !owners.release(&b).await.expect("release"),
        "b's old revision releases nothing"
    );
    assert_eq!(
        owners.get(7).await.expect("get").map(|l| l.owner.node),
        Some("c".to_string())
    );
    // Taking over at a revision seen unchanged (the observer's own clock judged it).
    let d = owners
        .take(7, owner("d", 0, None), c.revision)
        .await
        .expect("take");
    assert!(d.is_some());
    assert!(owners
        .take(7, owner("e", 0, None), c.revision)
        .await
        .expect("take")
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_that_sync_before_they_acknowledge_pass_and_others_are_refused() {
    need_nats!();
    let safe = Rig::start(3).await.expect("rig");
    let sys = turnd_cluster::nats::connect_one(&safe.sys_url(1))
        .await
        .expect("system account");
    let report = check_servers(&safe.urls(), Some(&sys), false)
        .await
        .expect("proven safe");
    assert_eq!(report.servers.len(), 3);
    assert!(report
        .servers
        .iter()
        .all(|s| s.sync_always == Some(true) && s.version == "2.15.1"));
    assert!(report.unproven.is_empty());
    // Without a system-account connection the sync setting is not proven.
    let unproven = check_servers(&safe.urls(), None, false).await;
    assert!(unproven.is_err_and(|e| e.to_string().contains("sync setting")));
    let allowed = check_servers(&safe.urls(), None, true)
        .await
        .expect("allowed by the unsafe flag");
    assert_eq!(allowed.unproven.len(), 1);
    drop(safe);

    let lazy = Rig::start_with(
        1,
        RigOptions {
            sync_always: false,
            ..RigOptions::default()
        },
    )
    .await
    .expect("rig");
    let sys = turnd_cluster::nats::connect_one(&lazy.sys_url(0))
        .await
        .expect("system account");
    let refused = check_servers(&lazy.urls(), Some(&sys), false).await;
    let e = refused.expect_err("a server that syncs every two minutes is refused");
    assert!(
        e.to_string()
            .contains("does not sync before it acknowledges"),
        "{e}"
    );
    let allowed = check_servers(&lazy.urls(), Some(&sys), true)
        .await
        .expect("allowed by the unsafe flag");
    assert_eq!(allowed.servers[0].sync_always, Some(false));
}

/// A lease request that nobody answers (here: two of three servers paused, so the
/// bucket's stream has no quorum) fails within the connection's control bound, not
/// JetStream's 5 s: a node's loop then tries again at its next round, and gets
/// through within about a round of JetStream's election of a new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_request_nobody_answers_fails_within_the_control_bound() {
    need_nats!();
    let rig = Rig::start(3).await.expect("rig");
    let nats = rig.connect_to(0, "a").await.expect("connect");
    let (owners, a) = a_holds(&nats, 3, 3).await;
    let now = NOW;
    nats.set_control_timeout(std::time::Duration::from_millis(300));
    rig.pause(1);
    rig.pause(2);
    let started = std::time::Instant::now();
    let r = owners.renew(&a, owner("a", 0, Some(now + 6000))).await;
    let took = started.elapsed();
    rig.resume(1);
    rig.resume(2);
    assert!(r.is_err(), "no quorum answers nothing: {r:?}");
    assert!(
        took < std::time::Duration::from_secs(2),
        "the renewal waited {took:?}, past its 300 ms bound"
    );
}

/// A renewal whose answer was lost (not answered within the control bound) but
/// that landed leaves its holder with a stale revision of a key that still names
/// it: it renews from where the key is, rather than lose its lease to itself. A
/// stale revision of the same node in another epoch (another life of it, fenced
/// since) renews nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_whose_answer_was_lost_keeps_the_lease() {
    need_nats!();
    let rig = Rig::start(1).await.expect("rig");
    let nats = rig.connect("a").await.expect("connect");
    let (owners, a) = a_holds(&nats, 1, 5).await;
    let now = NOW;
    let landed = owners
        .renew(&a, owner("a", 42, Some(now + 6000)))
        .await
        .expect("renew")
        .expect("a renews its own lease");
    // Its answer lost: a holds `a` still.
    let again = owners
        .renew(&a, owner("a", 42, Some(now + 6000)))
        .await
        .expect("renew")
        .expect("a's own landed renewal does not lose it its lease");
    assert!(again.revision > landed.revision);
    let other_life = Lease {
        owner: owner("a", 7, None),
        ..a.clone()
    };
    assert!(
        owners
            .renew(&other_life, owner("a", 7, None))
            .await
            .expect("renew")
            .is_none(),
        "a stale revision of another epoch renews nothing"
    );
    assert_eq!(owners.get(5).await.expect("get"), Some(again));
}
