//! The primitives beside the log, against real servers: the owners' lease (taken
//! once, taken over only when expired or at the revision seen, renewed by
//! revision, handed over at once on release) and the checks that the servers sync
//! before they acknowledge.

use turnd_cluster::checks::check_servers;
use turnd_cluster::lease::{Owner, Owners};
use turnd_cluster::need_nats;
use turnd_cluster::testing::{Rig, RigOptions};

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
    let owners = Owners::open(&nats, 1).await.expect("owners");
    let now = 1_000_000;
    let a = owners
        .acquire(7, owner("a", 0, Some(now + 3000)), now)
        .await
        .expect("acquire")
        .expect("a takes a free partition");
    assert!(
        owners
            .acquire(7, owner("b", 0, Some(now + 3000)), now + 10)
            .await
            .expect("acquire")
            .is_none(),
        "b cannot take a lease that runs"
    );
    // a renews (its epoch now known); the revision moves, and the old one is stale.
    let a2 = owners
        .renew(&a, owner("a", 42, Some(now + 6000)))
        .await
        .expect("renew")
        .expect("a renews its own lease");
    assert!(a2.revision > a.revision);
    assert!(
        owners
            .renew(&a, owner("a", 42, None))
            .await
            .expect("renew")
            .is_none(),
        "a stale revision renews nothing"
    );
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
