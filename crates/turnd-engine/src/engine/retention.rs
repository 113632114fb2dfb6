//! Retention: terminal turns older than `retention_terminal_ms` are deleted.
//!
//! A sweep runs every `retention_sweep_interval_ms`. It reads the turn records in key
//! order (turn ids are UUIDv7, so oldest first) and stops at the first turn created
//! after the cutoff (`now - retention_terminal_ms`): a turn cannot have finished
//! before it was created. Every terminal turn among them whose `finished_at_ms` is at
//! or before the cutoff is deleted under its session's lock, in one durable batch per
//! session, with everything that belongs to it alone:
//!
//! - its record, its input stored apart, its place in the session's turn list;
//! - its idempotency key (when it still names this turn), so the key can be used
//!   again;
//! - its invocations (the last one from the record, the others from the `dispatched`
//!   events being deleted);
//! - its events: the session's stored event values are read from the first up to the
//!   first value written after the cutoff; a value whose events all belong to turns
//!   that are gone is deleted, one that mixes them with events of turns that remain
//!   is written again with the remaining events only.
//!
//! The session meta's counts drop by the deleted turns. A session left with no turn at
//! all, no unfinished work, no watcher and no timer is forgotten: its meta and every
//! remaining event value are deleted and its cell leaves memory, so `session.inspect`
//! answers `not_found`, and a later submit starts it again from `seq` 1. Unfinished
//! turns are never deleted, however old.
//!
//! A sweep is a run of ordinary commits through the group commit: it never holds a
//! session's lock across more than that session's own batch, and never pauses other
//! commits.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use turnd_proto::{Event, EventKind};
use turnd_store::{keys, Batch, SessionMeta, Store, StoreError};

use super::{Engine, SessionCell};

/// Turn records read per page of a sweep.
const TURN_PAGE: usize = 512;
/// Event values read per page of a session's event scan.
const EVENT_PAGE: usize = 64;

impl Engine {
    /// Start the sweep task (nothing when retention is off).
    pub(super) fn spawn_retention(&self) {
        let cfg = &self.inner.cfg;
        if cfg.retention_terminal_ms == 0 {
            return;
        }
        let every = Duration::from_millis(cfg.retention_sweep_interval_ms.max(1));
        let weak = Arc::downgrade(&self.inner);
        let shutdown = self.inner.shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = shutdown.cancelled() => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                let engine = Engine { inner };
                match engine.sweep().await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!("retention deleted {n} terminal turns"),
                    Err(e) => {
                        tracing::warn!("retention sweep failed (tried again at the next one): {e}")
                    }
                }
            }
        });
    }

    /// One sweep: delete every terminal turn that finished `retention_terminal_ms` or
    /// more ago. Returns how many turns it deleted.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let keep = self.inner.cfg.retention_terminal_ms;
        if keep == 0 {
            return Ok(0);
        }
        let cutoff = self.now_ms().saturating_sub(keep);
        let mut from = Store::FIRST.to_vec();
        let mut deleted = 0;
        loop {
            let (page, next) = self.inner.store.turns_page(&from, TURN_PAGE)?;
            let mut by_session: BTreeMap<String, Vec<String>> = BTreeMap::new();
            let mut past_cutoff = false;
            for t in page {
                if t.created_at_ms > cutoff {
                    past_cutoff = true;
                    break;
                }
                if t.status.is_terminal() && t.finished_at_ms.is_some_and(|f| f <= cutoff) {
                    by_session.entry(t.session_id).or_default().push(t.turn_id);
                }
            }
            for (sid, turns) in by_session {
                deleted += self.expire(&sid, &turns, cutoff).await?;
            }
            match next {
                Some(n) if !past_cutoff => from = n,
                _ => break,
            }
        }
        Ok(deleted)
    }

    /// Delete the expired turns among `turn_ids` of one session (see the module doc).
    async fn expire(&self, sid: &str, turn_ids: &[String], cutoff: u64) -> Result<u64, StoreError> {
        let cell = self.cell(sid);
        let mut st = self.lock(&cell).await?;
        let store = &self.inner.store;
        let kv = store.kv();
        let mut b = Batch::new();
        let mut gone: HashSet<String> = HashSet::new();
        let mut gone_statuses = Vec::new();
        for id in turn_ids {
            // The record under the lock is the truth (a late result may have
            // amended it since the page was read).
            let Some(t) = store.turn_record(id)? else {
                continue;
            };
            if !(t.status.is_terminal() && t.finished_at_ms.is_some_and(|f| f <= cutoff)) {
                continue;
            }
            b.delete(keys::turn(id));
            b.delete(keys::turn_input(id));
            b.delete(keys::session_turn(sid, t.seq));
            if let Some(k) = &t.idempotency_key {
                if store
                    .idempotency(sid, k)?
                    .is_some_and(|r| r.turn_id == t.turn_id)
                {
                    b.delete(keys::idempotency(sid, k));
                }
            }
            if let Some(inv) = &t.invocation_id {
                b.delete(keys::invocation(inv));
            }
            gone_statuses.push(t.status);
            gone.insert(t.turn_id);
        }
        if gone.is_empty() {
            return Ok(0);
        }

        // Events: read up to the first value written after the cutoff.
        let live: HashSet<&str> = st.active.iter().map(|t| t.turn_id.as_str()).collect();
        let mut exists: HashMap<String, bool> = HashMap::new();
        let mut is_gone = |e: &Event| -> Result<bool, StoreError> {
            if gone.contains(&e.turn_id) {
                return Ok(true);
            }
            if live.contains(e.turn_id.as_str()) {
                return Ok(false);
            }
            if let Some(known) = exists.get(&e.turn_id) {
                return Ok(!known);
            }
            let found = kv.get(&keys::turn(&e.turn_id))?.is_some();
            exists.insert(e.turn_id.clone(), found);
            Ok(!found)
        };
        let mut pruned = false;
        let mut from: Option<Vec<u8>> = None;
        'scan: loop {
            let (values, next) = store.event_values_page(sid, from.as_deref(), EVENT_PAGE)?;
            for (key, events) in values {
                if events.first().is_some_and(|e| e.at_ms > cutoff) {
                    break 'scan;
                }
                let mut dead = Vec::new();
                let mut kept = Vec::new();
                for e in events {
                    if is_gone(&e)? {
                        dead.push(e);
                    } else {
                        kept.push(e);
                    }
                }
                if dead.is_empty() {
                    continue;
                }
                for e in &dead {
                    if e.kind == EventKind::Dispatched {
                        if let Some(inv) = e.detail.get("invocation_id").and_then(Value::as_str) {
                            b.delete(keys::invocation(inv));
                        }
                    }
                }
                pruned = true;
                b.delete(key);
                // Keyed by the last kept event; written after the delete, so it wins
                // when that is the same key.
                b.put_events(&kept);
            }
            match next {
                Some(n) => from = Some(n),
                None => break,
            }
        }

        let mut counts = st.meta.counts.clone();
        for s in &gone_statuses {
            let c = counts.get_mut(*s);
            *c = c.saturating_sub(1);
        }
        let left =
            counts.queued + counts.running + counts.completed + counts.failed + counts.cancelled;
        let forget = left == 0
            && st.active.len() == 0
            && st.pending.is_none()
            && st.timer.is_none()
            && !self.watched(sid);
        if forget {
            let mut from: Option<Vec<u8>> = None;
            loop {
                let (values, next) = store.event_values_page(sid, from.as_deref(), EVENT_PAGE)?;
                for (key, _) in values {
                    b.delete(key);
                }
                match next {
                    Some(n) => from = Some(n),
                    None => break,
                }
            }
            b.delete(keys::session_meta(sid));
        } else {
            let mut meta = st.meta.clone();
            meta.counts = counts.clone();
            meta.events_pruned |= pruned;
            b.put_session_meta(&meta);
        }
        store.commit(b).await?;
        self.inner
            .counters
            .turns_expired
            .fetch_add(gone.len() as u64, std::sync::atomic::Ordering::Relaxed);

        if forget {
            st.meta = SessionMeta::new(sid);
        } else {
            st.meta.counts = counts;
            st.meta.events_pruned |= pruned;
        }
        if let Ok(mut c) = self.inner.counts.lock() {
            for s in &gone_statuses {
                let n = c.get_mut(*s);
                *n = n.saturating_sub(1);
            }
        }
        drop(st);
        if forget {
            self.evict(sid, &cell);
        }
        Ok(gone.len() as u64)
    }

    fn watched(&self, sid: &str) -> bool {
        self.inner
            .watches
            .lock()
            .map(|w| w.get(sid).is_some_and(|v| !v.is_empty()))
            .unwrap_or(true)
    }

    /// Drop a forgotten session's cell from memory, unless someone else holds it
    /// (they would go on with a cell the map no longer knows while a new one could be
    /// made for the same session). The check and the removal happen under the map's
    /// lock, under which every other holder got its reference.
    fn evict(&self, sid: &str, cell: &Arc<SessionCell>) {
        let mut m = self
            .inner
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let ours = m.get(sid).is_some_and(|c| Arc::ptr_eq(c, cell));
        // The map's reference and the caller's.
        if ours && Arc::strong_count(cell) == 2 {
            m.remove(sid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineConfig;
    use serde_json::json;
    use turnd_proto::{ListArgs, SubmitArgs, TurnStatus};

    fn submit(session: &str, key: Option<&str>) -> SubmitArgs {
        SubmitArgs {
            session_id: session.into(),
            function_id: "f".into(),
            input: json!({"n": 1}),
            idempotency_key: key.map(str::to_string),
            turn_timeout_ms: None,
        }
    }

    async fn engine(terminal_ms: u64) -> Engine {
        let kv = Arc::new(turnd_store::mem::MemKv::new());
        let cfg = EngineConfig {
            retention_terminal_ms: terminal_ms,
            retention_sweep_interval_ms: 3_600_000,
            ..EngineConfig::default()
        };
        Engine::open(Store::new(kv), cfg).await.expect("open")
    }

    /// Turns stopped while queued end at once, with no worker: terminal turns to
    /// expire. Everything of an expired turn goes, the unfinished one stays, and a
    /// session with no turns left is forgotten.
    #[tokio::test(start_paused = true)]
    async fn a_sweep_deletes_expired_turns_and_forgets_empty_sessions() {
        let e = engine(10_000).await;
        let old = e.submit(submit("s", Some("k1"))).await.expect("submit");
        let gone = e.submit(submit("gone", None)).await.expect("submit");
        e.stop_turn(&old.turn.turn_id, None).await.expect("stop");
        e.stop_turn(&gone.turn.turn_id, None).await.expect("stop");
        let kept = e.submit(submit("s", None)).await.expect("submit");
        assert_eq!(
            e.sweep().await.expect("sweep"),
            0,
            "nothing is old enough yet"
        );
        tokio::time::advance(Duration::from_millis(10_001)).await;
        assert_eq!(e.sweep().await.expect("sweep"), 2);

        let store = &e.inner.store;
        assert!(store.turn(&old.turn.turn_id).expect("read").is_none());
        assert!(store.idempotency("s", "k1").expect("read").is_none());
        let listed = e
            .list_turns(ListArgs {
                session_id: "s".into(),
                status: None,
                limit: None,
                before_seq: None,
            })
            .await
            .expect("list");
        let ids: Vec<&str> = listed.turns.iter().map(|t| t.turn_id.as_str()).collect();
        assert_eq!(ids, vec![kept.turn.turn_id.as_str()]);
        assert_eq!(listed.turns[0].status, TurnStatus::Queued);
        let s = e.inspect("s").await.expect("inspect");
        assert_eq!((s.turns.cancelled, s.turns.queued), (0, 1));
        let events = store.events("s", 0, usize::MAX).expect("events");
        assert!(
            events.iter().all(|ev| ev.turn_id == kept.turn.turn_id),
            "{events:?}"
        );
        assert!(!events.is_empty());

        // The session with nothing left is forgotten, in the store and in memory.
        assert!(store.session_meta("gone").expect("read").is_none());
        assert!(e.existing_cell("gone").is_none());
        assert!(e.inspect("gone").await.is_err());
        // Its id and the freed key can be used again.
        let again = e.submit(submit("gone", None)).await.expect("submit");
        assert_eq!(again.turn.seq, 1);
        let reused = e.submit(submit("s", Some("k1"))).await.expect("submit");
        assert!(!reused.deduplicated);
        assert_ne!(reused.turn.turn_id, old.turn.turn_id);
    }
}
