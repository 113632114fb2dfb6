//! Reads of a [`super::LoggedKv`]: the overlay first, then sled, and for the keys
//! that carry a route the time windows that can hold them, merged in key order. A
//! read takes its sources under the overlay's lock, so that the applier cannot move
//! a key between them meanwhile, and reads again when a window among them was
//! dropped while it read.

use std::ops::Bound;
use std::sync::Arc;

use super::codec::unpack;
use super::overlay::{OKey, Pending, Value};
use super::Inner;
use crate::error::StoreError;
use crate::model::keys::{self, Entry};
use crate::sled::merged::Merged;
use crate::sled::Shared;
use crate::windows::{Route, WindowInfo};

/// [`crate::Kv::get`]: the overlay, else the window the key is routed to, else sled.
pub(super) fn get(inner: &Inner, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
    let window = {
        let o = inner
            .overlay
            .read()
            .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
        if let Some(p) = o.map.get(key) {
            return Ok(p.value.as_ref().map(|v| v.to_vec()));
        }
        if keys::routed_ms(key).is_some() {
            inner.windows.reader(key)
        } else {
            None
        }
    };
    let read = |sled: &Shared| {
        sled.with(
            |h| match h.db.get(key).map_err(|e| StoreError::Read(e.to_string()))? {
                Some(v) => unpack(&sled.stored(&v)?).map(Some),
                None => Ok(None),
            },
        )
    };
    match window {
        Some(w) => match read(&w) {
            Ok(v) => Ok(v),
            // Closed by a drop meanwhile: the key is read where it goes now.
            Err(_) if !matches!(inner.windows.route(key), Route::Window(_)) => read(&inner.sled),
            Err(e) => Err(e),
        },
        None => read(&inner.sled),
    }
}

/// [`crate::Kv::scan_session`]: the overlay's range merged with the sources' ranges.
pub(super) fn scan_session(
    inner: &Inner,
    start: &[u8],
    end: &[u8],
    reverse: bool,
    limit: usize,
    from_ms: Option<u64>,
) -> Result<Vec<Entry>, StoreError> {
    if start >= end {
        return Ok(Vec::new());
    }
    read_sources(inner, start, end, reverse, from_ms, |pending, wins| {
        let read = |r: sled::Result<(sled::IVec, sled::IVec)>| {
            r.map_err(|e| StoreError::Read(e.to_string()))
        };
        if !wins.is_empty() {
            // Keys in windows: the sources merged, each read only as far as needed.
            // A source's first read is `limit` entries more than the overlay can
            // hide (deletes), at most a chunk.
            let first = limit.saturating_add(pending.len());
            let sources = std::iter::once(&*inner.sled).chain(wins.iter().map(|w| &**w));
            let merged = Merged::new(sources, start, end, reverse, first);
            return merge(pending, merged, reverse, limit);
        }
        inner.sled.with(|h| {
            let range = h.db.range(start.to_vec()..end.to_vec());
            if reverse {
                merge(pending, range.rev().map(read), true, limit)
            } else {
                merge(pending, range.map(read), false, limit)
            }
        })
    })
}

/// [`crate::Kv::scan_one`]: the overlay's newest value, else the newest window's,
/// else the main database's.
pub(super) fn scan_one(
    inner: &Inner,
    start: &[u8],
    end: &[u8],
    from_ms: Option<u64>,
) -> Result<Option<Entry>, StoreError> {
    if start >= end {
        return Ok(None);
    }
    read_sources(inner, start, end, false, from_ms, |pending, wins| {
        // The overlay holds the newest value of what it holds.
        if let Some((k, Some(v))) = pending.iter().find(|(_, v)| v.is_some()) {
            return Ok(Some((k.clone(), v.to_vec())));
        }
        let deleted = |k: &[u8]| pending.iter().any(|(p, _)| p.as_slice() == k);
        // Newest window first: a session's recent turns are there; the main
        // database (keys of no route, or moved out of a dropped window) last.
        let sources = wins
            .iter()
            .rev()
            .map(|w| &**w)
            .chain(std::iter::once(&*inner.sled));
        for src in sources {
            let hit = src.with(|h| {
                for r in h.db.range(start.to_vec()..end.to_vec()) {
                    let (k, v) = r.map_err(|e| StoreError::Read(e.to_string()))?;
                    if !deleted(&k) {
                        return Ok(Some((k.to_vec(), unpack(&src.stored(&v)?)?)));
                    }
                }
                Ok(None)
            })?;
            if hit.is_some() {
                return Ok(hit);
            }
        }
        Ok(None)
    })
}

/// [`crate::Kv::scan_window`]: the overlay's keys routed to the window merged with
/// the window's own.
pub(super) fn scan_window(
    inner: &Inner,
    window_start: u64,
    start: &[u8],
    end: &[u8],
    limit: usize,
) -> Result<Vec<Entry>, StoreError> {
    if start >= end {
        return Ok(Vec::new());
    }
    // The overlay's keys routed to the window, and the window's sled, taken under
    // the overlay's lock (as `session_sources`).
    let (pending, win) = {
        let o = inner
            .overlay
            .read()
            .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
        let wins = &inner.windows;
        let pending: Pendings = o
            .map
            .range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)))
            .filter(|(k, _)| wins.route(k) == Route::Window(window_start))
            .map(|(k, p)| (k.to_vec(), p.value.clone()))
            .collect();
        (pending, wins.get(window_start))
    };
    let Some(win) = win else {
        return merge(pending, std::iter::empty(), false, limit);
    };
    win.with(|h| {
        let range = h.db.range(start.to_vec()..end.to_vec()).map(|r| {
            let (k, v) = r.map_err(|e| StoreError::Read(e.to_string()))?;
            Ok((k, win.resolved(v)?))
        });
        merge(pending, range, false, limit)
    })
}

/// The windows, with a drop the overlay holds shown as taken.
pub(super) fn windows(inner: &Inner) -> Result<Vec<WindowInfo>, StoreError> {
    let mut list = inner.windows.list();
    let o = inner
        .overlay
        .read()
        .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
    for w in &mut list {
        // Committed, not yet taken by the applier: its directory is still there.
        if o.drop_pending(w.start_ms) && !w.dropped {
            w.dropped = true;
            w.bytes = 0;
        }
    }
    Ok(list)
}

/// What the overlay holds of a range, in scan order.
type Pendings = Vec<(Vec<u8>, Value)>;

/// How many times a read is made again because a window it read was dropped
/// meanwhile (see [`read_sources`]).
const DROPPED_RETRIES: usize = 4;

/// Where a read of `[start, end)` looks: a snapshot of the overlay's range (in scan
/// order) and the windows that can hold its keys (those of a session from
/// `from_ms` on), taken under the overlay's lock so that the applier cannot move
/// a key between them meanwhile.
fn session_sources(
    inner: &Inner,
    start: &[u8],
    end: &[u8],
    reverse: bool,
    from_ms: Option<u64>,
) -> Result<(Pendings, Vec<Arc<Shared>>), StoreError> {
    let o = inner
        .overlay
        .read()
        .map_err(|_| StoreError::Read("overlay lock poisoned".into()))?;
    let range = o
        .map
        .range::<[u8], _>((Bound::Included(start), Bound::Excluded(end)));
    let entry = |(k, p): (&OKey, &Pending)| (k.to_vec(), p.value.clone());
    let pending = if reverse {
        range.rev().map(entry).collect()
    } else {
        range.map(entry).collect()
    };
    Ok((pending, inner.windows.readers_in(start, end, from_ms)))
}

/// Read `[start, end)` with `read` from its sources ([`session_sources`]).
/// A window among them may be dropped while it is read: retention's drop moves
/// what the window still holds to the main database, then closes it, and a read
/// of a closed window fails. The read is then made again from the sources as they
/// are now, which no longer name it; a window is dropped once, so this ends.
fn read_sources<T>(
    inner: &Inner,
    start: &[u8],
    end: &[u8],
    reverse: bool,
    from_ms: Option<u64>,
    read: impl Fn(Pendings, &[Arc<Shared>]) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut tries = 0;
    loop {
        let (pending, wins) = session_sources(inner, start, end, reverse, from_ms)?;
        #[cfg(test)]
        if let Some(hook) = inner.after_sources.lock().ok().and_then(|mut h| h.take()) {
            hook();
        }
        match read(pending, &wins) {
            Err(e) if tries < DROPPED_RETRIES && wins.iter().any(|w| w.is_closed()) => {
                tracing::debug!("a window was dropped while it was read; reading again: {e}");
                tries += 1;
            }
            r => return r,
        }
    }
}

/// Merge a snapshot of the overlay's range (in scan order) with sled's range.
fn merge(
    overlay: Vec<(Vec<u8>, Value)>,
    sled: impl Iterator<Item = Result<(sled::IVec, sled::IVec), StoreError>>,
    reverse: bool,
    limit: usize,
) -> Result<Vec<Entry>, StoreError> {
    let mut out = Vec::new();
    let mut o = overlay.into_iter().peekable();
    let mut s = sled.peekable();
    while out.len() < limit {
        let sled_key = match s.peek() {
            Some(Ok((k, _))) => Some(k.clone()),
            Some(Err(_)) => match s.next() {
                Some(Err(e)) => return Err(e),
                _ => None,
            },
            None => None,
        };
        let take_overlay = match (o.peek(), &sled_key) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some((ok, _)), Some(sk)) => {
                let ord = ok.as_slice().cmp(sk.as_ref());
                if ord == std::cmp::Ordering::Equal {
                    s.next();
                    true
                } else {
                    (ord == std::cmp::Ordering::Less) != reverse
                }
            }
        };
        if take_overlay {
            if let Some((k, Some(v))) = o.next() {
                out.push((k, v.to_vec()));
            }
        } else if let Some(Ok((k, v))) = s.next() {
            out.push((k.to_vec(), unpack(&v)?));
        }
    }
    Ok(out)
}
