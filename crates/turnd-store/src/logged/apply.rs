//! How the commit path writes to sled: entries where they belong (a folded record or
//! a session's routed key to its time window, anything else to the main database),
//! in bounded batches with large values of a window in its value file, the applied
//! mark, the windows synced before a mark claims their writes, and a committed
//! window drop taken (what the window still holds of stored turns moved out).
//! Used by the applier's rounds and by the replay at open.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::codec::{pack, unpack};
use crate::error::StoreError;
use crate::model::keys::{self, Entry};
use crate::sled::{values, Handle, Shared};
use crate::windows::store::Windows;
use crate::windows::{self, Route};

/// sled key holding the last lsn the applier wrote to sled (u64, big-endian). It
/// sorts before every key of the layout ([`keys`]), whose scans never reach it.
pub const APPLIED_KEY: &[u8] = b"\x00applied";

/// Most keys in one sled `apply_batch` of the applier.
pub(super) const APPLY_KEYS: usize = 1024;

/// Window drops committed in `entries` (keys of [`keys::dropped_key`] put), with
/// the lsn of each.
pub(super) fn drops<'a>(entries: impl Iterator<Item = (&'a [u8], u64, bool)>) -> Vec<(u64, u64)> {
    entries
        .filter(|(_, _, put)| *put)
        .filter_map(|(k, lsn, _)| keys::dropped_start(k).map(|s| (s, lsn)))
        .collect()
}

/// The drops the main database records: window start → lsn of the drop.
pub(super) fn recorded_drops(sled: &Shared) -> Result<BTreeMap<u64, u64>, StoreError> {
    let (s, e) = keys::dropped_range();
    sled.with(|h| {
        let mut out = BTreeMap::new();
        for kv in h.db.range(s..e) {
            let (k, v) = kv.map_err(|e| StoreError::Read(e.to_string()))?;
            if let Some(start) = keys::dropped_start(&k) {
                let lsn = <[u8; 8]>::try_from(v.as_ref()).map_or(0, u64::from_be_bytes);
                out.insert(start, lsn);
            }
        }
        Ok(out)
    })
}

/// Write `entries` (key order, each with the lsn that wrote it) where they belong:
/// folded records to their time window, the rest to the main database (a window
/// drop with the lsn that made it as its value), in bounded batches. Returns the
/// bytes written and the windows written to (not yet synced), with how many keys each.
pub(super) fn apply_routed<'a>(
    sled: &Shared,
    wins: &Windows,
    entries: impl Iterator<Item = (&'a [u8], u64, Option<&'a [u8]>)>,
) -> Result<(u64, Vec<(u64, u64)>), StoreError> {
    type Op<'b> = (&'b [u8], Option<&'b [u8]>);
    let mut main: Vec<Op<'a>> = Vec::new();
    let mut to_windows: BTreeMap<u64, Vec<Op<'a>>> = BTreeMap::new();
    let mut dropped: Vec<(&'a [u8], u64)> = Vec::new();
    for (k, lsn, v) in entries {
        if k.first() == Some(&b'W') && v.is_some() {
            dropped.push((k, lsn));
            continue;
        }
        match wins.route(k) {
            Route::Main => main.push((k, v)),
            Route::Window(start) => to_windows.entry(start).or_default().push((k, v)),
        }
    }
    let mut bytes = 0;
    let mut written = Vec::new();
    for (start, entries) in to_windows {
        let Some(w) = wins.get(start) else {
            return Err(StoreError::Write(format!("window {start} is not open")));
        };
        let n = entries.len() as u64;
        bytes += apply_to_sled(&w, entries.into_iter(), None)?;
        written.push((start, n));
    }
    bytes += apply_to_sled(sled, main.into_iter(), None)?;
    if !dropped.is_empty() {
        let values: Vec<[u8; 8]> = dropped.iter().map(|(_, l)| l.to_be_bytes()).collect();
        bytes += apply_to_sled(
            sled,
            dropped
                .iter()
                .zip(&values)
                .map(|((k, _), v)| (*k, Some(&v[..]))),
            None,
        )?;
    }
    Ok((bytes, written))
}

/// Flush and `fdatasync` the windows in `written`: done before the main database
/// records an applied mark past their writes, so that a mark never claims what a
/// window may not have.
pub(super) fn sync_windows(wins: &Windows, written: &[u64]) -> Result<(), StoreError> {
    for start in written {
        match wins.get(*start) {
            // Parked after its writes: `park` synced them, and a write since would
            // have opened it again.
            Some(w) if w.is_parked() => {}
            Some(w) => w.with(|h| w.sync_files(h))?,
            None => {}
        }
    }
    Ok(())
}

/// Reads a range of a sled database's keys, values as stored (a value file pointer
/// resolved: [`Shared::stored`]), without its applied mark ([`windows::ReadRange`]).
pub(super) fn read_range<'h>(
    src: &'h Shared,
    h: &'h Handle,
) -> impl FnMut(&[u8], &[u8]) -> Result<Vec<Entry>, StoreError> + 'h {
    move |s: &[u8], e: &[u8]| {
        h.db.range(s.to_vec()..e.to_vec())
            .filter(|kv| kv.as_ref().map_or(true, |(k, _)| k.as_ref() != APPLIED_KEY))
            .map(|kv| {
                let (k, v) = kv.map_err(|e| StoreError::Read(e.to_string()))?;
                Ok((k.to_vec(), src.stored(&v)?.into_owned()))
            })
            .collect()
    }
}

/// Take a committed drop of the window starting at `start` (by the record `lsn`):
/// copy what it still holds of stored turns ([`windows::leftovers`]) to the main
/// database, as stored, then route its keys there. Returns the window's database, to
/// close and delete once the drop is durable, and how many keys it passed on.
#[allow(clippy::type_complexity)]
pub(super) fn take_drop(
    sled: &Shared,
    wins: &Windows,
    start: u64,
    lsn: u64,
) -> Result<(Option<(u64, Arc<Shared>)>, u64), StoreError> {
    let mut leftovers = 0;
    if let Some(w) = wins.get(start) {
        // Unfinished turns minted in the window: their records are in the main
        // database, written by now (this round wrote everything up to the drop).
        let unfinished = sled.with(|h| {
            windows::unfinished_turns(&mut read_range(sled, h), &unpack, start, wins.end_of(start))
        })?;
        // Only what belongs to turns still stored (see `windows::leftovers`): the
        // rest is of turns retention deleted, left for this drop to take.
        let held = w.with(|h| windows::leftovers(&mut read_range(&w, h), &unpack, &unfinished))?;
        leftovers = held.len() as u64;
        if !held.is_empty() {
            tracing::warn!(
                "the time window {start} still held {} keys of stored turns when it was dropped (turns that ended while retention judged it empty): moved to the main database",
                held.len()
            );
            sled.with(|h| {
                for chunk in held.chunks(APPLY_KEYS) {
                    let mut b = sled::Batch::default();
                    for (k, v) in chunk {
                        b.insert(k.as_slice(), v.as_slice());
                    }
                    h.db.apply_batch(b)
                        .map_err(|e| StoreError::Write(format!("apply to sled: {e}")))?;
                }
                Ok(())
            })?;
        }
    }
    Ok((
        wins.mark_dropped(start, lsn)?.map(|w| (start, w)),
        leftovers,
    ))
}

/// The last lsn sled holds (its [`APPLIED_KEY`]; 0 for a new store).
pub(super) fn applied_mark(sled: &Shared) -> Result<u64, StoreError> {
    let v = sled.with(|h| {
        h.db.get(APPLIED_KEY)
            .map_err(|e| StoreError::Read(e.to_string()))
    })?;
    match v {
        Some(v) => {
            let b: [u8; 8] = v
                .as_ref()
                .try_into()
                .map_err(|_| StoreError::Corrupt(format!("applied mark of {} bytes", v.len())))?;
            Ok(u64::from_be_bytes(b))
        }
        None => Ok(0),
    }
}

/// A key with its value packed for sled ([`pack`]), or None for a delete.
type Packed<'a> = (&'a [u8], Option<std::borrow::Cow<'a, [u8]>>);

/// Write `entries` (key order) to sled in bounded batches, the last recording
/// `lsn`, when given, under [`APPLIED_KEY`]. A database with a value file (a time
/// window) has the large values of each batch appended to it in one write first,
/// and holds pointers to them ([`crate::sled::values`]). Returns the bytes written.
pub(super) fn apply_to_sled<'a>(
    sled: &Shared,
    entries: impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)>,
    lsn: Option<u64>,
) -> Result<u64, StoreError> {
    let mut bytes = 0u64;
    let mut entries = entries.peekable();
    sled.with(|h| loop {
        let chunk: Vec<Packed<'_>> = entries
            .by_ref()
            .take(APPLY_KEYS)
            .map(|(k, v)| (k, v.map(pack)))
            .collect();
        let last = entries.peek().is_none();
        if chunk.is_empty() && !(last && lsn.is_some()) {
            return Ok(());
        }
        let file = sled.values();
        let outside = |v: &[u8]| file.is_some() && v.len() >= values::OUT_FROM;
        let large: Vec<&[u8]> = chunk
            .iter()
            .filter_map(|(_, v)| v.as_deref())
            .filter(|v| outside(v))
            .collect();
        let pointers = match file {
            Some(f) if !large.is_empty() => {
                f.append(&large).inspect_err(|_| sled.note_failure())?
            }
            _ => Vec::new(),
        };
        let mut pointers = pointers.iter();
        let mut batch = sled::Batch::default();
        for (k, v) in &chunk {
            match v {
                Some(v) if outside(v) => {
                    let p = pointers.next().ok_or_else(|| {
                        StoreError::Write("a value file append returned too few pointers".into())
                    })?;
                    bytes += (k.len() + v.len() + p.len()) as u64;
                    batch.insert(*k, &p[..]);
                }
                Some(v) => {
                    bytes += (k.len() + v.len()) as u64;
                    batch.insert(*k, &**v);
                }
                None => {
                    bytes += k.len() as u64;
                    batch.remove(*k);
                }
            }
        }
        if last {
            if let Some(lsn) = lsn {
                batch.insert(APPLIED_KEY, &lsn.to_be_bytes());
            }
        }
        h.db.apply_batch(batch)
            .map_err(|e| StoreError::Write(format!("apply to sled: {e}")))?;
        if last {
            return Ok(());
        }
    })?;
    Ok(bytes)
}
