//! A start: sled and the time windows opened, and what the commit log holds past
//! the marks sled recorded written to them (coalesced by key, as the applier does;
//! of the records between the replay mark and the applied mark only the live
//! records' writes, [`coalesce_after`]), flushed and synced before the store serves. The same coalescing serves
//! the applier's repair after sled failed ([`coalesce_after`]), and the same writing a
//! warm standby's store ([`super::follow`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::apply::{
    apply_routed, apply_to_sled, drops, recorded_drops, recorded_marks, sync_windows, take_drop,
    Marks,
};
use super::codec::decode;
use super::overlay::{holds, Value};
use super::LoggedOptions;
use crate::error::StoreError;
use crate::log::{CommitLog, Record};
use crate::model::KvOp;
use crate::sled::{Shared, SledOptions};
use crate::windows::store::{split_cache, Windows};

/// sled's main database and the time windows, opened in `dir`, with the marks sled
/// holds.
pub(super) fn open_databases(
    dir: &Path,
    opts: &LoggedOptions,
) -> Result<(Arc<Shared>, Windows, Marks), StoreError> {
    let (main_mb, hot_mb) = split_cache(opts.sled.cache_mb, &opts.windows);
    let main = SledOptions {
        cache_mb: main_mb,
        ..opts.sled
    };
    let sled = Arc::new(Shared::open(dir, main)?);
    let marks = recorded_marks(&sled)?;
    let wins = Windows::open(
        dir,
        opts.windows,
        SledOptions {
            cache_mb: hot_mb,
            ..opts.sled
        },
        &recorded_drops(&sled)?,
        opts.window_close_after.is_some(),
    )?;
    Ok((sled, wins, marks))
}

/// Write `records`, read back from `log` at open (from the record after `marks`'
/// replay mark), to sled and the windows, make them durable, and let the log trim
/// them.
pub(super) fn replay(
    sled: &Shared,
    wins: &Windows,
    log: &dyn CommitLog,
    records: &[Record],
    marks: Marks,
) -> Result<(), StoreError> {
    let Some(last) = records.last().map(|r| r.lsn) else {
        return Ok(());
    };
    let map = coalesce_after(records, marks.applied)?;
    replay_into(sled, wins, &map, last)?;
    log.trim(last)?;
    Ok(())
}

/// The newest value of each key in `records`, with the lsn that wrote it, in key
/// order; of the records at or before `applied`, only the writes of live records
/// ([`is_live`]; the rest of them sled has, see [`Marks`]).
pub(super) fn coalesce_after(
    records: &[Record],
    applied: u64,
) -> Result<BTreeMap<Vec<u8>, (u64, Value)>, StoreError> {
    let mut map = BTreeMap::new();
    for r in records {
        let all = r.lsn > applied;
        for op in decode(&r.payload)? {
            match op {
                KvOp::Put(k, v) if all || is_live(&k) => map.insert(k, (r.lsn, Some(Arc::from(v)))),
                KvOp::Delete(k) if all || is_live(&k) => map.insert(k, (r.lsn, None)),
                _ => None,
            };
        }
    }
    Ok(map)
}

/// A key whose puts the applier may hold back past the applied mark
/// ([`super::overlay::holds`]): its deletes are replayed with them, so that the
/// newest write of the key wins.
fn is_live(key: &[u8]) -> bool {
    holds(key, &Some(Arc::from(&[][..])))
}

/// Write records read back from the log (coalesced) where they belong, record
/// `mark` as applied, make all of it durable, and finish the drops among them.
pub(super) fn replay_into(
    sled: &Shared,
    wins: &Windows,
    map: &BTreeMap<Vec<u8>, (u64, Value)>,
    mark: u64,
) -> Result<(), StoreError> {
    let (_, written) = apply_routed(
        sled,
        wins,
        map.iter()
            .map(|(k, (l, v))| (k.as_slice(), *l, v.as_deref())),
    )?;
    let written: Vec<u64> = written.into_iter().map(|(w, _)| w).collect();
    sync_windows(wins, &written)?;
    let mut closing = Vec::new();
    for (start, lsn) in drops(
        map.iter()
            .map(|(k, (l, v))| (k.as_slice(), *l, v.is_some())),
    ) {
        closing.extend(take_drop(sled, wins, start, lsn)?.0);
    }
    apply_to_sled(sled, std::iter::empty(), Some(Marks::at(mark)))?;
    sled.with(|h| sled.sync_files(h))?;
    for (start, w) in closing {
        wins.delete(start, w)?;
    }
    Ok(())
}
