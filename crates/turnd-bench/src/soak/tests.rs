//! The soak's own tests: the filler, the daemon's slow-sync lines, what held up an
//! interval.

use std::time::Duration;

use serde_json::json;

use super::daemon::slow_sync;
use super::filled;
use super::report::held_in;
use crate::machine::{Seen, Span, ThreadSpan};

#[test]
fn a_random_filler_is_fresh_letters_and_digits_of_the_size_asked() {
    let a = filled(3, "xx", true, 64);
    let b = filled(3, "xx", true, 64);
    let pad = a["pad"].as_str().expect("pad");
    assert_eq!(pad.len(), 64);
    assert!(pad.bytes().all(|c| c.is_ascii_alphanumeric()), "{pad}");
    assert_ne!(a["pad"], b["pad"]);
    assert_eq!(a["reverse_pad"], true);
    assert_eq!(filled(3, "xx", false, 64), json!({"i": 3, "pad": "xx"}));
}

#[test]
fn a_slow_sync_line_gives_its_span_and_other_lines_nothing() {
    let line = "2026-12-04T20:52:53.952907Z  WARN turnd_store::logged: the commit log's write and fdatasync took 120 ms; every commit waited for the disk took_ms=120 batches=93 bytes=184517";
    let s = slow_sync(line).expect("a slow sync");
    assert!((s.ms - 120.0).abs() < 1e-9, "{s:?}");
    assert!((s.end - 1_796_417_573.952_907).abs() < 1e-3, "{s:?}");
    assert!((s.end - s.start - 0.120).abs() < 1e-6, "{s:?}");
    let other = "2026-12-04T20:52:21.221972Z DEBUG turnd_store::logged: made the commit log's next segment ahead of need";
    assert!(slow_sync(other).is_none());
    assert!(slow_sync("no time turnd_store::logged: took_ms=5").is_none());
}

#[test]
fn an_interval_lists_the_syncs_that_overlap_it_and_their_share() {
    let span = |start: f64, ms: f64| Span {
        start,
        end: start + ms / 1000.0,
        ms,
    };
    let syncs = [span(10.000, 95.0), span(10.095, 35.0), span(20.0, 50.0)];
    let quiet = Seen {
        late_wakeups: vec![],
        steal: vec![],
        dirty_kb: vec![],
        waits: vec![],
        ran: vec![],
        blocked: vec![],
    };
    assert_eq!(
        held_in(&syncs, &quiet, 10.0, Duration::from_millis(135)),
        "commit log syncs of 95 + 35 ms in it, covering 96 %"
    );
    assert_eq!(
        held_in(&syncs, &quiet, 15.0, Duration::from_millis(40)),
        "no commit log sync of 10 ms or more in it"
    );
    let threads = |samples: &[(&str, f64, f64)]| -> Vec<ThreadSpan> {
        samples
            .iter()
            .map(|&(who, start, ms)| ThreadSpan {
                span: Span {
                    start,
                    end: start + 0.01,
                    ms,
                },
                who: who.into(),
            })
            .collect()
    };
    let held = Seen {
        late_wakeups: vec![span(15.005, 30.0)],
        steal: vec![span(14.99, 20.0), span(15.01, 10.0), span(16.0, 10.0)],
        dirty_kb: vec![],
        waits: threads(&[
            ("turnd/turnd-log", 15.0, 4.0),
            ("bench/tokio-runtime-w", 15.01, 9.0),
            ("turnd/turnd-log", 15.02, 8.0),
            ("turnd/turnd-apply", 15.2, 30.0),
        ]),
        ran: threads(&[
            ("turnd/tokio-rt-worker", 15.0, 10.0),
            ("turnd/tokio-rt-worker", 15.01, 10.0),
            ("turnd/turnd-store-app", 15.02, 4.0),
            ("turnd/tokio-rt-worker", 15.3, 10.0),
        ]),
        blocked: threads(&[
            ("turnd/turnd-log-write", 15.0, 10.0),
            ("turnd/turnd-log-write", 15.01, 10.0),
            ("turnd/turnd-store-app", 15.02, 10.0),
        ])
        .into_iter()
        .zip([
            "jbd2_log_wait_commit",
            "jbd2_log_wait_commit",
            "folio_wait_bit",
        ])
        .map(|(at, wchan)| crate::machine::Blocked {
            at,
            wchan: wchan.into(),
        })
        .collect(),
    };
    assert_eq!(
        held_in(&syncs, &held, 15.0, Duration::from_millis(40)),
        "no commit log sync of 10 ms or more in it; a sleeping thread woke 30 ms late, \
         covering 75 %; waited for a core in the samples over it: turnd/turnd-log 12 ms, \
         bench/tokio-runtime-w 9 ms; ran in the samples over it: turnd/tokio-rt-worker \
         20 ms, turnd/turnd-store-app 4 ms; in uninterruptible sleep in the samples over \
         it: turnd/turnd-log-write in jbd2_log_wait_commit 20 ms, turnd/turnd-store-app \
         in folio_wait_bit 10 ms; steal of 30 ms in the samples over it"
    );
}
