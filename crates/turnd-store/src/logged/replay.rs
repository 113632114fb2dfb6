//! A start: sled and the time windows opened, and what the commit log holds past
//! the applied mark sled recorded read back, coalesced by key ([`coalesce`]) and
//! put in the overlay for the applier, or written at once when it drops a window
//! ([`replay`]). The same coalescing serves the applier's repair after sled failed,
//! and the same writing a warm standby's store ([`super::follow`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::apply::{
    applied_mark, apply_routed, apply_to_sled, drops, recorded_drops, sync_windows, take_drop,
};
use super::codec::decode;
use super::overlay::{Overlay, Value};
use super::LoggedOptions;
use crate::error::StoreError;
use crate::log::{CommitLog, Record};
use crate::model::KvOp;
use crate::sled::{Shared, SledOptions};
use crate::windows::store::{split_cache, Windows};

/// sled's main database and the time windows, opened in `dir`, with the last lsn
/// sled holds.
pub(super) fn open_databases(
    dir: &Path,
    opts: &LoggedOptions,
) -> Result<(Arc<Shared>, Windows, u64), StoreError> {
    let (main_mb, hot_mb) = split_cache(opts.sled.cache_mb, &opts.windows);
    let main = SledOptions {
        cache_mb: main_mb,
        ..opts.sled
    };
    let sled = Arc::new(Shared::open(dir, main)?);
    let applied = applied_mark(&sled)?;
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
    Ok((sled, wins, applied))
}

/// Take `records`, read back from `log` at open past sled's mark `applied`, where
/// they go; returns the overlay the store starts with and the lsn sled then holds.
/// Without a window drop among them they go into the overlay, as they were before
/// the stop, and the applier writes them to sled in its first round: the store
/// serves without waiting for those writes (they were most of a start after a crash
/// under load). A window drop is finished before the store serves (its window's
/// directory deleted, what it still held moved): then they are written to sled and
/// the windows, made durable, and trimmed from the log.
///
/// The overlay holds everything up to the last record, which the applier's first
/// round records as its mark (a cluster's log may number its next append past a
/// gap, a fence: the mark stays at the last record, as on every replica).
pub(super) fn replay(
    sled: &Shared,
    wins: &Windows,
    log: &dyn CommitLog,
    records: &[Record],
    applied: u64,
    opts: &LoggedOptions,
) -> Result<(Overlay, u64), StoreError> {
    let last = records.last().map_or(applied, |r| r.lsn);
    let mut overlay = Overlay::new(opts.overlay_bytes, opts.overlay_keys, last);
    if records.is_empty() {
        return Ok((overlay, applied));
    }
    let map = coalesce(records)?;
    if map_drops(&map).is_empty() {
        overlay.refill(map);
        return Ok((overlay, applied));
    }
    replay_into(sled, wins, &map, last)?;
    log.trim(last)?;
    Ok((overlay, last))
}

/// The newest value of each key in `records`, with the lsn that wrote it, in key
/// order.
pub(super) fn coalesce(records: &[Record]) -> Result<BTreeMap<Vec<u8>, (u64, Value)>, StoreError> {
    let mut map = BTreeMap::new();
    for r in records {
        for op in decode(&r.payload)? {
            match op {
                KvOp::Put(k, v) => map.insert(k, (r.lsn, Some(Arc::from(v)))),
                KvOp::Delete(k) => map.insert(k, (r.lsn, None)),
            };
        }
    }
    Ok(map)
}

/// Write records read back from the log (coalesced) where they belong, record
/// `mark` as applied, make all of it durable, and finish the drops among them.
pub(super) fn replay_into(
    sled: &Shared,
    wins: &Windows,
    map: &BTreeMap<Vec<u8>, (u64, Value)>,
    mark: u64,
) -> Result<(), StoreError> {
    let written = write_coalesced(sled, wins, map)?;
    sync_windows(wins, &written)?;
    let mut closing = Vec::new();
    for (start, lsn) in map_drops(map) {
        closing.extend(take_drop(sled, wins, start, lsn)?.0);
    }
    record_mark(sled, mark)?;
    for (start, w) in closing {
        wins.delete(start, w)?;
    }
    Ok(())
}

/// Write coalesced records where they belong, durable or not yet; the starts of the
/// windows written.
pub(super) fn write_coalesced(
    sled: &Shared,
    wins: &Windows,
    map: &BTreeMap<Vec<u8>, (u64, Value)>,
) -> Result<Vec<u64>, StoreError> {
    let (_, written) = apply_routed(
        sled,
        wins,
        map.iter()
            .map(|(k, (l, v))| (k.as_slice(), *l, v.as_deref())),
    )?;
    Ok(written.into_iter().map(|(w, _)| w).collect())
}

/// The window drops among coalesced records: (window start, lsn).
pub(super) fn map_drops(map: &BTreeMap<Vec<u8>, (u64, Value)>) -> Vec<(u64, u64)> {
    drops(
        map.iter()
            .map(|(k, (l, v))| (k.as_slice(), *l, v.is_some())),
    )
}

/// Record `mark` as applied in the main database and sync it, with everything
/// written to it before.
pub(super) fn record_mark(sled: &Shared, mark: u64) -> Result<(), StoreError> {
    apply_to_sled(sled, std::iter::empty(), Some(mark))?;
    sled.with(|h| sled.sync_files(h))
}
