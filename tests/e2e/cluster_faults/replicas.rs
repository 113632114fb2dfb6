//! All replicas of a partition equal: once every node stopped, each node's store
//! of each partition (`<data_dir>/p<p>`, a leader's or a standby's) is opened here
//! as a node taking the partition over would open it — the records of the stream
//! past the store's applied mark, read with the validity rule
//! (`turnd_cluster::log::read_valid`), replayed into it and written to sled — and
//! every key and value it then holds is compared with the other nodes' (a
//! session's events one by one: how they are grouped into values is the local
//! store's own layout). A replica that applied a record
//! the rule voids, missed one, or applied one differently keeps that difference
//! below its mark, where no replay repairs it: the first differing key is the
//! answer.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use turnd_cluster::log::{lsn, read_valid, seq_of, LogConfig};
use turnd_cluster::nats::Nats;
use turnd_cluster::LogError;
use turnd_store::log::{CommitLog, Opened, Record};
use turnd_store::{Kv, LoggedKv, StoreError};

/// A log that holds nothing more than the records handed to the open: the store
/// replays them and takes no appends.
struct ReadOnly {
    next: u64,
}

impl CommitLog for ReadOnly {
    fn next_lsn(&self) -> u64 {
        self.next
    }
    fn append(&self, _: &[&[u8]], _: bool) -> Result<u64, StoreError> {
        Err(StoreError::Write(
            "a checker's store takes no writes".into(),
        ))
    }
    fn is_failed(&self) -> bool {
        false
    }
    fn heal(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn read_range(&self, _: u64, _: u64) -> Result<Vec<Record>, StoreError> {
        Err(StoreError::Write("a checker's store reads no range".into()))
    }
    fn wants_trim(&self) -> bool {
        false
    }
    fn trim(&self, _: u64) -> Result<usize, StoreError> {
        Ok(0)
    }
}

/// What a store holds: every key and its value.
type Contents = BTreeMap<Vec<u8>, Vec<u8>>;

/// Every key and value of the store in `dir` once `records` (the stream's valid
/// records, in order) past its applied mark are replayed into it.
fn contents(dir: &Path, records: &[Record]) -> anyhow::Result<(u64, Contents)> {
    let mut opts = turnd_server::store_options(&turnd_server::Config::default())?;
    opts.windows.window_ms = 0;
    let next = records.last().map_or(1, |r| r.lsn + 1);
    let mut mark = 0;
    let (kv, _) = LoggedKv::open_with_log(dir, opts, |applied| {
        mark = applied;
        let past: Vec<Record> = records
            .iter()
            .filter(|r| r.lsn > applied)
            .cloned()
            .collect();
        Ok(Opened {
            log: Box::new(ReadOnly {
                next: next.max(applied + 1),
            }) as Box<dyn CommitLog>,
            bytes: past.iter().map(|r| r.payload.len() as u64).sum(),
            records: past,
        })
    })
    .with_context(|| format!("open {}", dir.display()))?;
    // The replayed records wait in the overlay for the applier: written to sled
    // first, so that every replica's applied mark is the stream's last record.
    kv.sync()?;
    let all = kv.scan(&[], &[0xff; 32], false, usize::MAX)?;
    kv.close()?;
    let mut out = BTreeMap::new();
    for (k, v) in all {
        if k.first() != Some(&b'E') {
            out.insert(k, v);
            continue;
        }
        // A session's event values are a layout of sled: a leader's applier writes
        // consecutive ones as one value under the last one's key, a standby each
        // under its own. What they hold is each event, by session and seq.
        for e in turnd_store::event_value(&v)? {
            let mut key = turnd_store::keys::event(&e.session_id, e.seq);
            key.push(b'#');
            out.insert(key, serde_json::to_vec(&e)?);
        }
    }
    Ok((mark, out))
}

/// The first difference between two stores' contents: the key, and how.
fn first_difference(a: &Contents, b: &Contents) -> Option<(Vec<u8>, String)> {
    for (k, v) in a {
        match b.get(k) {
            None => return Some((k.clone(), "only in the first".into())),
            Some(w) if w != v => {
                return Some((
                    k.clone(),
                    format!(
                        "{:?} against {:?}",
                        String::from_utf8_lossy(v),
                        String::from_utf8_lossy(w)
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    b.keys()
        .find(|k| !a.contains_key(*k))
        .map(|k| (k.clone(), "only in the second".into()))
}

/// What the stream's valid records did to `key`: each put or delete with its lsn.
fn history_of(key: &[u8], records: &[Record]) -> Vec<String> {
    let mut out = Vec::new();
    for r in records {
        let Ok(ops) = turnd_store::logged::decode(&r.payload) else {
            out.push(format!("lsn {:#x}: undecodable", r.lsn));
            continue;
        };
        for op in ops {
            match op {
                turnd_store::KvOp::Put(k, _) if k == key => {
                    out.push(format!("put at {:#x}", r.lsn))
                }
                turnd_store::KvOp::Delete(k) if k == key => {
                    out.push(format!("delete at {:#x}", r.lsn));
                }
                _ => {}
            }
        }
    }
    out
}

/// Compare every node's store of each of `partitions` partitions (node `n<i>`'s
/// data in `roots[i]`), against the streams read through `nats`: the first
/// violation, or how many keys each partition holds.
pub async fn check_replicas(
    nats: &Arc<Nats>,
    roots: &[std::path::PathBuf],
    partitions: u32,
    max_bytes: i64,
) -> anyhow::Result<Result<Vec<usize>, String>> {
    let mut sizes = Vec::new();
    for p in 0..partitions {
        let cfg = LogConfig {
            replicas: 3,
            max_bytes,
            keep_all: true,
            ..LogConfig::new(p)
        };
        // A trimmed stream is read from its first message held: a store behind it
        // is no replica (its node copies a checkpoint before it may lead).
        let (valid, first_seq) = match read_valid(nats, &cfg, 0).await {
            Err(LogError::Behind { first_seq, .. }) => (
                read_valid(nats, &cfg, lsn(first_seq - 1, 0)).await,
                first_seq,
            ),
            r => (r, 1),
        };
        let valid = valid.with_context(|| format!("read partition {p}'s stream"))?;
        let records = Arc::new(valid.records);
        let mut first: Option<(usize, u64, Contents)> = None;
        let mut compared = 0;
        for (i, root) in roots.iter().enumerate() {
            let dir = root.join(format!("p{p}"));
            if !dir.exists() {
                continue;
            }
            let mine = records.clone();
            let (mark, held) = tokio::task::spawn_blocking(move || contents(&dir, &mine)).await??;
            if seq_of(mark) + 1 < first_seq {
                eprintln!(
                    "checker: n{i}'s store of partition {p} (applied {mark:#x}) is behind the \
                     stream's first message {first_seq}: not a replica"
                );
                continue;
            }
            compared += 1;
            match &first {
                None => first = Some((i, mark, held)),
                Some((j, base_mark, base)) => {
                    if let Some((key, how)) = first_difference(base, &held) {
                        return Ok(Err(format!(
                            "partition {p}: the replicas of n{j} (applied {base_mark:#x}) and n{i} \
                             (applied {mark:#x}) differ at key {:?} ({}): {how}; the stream's \
                             valid records (to {:#x}) did to it: {:?}",
                            String::from_utf8_lossy(&key),
                            key.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                            records.last().map_or(0, |r| r.lsn),
                            history_of(&key, &records)
                        )));
                    }
                }
            }
        }
        if compared < 2 && !records.is_empty() {
            return Ok(Err(format!(
                "partition {p}: {compared} store(s) hold its stream; nothing to compare"
            )));
        }
        sizes.push(first.map_or(0, |(_, _, m)| m.len()));
    }
    Ok(Ok(sizes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_is_named() {
        let a: Contents = [(b"k1".to_vec(), b"v".to_vec())].into();
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b.insert(b"k1".to_vec(), b"w".to_vec());
        assert!(first_difference(&a, &b).is_some_and(|(k, _)| k == b"k1"));
        b.clear();
        b.insert(b"k2".to_vec(), b"v".to_vec());
        assert!(first_difference(&a, &b).is_some_and(|(_, d)| d == "only in the first"));
    }
}
