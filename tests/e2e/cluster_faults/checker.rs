//! The history checker: what the callers were told (every acknowledged
//! `turn.submit`, in each session's order), what the worker ran (the start and end
//! of every invocation, with its session), and what the cluster holds afterwards
//! (each turn through `turn.get`, each session's events through `session.events`,
//! `store.check`), held against the promises: no acknowledged turn lost, every turn
//! terminal, turns of a session admitted and finished in order, one step of a
//! session in flight at a time. The first violation found is the answer, named
//! with what shows it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use turnd_client::Caller;
use turnd_proto::{Event, EventKind, Turn};

/// One acknowledged `turn.submit`.
#[derive(Debug, Clone)]
pub struct Acked {
    pub session: String,
    pub turn_id: String,
    pub key: String,
    /// The turn's seq in its session, as the acknowledgement gave it.
    pub seq: u64,
}

/// One invocation as the worker ran it.
#[derive(Debug, Clone)]
pub struct Run {
    pub session: String,
    pub turn_id: String,
    pub invocation_id: String,
    pub start: Instant,
    pub end: Instant,
}

/// What a run recorded: filled by the callers and the worker while the faults go on.
#[derive(Default, Clone)]
pub struct History {
    /// Each session's acknowledged submits, in the order they were acknowledged
    /// (one caller per session, one submit at a time: the order they were sent).
    pub acked: Arc<Mutex<BTreeMap<String, Vec<Acked>>>>,
    pub runs: Arc<Mutex<Vec<Run>>>,
}

/// The first promise a history breaks.
pub type Violation = String;

impl History {
    pub fn ack(&self, a: Acked) {
        if let Ok(mut m) = self.acked.lock() {
            m.entry(a.session.clone()).or_default().push(a);
        }
    }

    pub fn ran(&self, r: Run) {
        if let Ok(mut v) = self.runs.lock() {
            v.push(r);
        }
    }

    pub fn acked(&self) -> BTreeMap<String, Vec<Acked>> {
        self.acked.lock().map(|m| m.clone()).unwrap_or_default()
    }

    pub fn runs(&self) -> Vec<Run> {
        self.runs.lock().map(|v| v.clone()).unwrap_or_default()
    }

    pub fn count(&self) -> usize {
        self.acked().values().map(Vec::len).sum()
    }
}

/// Each session's acknowledgements: the seqs grow in the order the submits were
/// sent (a resubmit with the same key answered the same turn, so same seq).
pub fn check_admission(acked: &BTreeMap<String, Vec<Acked>>) -> Result<(), Violation> {
    for (session, list) in acked {
        for w in list.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            let same = a.key == b.key && a.turn_id == b.turn_id;
            if !same && b.seq <= a.seq {
                return Err(format!(
                    "session {session}: submit {} acknowledged seq {} after submit {} got seq {} \
                     (admission out of order)",
                    b.key, b.seq, a.key, a.seq
                ));
            }
            if a.key == b.key && a.turn_id != b.turn_id {
                return Err(format!(
                    "session {session}: key {} answered two turns, {} and {}",
                    a.key, a.turn_id, b.turn_id
                ));
            }
        }
    }
    Ok(())
}

/// Every acknowledged turn as the cluster holds it now (`turns`, read by the
/// caller): present, the same session and seq, terminal.
pub fn check_turns(
    acked: &BTreeMap<String, Vec<Acked>>,
    turns: &HashMap<String, Option<Turn>>,
) -> Result<(), Violation> {
    for a in acked.values().flatten() {
        let Some(Some(t)) = turns.get(&a.turn_id) else {
            return Err(format!(
                "acknowledged turn {} (session {}, key {}, seq {}) is lost: turn.get finds nothing",
                a.turn_id, a.session, a.key, a.seq
            ));
        };
        if t.session_id != a.session || t.seq != a.seq {
            return Err(format!(
                "turn {} was acknowledged as session {} seq {}, the cluster holds session {} seq {}",
                a.turn_id, a.session, a.seq, t.session_id, t.seq
            ));
        }
        if !t.status.is_terminal() {
            return Err(format!(
                "turn {} (session {}, seq {}) is not terminal: {:?}",
                a.turn_id, a.session, a.seq, t.status
            ));
        }
    }
    Ok(())
}

/// Where a turn's life shows in its session's events.
#[derive(Debug, Default, Clone, Copy)]
struct Life {
    seq: u64,
    admitted: Option<u64>,
    first_dispatch: Option<u64>,
    last_dispatch: Option<u64>,
    terminal: Option<u64>,
}

/// One session's events (`events`, in the session's order) against its
/// acknowledged turns: each admitted; the turns, taken by seq, each dispatched only
/// after the one before it ended, and ended in that order.
pub fn check_events(
    session: &str,
    acked: &[Acked],
    events: &[Event],
    seqs: &HashMap<String, u64>,
) -> Result<(), Violation> {
    let mut lives: HashMap<&str, Life> = HashMap::new();
    let mut last_event = 0;
    for e in events {
        if e.seq <= last_event {
            return Err(format!(
                "session {session}: event seq {} after {last_event} (events out of order)",
                e.seq
            ));
        }
        last_event = e.seq;
        let l = lives.entry(e.turn_id.as_str()).or_default();
        l.seq = seqs.get(&e.turn_id).copied().unwrap_or(u64::MAX);
        match e.kind {
            EventKind::Admitted => l.admitted = l.admitted.or(Some(e.seq)),
            EventKind::Dispatched | EventKind::Redispatched => {
                l.first_dispatch = l.first_dispatch.or(Some(e.seq));
                l.last_dispatch = Some(e.seq);
            }
            EventKind::Completed | EventKind::Failed | EventKind::Cancelled => {
                if let Some(t) = l.terminal {
                    return Err(format!(
                        "session {session}: turn {} ended twice (events {t} and {})",
                        e.turn_id, e.seq
                    ));
                }
                l.terminal = Some(e.seq);
            }
            _ => {}
        }
    }
    for a in acked {
        if lives
            .get(a.turn_id.as_str())
            .and_then(|l| l.admitted)
            .is_none()
        {
            return Err(format!(
                "session {session}: acknowledged turn {} (seq {}) has no admitted event",
                a.turn_id, a.seq
            ));
        }
    }
    let mut by_seq: Vec<(&str, Life)> = lives.into_iter().collect();
    by_seq.sort_by_key(|(_, l)| l.seq);
    for w in by_seq.windows(2) {
        let ((ta, a), (tb, b)) = (w[0], w[1]);
        let (Some(end_a), Some(end_b)) = (a.terminal, b.terminal) else {
            continue;
        };
        if end_b < end_a {
            return Err(format!(
                "session {session}: turn {tb} (seq {}) ended at event {end_b}, before turn {ta} \
                 (seq {}) ended at event {end_a} (FIFO broken)",
                b.seq, a.seq
            ));
        }
        if let Some(d) = b.first_dispatch {
            if d < end_a {
                return Err(format!(
                    "session {session}: turn {tb} (seq {}) dispatched at event {d} while turn {ta} \
                     (seq {}) ran until event {end_a} (two steps in flight)",
                    b.seq, a.seq
                ));
            }
        }
    }
    Ok(())
}

/// The worker's side: no two invocations of different turns of one session ran at
/// once, and a session's turns ran in seq order (a turn's later attempts aside).
pub fn check_runs(runs: &[Run], seqs: &HashMap<String, u64>) -> Result<(), Violation> {
    let mut by_session: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_session.entry(r.session.as_str()).or_default().push(r);
    }
    for (session, mut rs) in by_session {
        rs.sort_by_key(|r| r.start);
        let mut latest: Option<&Run> = None;
        for r in rs {
            if let Some(p) = latest {
                if p.turn_id != r.turn_id && r.start < p.end {
                    return Err(format!(
                        "session {session}: invocation {} of turn {} started while invocation {} \
                         of turn {} still ran on the worker (two steps in flight)",
                        r.invocation_id, r.turn_id, p.invocation_id, p.turn_id
                    ));
                }
                let (sp, sr) = (seqs.get(&p.turn_id), seqs.get(&r.turn_id));
                if let (Some(sp), Some(sr)) = (sp, sr) {
                    if sr < sp {
                        return Err(format!(
                            "session {session}: turn {} (seq {sr}) ran after turn {} (seq {sp})",
                            r.turn_id, p.turn_id
                        ));
                    }
                }
            }
            if latest.is_none_or(|p| r.end > p.end) {
                latest = Some(r);
            }
        }
    }
    Ok(())
}

/// Read what the cluster holds of every acknowledged turn and every session
/// through `caller`, and check all of it: the first violation, or the number of
/// turns checked.
pub async fn check_cluster(
    h: &History,
    caller: &Caller,
) -> anyhow::Result<Result<usize, Violation>> {
    let acked = h.acked();
    if let Err(v) = check_admission(&acked) {
        return Ok(Err(v));
    }
    let mut turns = HashMap::new();
    for a in acked.values().flatten() {
        let t = match caller.get(&a.turn_id).await {
            Ok(t) => Some(t),
            Err(e) if e.code() == Some(turnd_proto::ErrorCode::NotFound) => None,
            Err(e) => return Err(e.into()),
        };
        turns.insert(a.turn_id.clone(), t);
    }
    if let Err(v) = check_turns(&acked, &turns) {
        return Ok(Err(v));
    }
    let mut seqs: HashMap<String, u64> = HashMap::new();
    for (session, list) in &acked {
        let events = turnd_tests::all_events(caller, session).await?;
        for e in &events {
            if !seqs.contains_key(&e.turn_id) {
                let t = caller.get(&e.turn_id).await?;
                seqs.insert(e.turn_id.clone(), t.seq);
            }
        }
        if let Err(v) = check_events(session, list, &events, &seqs) {
            return Ok(Err(v));
        }
    }
    if let Err(v) = check_runs(&h.runs(), &seqs) {
        return Ok(Err(v));
    }
    Ok(Ok(turns.len()))
}

#[cfg(test)]
mod tests {
    //! The checker catches what it is for: each kind of violation, planted.

    use super::*;
    use std::time::Duration;

    fn acked(session: &str, turn: &str, key: &str, seq: u64) -> Acked {
        Acked {
            session: session.into(),
            turn_id: turn.into(),
            key: key.into(),
            seq,
        }
    }

    fn ev(seq: u64, turn: &str, kind: EventKind) -> Event {
        Event {
            seq,
            session_id: "s".into(),
            turn_id: turn.into(),
            at_ms: seq,
            kind,
            detail: serde_json::Value::Null,
        }
    }

    #[test]
    fn admission_out_of_order_is_found() {
        let mut m = BTreeMap::new();
        m.insert(
            "s".to_string(),
            vec![acked("s", "t1", "k1", 2), acked("s", "t2", "k2", 1)],
        );
        let v = check_admission(&m).unwrap_err();
        assert!(v.contains("admission out of order"), "{v}");
        m.insert(
            "s".to_string(),
            vec![acked("s", "t1", "k1", 1), acked("s", "t2", "k2", 2)],
        );
        assert!(check_admission(&m).is_ok());
    }

    #[test]
    fn two_steps_in_flight_and_fifo_are_found_in_events() {
        let a = [acked("s", "t1", "k1", 1), acked("s", "t2", "k2", 2)];
        let seqs: HashMap<String, u64> = [("t1".to_string(), 1), ("t2".to_string(), 2)].into();
        use EventKind::*;
        let good = [
            ev(1, "t1", Admitted),
            ev(2, "t2", Admitted),
            ev(3, "t1", Dispatched),
            ev(4, "t1", Completed),
            ev(5, "t2", Dispatched),
            ev(6, "t2", Completed),
        ];
        assert!(check_events("s", &a, &good, &seqs).is_ok());
        let overlap = [
            ev(1, "t1", Admitted),
            ev(2, "t2", Admitted),
            ev(3, "t1", Dispatched),
            ev(4, "t2", Dispatched),
            ev(5, "t1", Completed),
            ev(6, "t2", Completed),
        ];
        let v = check_events("s", &a, &overlap, &seqs).unwrap_err();
        assert!(v.contains("two steps in flight"), "{v}");
        let reversed = [
            ev(1, "t1", Admitted),
            ev(2, "t2", Admitted),
            ev(3, "t2", Completed),
            ev(4, "t1", Completed),
        ];
        let v = check_events("s", &a, &reversed, &seqs).unwrap_err();
        assert!(v.contains("FIFO broken"), "{v}");
        let v = check_events("s", &a, &good[2..], &seqs).unwrap_err();
        assert!(v.contains("no admitted event"), "{v}");
    }

    #[test]
    fn lost_turns_are_found() {
        let mut m = BTreeMap::new();
        m.insert("s".to_string(), vec![acked("s", "t1", "k1", 1)]);
        let v = check_turns(&m, &HashMap::new()).unwrap_err();
        assert!(v.contains("is lost"), "{v}");
    }

    #[test]
    fn overlapping_runs_are_found() {
        let t0 = Instant::now();
        let run = |turn: &str, from: u64, to: u64| Run {
            session: "s".into(),
            turn_id: turn.into(),
            invocation_id: format!("i-{turn}-{from}"),
            start: t0 + Duration::from_millis(from),
            end: t0 + Duration::from_millis(to),
        };
        let seqs: HashMap<String, u64> = [("t1".to_string(), 1), ("t2".to_string(), 2)].into();
        assert!(check_runs(&[run("t1", 0, 10), run("t2", 10, 20)], &seqs).is_ok());
        let v = check_runs(&[run("t1", 0, 10), run("t2", 5, 20)], &seqs).unwrap_err();
        assert!(v.contains("two steps in flight"), "{v}");
        let v = check_runs(&[run("t2", 0, 10), run("t1", 10, 20)], &seqs).unwrap_err();
        assert!(v.contains("ran after"), "{v}");
        // A turn's later attempt overlapping its own earlier one is not a violation here.
        assert!(check_runs(&[run("t1", 0, 10), run("t1", 5, 20)], &seqs).is_ok());
    }
}
