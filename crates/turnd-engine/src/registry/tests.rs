use super::*;
use turnd_proto::Delivery;

fn settings() -> FunctionSettings {
    FunctionSettings {
        timeout_ms: 5_000,
        delivery: Delivery::AtLeastOnce,
        max_attempts: 3,
    }
}

#[test]
fn a_function_known_only_from_a_waiting_session_is_listed_as_unregistered() {
    let mut r = Registry::default();
    assert!(r.reserve("ghost", "i_1", &Arc::from("s-1")).is_none());
    let fs = r.functions();
    assert_eq!(fs.len(), 1);
    assert_eq!(fs[0].function_id, "ghost");
    assert!(!fs[0].registered);
    assert_eq!((fs[0].queued, fs[0].workers), (1, 0));

    // A registration (even by a worker that is not connected) makes its settings
    // real, and they stay after the session stops waiting.
    r.register("w-1", "ghost", 2, settings());
    r.not_waiting("s-1");
    let fs = r.functions();
    assert_eq!(fs.len(), 1);
    assert!(fs[0].registered);
    assert_eq!(fs[0].concurrency, 2);
    assert_eq!(fs[0].max_attempts, 3);
}

#[test]
fn what_nothing_refers_to_is_forgotten_after_the_linger() {
    let mut r = Registry::default();
    let (outbox, _rx) = Outbox::new("c_1".into(), 4);
    r.attach("w-1", "w", "i-1", outbox, 1_000);
    r.register("w-1", "f", 1, settings());
    // A session waits for a function nobody registered, then stops waiting.
    r.wait_for("ghost", &Arc::from("s-1"));
    assert_eq!(r.sizes(), (1, 2));
    r.not_waiting("s-1");
    assert_eq!(r.sizes(), (1, 1), "an unregistered function goes at once");
    // Connected: kept however long.
    r.gc(1_000_000, 500);
    assert_eq!(r.sizes(), (1, 1));
    // Gone at 2_000: listed until the linger has passed, with a live invocation
    // keeping the worker.
    let (outbox, _rx2) = Outbox::new("c_2".into(), 4);
    r.attach("w-1", "w", "i-1", outbox, 1_000_500);
    r.register("w-1", "f", 1, settings());
    assert!(r.reserve("f", "inv-1", &Arc::from("s-2")).is_some());
    assert!(r.detach("w-1", "c_2", 1_002_000));
    r.gc(1_002_400, 500);
    assert_eq!(r.sizes(), (1, 1));
    r.gc(1_002_500, 500);
    assert_eq!(
        r.sizes(),
        (1, 0),
        "the function went; the worker holds inv-1"
    );
    r.release("w-1", "inv-1");
    r.gc(1_002_600, 500);
    assert_eq!(r.sizes(), (0, 0));
}

#[test]
fn a_hello_on_a_connection_older_than_the_attached_one_is_stale() {
    let mut r = Registry::default();
    // The worker opened a connection, gave it up before its hello arrived, and
    // attached a second one; the first one's hello comes last.
    let (first, _rx1) = Outbox::new("c_1".into(), 4);
    let (second, _rx2) = Outbox::new("c_2".into(), 4);
    assert!(
        !r.is_stale("w-1", &first),
        "an unknown worker's hello is never stale"
    );
    r.attach("w-1", "w", "i-1", second.clone(), 1_000);
    assert!(r.is_stale("w-1", &first));
    assert!(!r.is_stale("w-1", &second));
    // Still stale once the newer connection ended: the worker moved on from it.
    assert!(r.detach("w-1", "c_2", 2_000));
    assert!(r.is_stale("w-1", &first));
    let (third, _rx3) = Outbox::new("c_3".into(), 4);
    assert!(!r.is_stale("w-1", &third));
}
