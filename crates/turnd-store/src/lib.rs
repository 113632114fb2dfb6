//! turnd's durable model.
//!
//! Everything turnd promises survives a crash lives here: turns, per-session turn
//! indexes, invocations, events and idempotency keys, in one sled 0.34 keyspace with
//! kind-prefixed keys. Every state transition of the engine is one [`Batch`], applied
//! atomically, and acknowledged only after the group commit that made it durable
//! (sled flush followed by `fdatasync` of sled's files; see [`sled_kv`]).
//!
//! The raw key-value surface is the small [`Kv`] trait so tests can wrap it with
//! faults ([`faulty::FaultyKv`]); [`Store`] is the typed layer the engine uses.

pub mod check;
pub mod faulty;
pub mod keys;
pub mod mem;
pub mod records;
pub mod sled_kv;

use std::sync::Arc;

pub use check::check_store;
pub use records::*;
pub use sled_kv::{SledKv, SyncMode, DEFAULT_CACHE_MB};

use turnd_proto::Event;

/// A storage failure. The engine answers requests whose write failed with
/// `unavailable` and retries internal transitions.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("storage write failed: {0}")]
    Write(String),
    #[error("storage sync failed: {0}")]
    Sync(String),
    #[error("storage read failed: {0}")]
    Read(String),
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    #[error("storage is closed")]
    Closed,
}

/// One key-value operation of a batch.
#[derive(Debug, Clone)]
pub enum KvOp {
    Put(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
}

/// An atomic set of key-value operations: all of it becomes durable, or none.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub ops: Vec<KvOp>,
}

impl Batch {
    pub fn new() -> Self {
        Batch::default()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn put_raw(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.ops.push(KvOp::Put(key, value));
    }

    pub fn delete(&mut self, key: Vec<u8>) {
        self.ops.push(KvOp::Delete(key));
    }

    fn put_json<T: serde::Serialize>(&mut self, key: Vec<u8>, value: &T) {
        // Serializing our own record types cannot fail: they hold no maps with
        // non-string keys and no foreign Serialize impls.
        let bytes = serde_json::to_vec(value).expect("records serialize to JSON");
        self.put_raw(key, bytes);
    }

    /// Write a turn record (and keep its active index in step with its status).
    pub fn put_turn(&mut self, t: &TurnRecord) {
        self.put_turn_record(t);
        self.set_active(t, !t.status.is_terminal());
    }

    /// Write a turn record alone, for a caller that knows its active index entry is
    /// already right (see [`Batch::set_active`]).
    pub fn put_turn_record(&mut self, t: &TurnRecord) {
        self.put_json(keys::turn(&t.turn_id), t);
    }

    /// Add (`active`) or remove the turn's entry in the index of non-terminal turns
    /// that recovery starts from.
    pub fn set_active(&mut self, t: &TurnRecord, active: bool) {
        let key = keys::active(&t.session_id, t.seq);
        if active {
            self.put_raw(key, t.turn_id.as_bytes().to_vec());
        } else {
            self.delete(key);
        }
    }

    /// Add a new turn to its session's list (written once, at admission).
    pub fn put_turn_index(&mut self, t: &TurnRecord) {
        self.put_raw(
            keys::session_turn(&t.session_id, t.seq),
            t.turn_id.as_bytes().to_vec(),
        );
    }

    pub fn put_invocation(&mut self, inv: &InvocationRecord) {
        self.put_json(keys::invocation(&inv.invocation_id), inv);
    }

    pub fn put_event(&mut self, e: &Event) {
        self.put_json(keys::event(&e.session_id, e.seq), e);
    }

    pub fn put_idempotency(&mut self, session_id: &str, key: &str, rec: &IdempotencyRecord) {
        self.put_json(keys::idempotency(session_id, key), rec);
    }

    pub fn put_session_meta(&mut self, m: &SessionMeta) {
        self.put_json(keys::session_meta(&m.session_id), m);
    }
}

/// A key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// The first key after a full page of a scan (the last key with a zero byte appended),
/// or None when the page was the last.
fn next_page(page: &[Entry], limit: usize) -> Option<Vec<u8>> {
    if page.len() < limit {
        return None;
    }
    page.last().map(|(k, _)| {
        let mut next = k.clone();
        next.push(0);
        next
    })
}

/// A pending group commit: resolves once the batch is durable (or failed).
pub type CommitTicket = tokio::sync::oneshot::Receiver<Result<(), StoreError>>;

/// The raw key-value surface of the store.
pub trait Kv: Send + Sync + 'static {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;
    /// Entries with keys in `[start, end)`, ascending (or descending when `reverse`),
    /// at most `limit`.
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError>;
    /// Queue an atomic batch for the next group commit.
    fn commit(&self, batch: Batch) -> CommitTicket;
    /// Make everything committed so far durable (used at shutdown).
    fn sync(&self) -> Result<(), StoreError>;
    /// Commit statistics, for metrics.
    fn commit_stats(&self) -> CommitStats {
        CommitStats::default()
    }
}

/// Counters of the group-commit writer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Group commits (syncs) performed.
    pub syncs: u64,
    /// Batches written.
    pub batches: u64,
    /// Total microseconds spent in apply + sync.
    pub commit_micros: u64,
    /// Of `commit_micros`, the microseconds spent making the writes durable (sled
    /// flush and fdatasync); the rest is applying the batches.
    pub sync_micros: u64,
    /// Largest number of batches that shared one sync.
    pub max_group: u64,
}

/// The typed store the engine uses.
#[derive(Clone)]
pub struct Store {
    kv: Arc<dyn Kv>,
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

impl Store {
    pub fn new(kv: Arc<dyn Kv>) -> Self {
        Store { kv }
    }

    pub fn kv(&self) -> &Arc<dyn Kv> {
        &self.kv
    }

    /// Queue a batch for group commit and wait until it is durable.
    pub async fn commit(&self, batch: Batch) -> Result<(), StoreError> {
        match self.kv.commit(batch).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Closed),
        }
    }

    pub fn sync(&self) -> Result<(), StoreError> {
        self.kv.sync()
    }

    pub fn turn(&self, turn_id: &str) -> Result<Option<TurnRecord>, StoreError> {
        self.kv
            .get(&keys::turn(turn_id))?
            .map(|b| decode("turn", &b))
            .transpose()
    }

    pub fn invocation(&self, invocation_id: &str) -> Result<Option<InvocationRecord>, StoreError> {
        self.kv
            .get(&keys::invocation(invocation_id))?
            .map(|b| decode("invocation", &b))
            .transpose()
    }

    pub fn idempotency(
        &self,
        session_id: &str,
        key: &str,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.kv
            .get(&keys::idempotency(session_id, key))?
            .map(|b| decode("idempotency key", &b))
            .transpose()
    }

    pub fn session_meta(&self, session_id: &str) -> Result<Option<SessionMeta>, StoreError> {
        self.kv
            .get(&keys::session_meta(session_id))?
            .map(|b| decode("session meta", &b))
            .transpose()
    }

    /// Events of a session with `seq > after`, ascending, at most `limit`.
    pub fn events(
        &self,
        session_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let start = keys::event(session_id, after.saturating_add(1));
        let end = keys::event_end(session_id);
        self.kv
            .scan(&start, &end, false, limit)?
            .iter()
            .map(|(_, v)| decode("event", v))
            .collect()
    }

    /// Turn ids of a session with `seq < before`, newest first, at most `limit`.
    pub fn session_turn_ids(
        &self,
        session_id: &str,
        before: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let start = keys::session_turn(session_id, 0);
        let end = keys::session_turn(session_id, before);
        self.kv
            .scan(&start, &end, true, limit)?
            .into_iter()
            .map(|(k, v)| {
                let seq = keys::seq_suffix(&k)?;
                let id = String::from_utf8(v)
                    .map_err(|e| StoreError::Corrupt(format!("turn index: {e}")))?;
                Ok((seq, id))
            })
            .collect()
    }

    /// Up to `limit` session metas with keys from `from` on (start with
    /// [`Store::FIRST`]), and where the next page starts (None: no more).
    pub fn session_metas_page(
        &self,
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<SessionMeta>, Option<Vec<u8>>), StoreError> {
        let (page, next) = self.page(keys::session_meta_range(), from, limit)?;
        let metas = page
            .iter()
            .map(|(_, v)| decode("session meta", v))
            .collect::<Result<_, _>>()?;
        Ok((metas, next))
    }

    /// Up to `limit` ids of non-terminal turns (grouped by session in admission order)
    /// with index keys from `from` on (start with [`Store::FIRST`]), and where the next
    /// page starts (None: no more).
    pub fn active_turn_ids_page(
        &self,
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<String>, Option<Vec<u8>>), StoreError> {
        let (page, next) = self.page(keys::active_range(), from, limit)?;
        let ids = page
            .into_iter()
            .map(|(k, v)| {
                String::from_utf8(v)
                    .map_err(|e| StoreError::Corrupt(format!("active index {k:?}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok((ids, next))
    }

    /// Where a paged scan starts.
    pub const FIRST: &'static [u8] = &[];

    /// Up to `limit` entries of `range` with keys from `from` on ([`Store::FIRST`]:
    /// the range's start), and where the next page starts (None: no more).
    fn page(
        &self,
        (start, end): (Vec<u8>, Vec<u8>),
        from: &[u8],
        limit: usize,
    ) -> Result<(Vec<Entry>, Option<Vec<u8>>), StoreError> {
        let from = if from.is_empty() { &start[..] } else { from };
        let page = self.kv.scan(from, &end, false, limit)?;
        let next = next_page(&page, limit);
        Ok((page, next))
    }

    /// All session metas (used by the checker and for listing).
    pub fn session_metas(&self) -> Result<Vec<SessionMeta>, StoreError> {
        let (start, end) = keys::session_meta_range();
        self.kv
            .scan(&start, &end, false, usize::MAX)?
            .iter()
            .map(|(_, v)| decode("session meta", v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn paged_scans_visit_every_entry_once_in_key_order() {
        let store = Store::new(Arc::new(mem::MemKv::new()));
        let mut b = Batch::new();
        let ids: Vec<String> = (0..10).map(|i| format!("s{i:02}")).collect();
        for id in &ids {
            b.put_session_meta(&SessionMeta::new(id));
            // Two active turns per session, so pages end inside a session too.
            for seq in 1..=2u64 {
                b.put_raw(keys::active(id, seq), format!("t-{id}-{seq}").into_bytes());
            }
        }
        store.commit(b).await.expect("commit");

        for limit in [1, 3, 10, 50] {
            let mut seen = Vec::new();
            let mut from = Store::FIRST.to_vec();
            for round in 0.. {
                assert!(round <= 60, "metas: pages of {limit} do not end");
                let (page, next) = store.session_metas_page(&from, limit).expect("page");
                assert!(page.len() <= limit);
                seen.extend(page.into_iter().map(|m| m.session_id));
                match next {
                    Some(n) => from = n,
                    None => break,
                }
            }
            assert_eq!(seen, ids, "metas with pages of {limit}");

            let mut turns = Vec::new();
            let mut from = Store::FIRST.to_vec();
            for round in 0.. {
                assert!(round <= 60, "active index: pages of {limit} do not end");
                let (page, next) = store.active_turn_ids_page(&from, limit).expect("page");
                turns.extend(page);
                match next {
                    Some(n) => from = n,
                    None => break,
                }
            }
            let want: Vec<String> = ids
                .iter()
                .flat_map(|id| [format!("t-{id}-1"), format!("t-{id}-2")])
                .collect();
            assert_eq!(turns, want, "active index with pages of {limit}");
        }
    }
}
