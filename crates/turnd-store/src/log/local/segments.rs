//! The segment files of a [`super::LocalLog`] and the one thread's writer of them
//! ([`SegmentWriter`]): opening at a position (reading back what follows it,
//! deleting what precedes it), framing and appending groups, rolling over to the
//! next segment, healing after a failed append; and, for the applier's thread,
//! reading a range of records and trimming what sled holds.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::files::{io, remove_if_there, sync_dir};
use super::spares::{prepare_spare, reserve, spare_paths, take_spare, SPARE_TMP};
use crate::error::{IoOp, StoreError};
use crate::log::{Opened, Record};

/// Bytes of a record's header: length, CRC, lsn.
pub const HEADER_BYTES: usize = 16;

/// Capacity of the group buffer kept for the next group; a larger one is freed.
const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// A segment file, named by its first lsn.
#[derive(Debug, Clone)]
pub(super) struct Segment {
    pub(super) first_lsn: u64,
    pub(super) path: PathBuf,
}

/// The segments before the one being written, oldest first: shared with the thread
/// that trims them, so that a trim never waits for an append.
#[derive(Debug, Default)]
pub struct Closed {
    pub(super) segments: VecDeque<Segment>,
    /// The lsn the next segment (the one being written, when it closes) starts at.
    next_first: u64,
    /// Segments begun with blocks only reserved (`fallocate`) because no spare was
    /// ready when the log rolled over.
    reserved: u64,
    /// Trimmed segments kept as a spare instead of deleted.
    recycled: u64,
}

/// How the log's segments came and went, for the store's statistics.
#[derive(Debug, Clone, Copy, Default)]
pub struct SegmentCounts {
    /// Closed segments not yet trimmed.
    pub closed: usize,
    /// See [`Closed::reserved`].
    pub reserved: u64,
    /// See [`Closed::recycled`].
    pub recycled: u64,
}

/// The writer of the segment files: one thread's (the store's committer).
pub struct SegmentWriter {
    dir: PathBuf,
    segment_bytes: u64,
    pub(super) active: Segment,
    pub(super) file: File,
    /// Where the next record goes in the active segment.
    pub(super) offset: u64,
    /// Size the active segment was allocated with.
    allocated: u64,
    next_lsn: u64,
    closed: Arc<Mutex<Closed>>,
    /// Set by a failed write or sync: the range of the active segment that the failed
    /// group may have touched.
    pub(super) failed: Option<(u64, u64)>,
    /// The buffer a group is framed in, kept between groups.
    buf: Vec<u8>,
}

pub(super) fn segment_name(first_lsn: u64) -> String {
    format!("{first_lsn:020}.seg")
}

fn crc(lsn: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&lsn.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Append one framed record to `buf`.
pub(super) fn frame(buf: &mut Vec<u8>, lsn: u64, payload: &[u8]) -> Result<(), StoreError> {
    let len = u32::try_from(payload.len())
        .map_err(|_| StoreError::Write(format!("record of {} bytes", payload.len())))?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&crc(lsn, payload).to_le_bytes());
    buf.extend_from_slice(&lsn.to_le_bytes());
    buf.extend_from_slice(payload);
    Ok(())
}

/// The valid records at the start of `data`, the first carrying `first_lsn`.
pub(super) fn parse(data: &[u8], first_lsn: u64) -> Vec<Record> {
    let mut out = Vec::new();
    let mut off = 0usize;
    let mut want = first_lsn;
    while off + HEADER_BYTES <= data.len() {
        let h = &data[off..off + HEADER_BYTES];
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let len = word(0) as usize;
        let sum = word(4);
        let mut l = [0u8; 8];
        l.copy_from_slice(&h[8..16]);
        let lsn = u64::from_le_bytes(l);
        let end = off + HEADER_BYTES + len;
        if len == 0 || end > data.len() || lsn != want {
            break;
        }
        let payload = &data[off + HEADER_BYTES..end];
        if crc(lsn, payload) != sum {
            break;
        }
        out.push(Record {
            lsn,
            payload: payload.to_vec(),
        });
        off = end;
        want += 1;
    }
    out
}

impl SegmentWriter {
    /// Open the log in `dir` (created if missing), read every record with an lsn after
    /// `applied` (the last lsn already in sled), delete the segments wholly at or
    /// before it, and start a fresh segment for appends.
    pub fn open(
        dir: &Path,
        segment_bytes: u64,
        applied: u64,
    ) -> Result<Opened<SegmentWriter>, StoreError> {
        let fresh = !dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| io(&format!("create {dir:?}"), e))?;
        // The directory's own name is durable only once its parent is synced: before
        // a record in it is acknowledged.
        if let Some(parent) = dir.parent().filter(|p| fresh && !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        let mut found = list_segments(dir)?;
        remove_applied(&mut found, applied)?;
        let read = read_after(&found, applied)?;
        let next_lsn = read.next.unwrap_or(applied + 1).max(applied + 1);
        let mut kept: VecDeque<Segment> = found.into();
        // A last segment without one valid record (created just before a crash, or
        // holding only a torn group) is replaced by a fresh one of the same name.
        if let Some(last) = kept.back() {
            if last.first_lsn == next_lsn {
                std::fs::remove_file(&last.path).map_err(|e| io("remove an empty segment", e))?;
                kept.pop_back();
            }
        }
        let closed = Arc::new(Mutex::new(Closed {
            segments: kept,
            next_first: next_lsn,
            ..Closed::default()
        }));
        // The first segment too is written zeros rather than reserved blocks (about
        // 20 ms for 32 MiB here, and nothing when the last run left a spare); on a
        // disk too full for it, `create` reserves it instead.
        if let Err(e) = prepare_spare(dir, segment_bytes) {
            tracing::debug!("no spare segment at open: {e}");
        }
        let (active, file, allocated, _) = Self::create(dir, next_lsn, segment_bytes)?;
        Ok(Opened {
            log: SegmentWriter {
                dir: dir.to_path_buf(),
                segment_bytes,
                active,
                file,
                offset: 0,
                allocated,
                next_lsn,
                closed,
                failed: None,
                buf: Vec::new(),
            },
            records: read.records,
            bytes: read.bytes,
        })
    }

    fn create(
        dir: &Path,
        first_lsn: u64,
        bytes: u64,
    ) -> Result<(Segment, File, u64, bool), StoreError> {
        let path = dir.join(segment_name(first_lsn));
        let made = match take_spare(dir, &path, bytes) {
            Some(file) => Ok((file, bytes, false)),
            None => reserve(&path, bytes.max(1)).map(|(file, bytes)| (file, bytes, true)),
        };
        match made.and_then(|made| sync_dir(dir).map(|()| made)) {
            Ok((file, allocated, reserved)) => {
                Ok((Segment { first_lsn, path }, file, allocated, reserved))
            }
            Err(e) => {
                // Nothing was written to it: remove it, so the next try starts clean.
                remove_if_there(&path);
                Err(e)
            }
        }
    }

    /// The lsn the next appended record gets.
    pub fn next_lsn(&self) -> u64 {
        self.next_lsn
    }

    /// The list of closed segments, for [`trim_before`].
    pub fn closed(&self) -> Arc<Mutex<Closed>> {
        self.closed.clone()
    }

    /// Whether a failed append waits for [`SegmentWriter::heal`].
    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Append `payloads` as consecutive records and, with `sync`, make them durable.
    /// Returns the lsn of the first. On an error nothing of the group counts as
    /// written.
    pub fn append_group<P: AsRef<[u8]>>(
        &mut self,
        payloads: &[P],
        sync: bool,
    ) -> Result<u64, StoreError> {
        if self.failed.is_some() {
            return Err(StoreError::Write(
                "commit log: an earlier append failed and the log has not been repaired yet".into(),
            ));
        }
        let first = self.next_lsn;
        // One buffer for every group, so a group costs no allocation; one that grew
        // past a large group is let go.
        let mut buf = std::mem::take(&mut self.buf);
        if buf.capacity() > KEEP_BUFFER_BYTES {
            buf = Vec::new();
        }
        buf.clear();
        buf.reserve(
            payloads
                .iter()
                .map(|p| p.as_ref().len() + HEADER_BYTES)
                .sum::<usize>(),
        );
        for (i, p) in payloads.iter().enumerate() {
            frame(&mut buf, first + i as u64, p.as_ref())?;
        }
        let r = self.write_group(&buf, payloads.len() as u64, sync);
        self.buf = buf;
        r
    }

    /// Write a group's framed records at the end of the active segment (see
    /// [`SegmentWriter::append_group`]).
    fn write_group(&mut self, buf: &[u8], records: u64, sync: bool) -> Result<u64, StoreError> {
        let first = self.next_lsn;
        let len = buf.len() as u64;
        // A group goes whole into one segment. The segment is closed when the group
        // does not fit; a group larger than a segment gets a segment of its own size.
        if self.offset + len > self.allocated {
            self.roll(len)?;
        }
        let start = self.offset;
        let written = self
            .file
            .write_all_at(buf, start)
            .map_err(|e| io("write", e))
            .and_then(|()| {
                if !sync {
                    return Ok(());
                }
                self.file
                    .sync_data()
                    .map_err(|e| StoreError::io(IoOp::Sync, "commit log: fdatasync", &e))
            });
        match written {
            Ok(()) => {
                self.offset += len;
                self.next_lsn += records;
                Ok(first)
            }
            Err(e) => {
                self.failed = Some((start, start + len));
                Err(e)
            }
        }
    }

    /// Close the active segment and start the next one, sized for at least `need`.
    fn roll(&mut self, need: u64) -> Result<(), StoreError> {
        let (seg, file, allocated, reserved) =
            Self::create(&self.dir, self.next_lsn, self.segment_bytes.max(need))?;
        let old = std::mem::replace(&mut self.active, seg);
        let mut closed = self.closed.lock().map_err(|_| lock_poisoned())?;
        closed.reserved += u64::from(reserved);
        // An empty active segment (a group larger than a segment arrived first) is
        // replaced, not kept.
        if self.offset == 0 {
            drop(closed);
            if old.path != self.active.path {
                std::fs::remove_file(&old.path).map_err(|e| io("remove an empty segment", e))?;
            }
        } else {
            closed.segments.push_back(old);
            closed.next_first = self.next_lsn;
        }
        self.file = file;
        self.allocated = allocated;
        self.offset = 0;
        Ok(())
    }

    /// After a failed append: write zeros over what the failed group may have left
    /// and sync them, so that a later open cannot read any of it. Appends go on from
    /// where the failed group started, with its lsn.
    pub fn heal(&mut self) -> Result<(), StoreError> {
        let Some((start, end)) = self.failed else {
            return Ok(());
        };
        let zeros = vec![0u8; (end - start) as usize];
        self.file
            .write_all_at(&zeros, start)
            .map_err(|e| io("write zeros over a failed append", e))?;
        self.file
            .sync_data()
            .map_err(|e| StoreError::io(IoOp::Sync, "commit log: fdatasync after repair", &e))?;
        self.failed = None;
        Ok(())
    }

    /// Sync the active segment (nothing is buffered; used at close).
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.file
            .flush()
            .and_then(|()| self.file.sync_data())
            .map_err(|e| StoreError::io(IoOp::Sync, "commit log: fdatasync", &e))
    }
}

/// The segment files in `dir`, by their first lsn (a spare a crash left half made is
/// removed).
fn list_segments(dir: &Path) -> Result<Vec<Segment>, StoreError> {
    let mut found: Vec<Segment> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io("list segments", e))? {
        let entry = entry.map_err(|e| io("list segments", e))?;
        let name = entry.file_name();
        if name == SPARE_TMP {
            // A spare whose making a crash cut: never renamed, never used.
            std::fs::remove_file(entry.path()).map_err(|e| io("remove a half-made spare", e))?;
            continue;
        }
        let Some(first) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".seg"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        found.push(Segment {
            first_lsn: first,
            path: entry.path(),
        });
    }
    found.sort_by_key(|s| s.first_lsn);
    Ok(found)
}

/// Delete the segments wholly applied: those the next one of which starts at or
/// before `applied + 1`.
fn remove_applied(found: &mut Vec<Segment>, applied: u64) -> Result<(), StoreError> {
    let mut stale = 0;
    while stale + 1 < found.len() && found[stale + 1].first_lsn <= applied + 1 {
        stale += 1;
    }
    for s in found.drain(..stale) {
        std::fs::remove_file(&s.path).map_err(|e| io("remove an applied segment", e))?;
    }
    Ok(())
}

/// What the segments left after [`remove_applied`] hold.
struct ReadBack {
    /// Every readable record after `applied`, in lsn order.
    records: Vec<Record>,
    /// Bytes of every readable record, those at or before `applied` too.
    bytes: u64,
    /// The lsn after the last readable record (None: no segment).
    next: Option<u64>,
}

/// Read every segment in order, each from its first lsn up to its first record that
/// is torn, corrupt or out of sequence. Fails when a segment does not start where
/// the records before it end, or when the oldest starts past `applied + 1`:
/// acknowledged records would be missing.
fn read_after(found: &[Segment], applied: u64) -> Result<ReadBack, StoreError> {
    let mut read = ReadBack {
        records: Vec::new(),
        bytes: 0,
        next: None,
    };
    for s in found {
        if let Some(n) = read.next {
            if s.first_lsn != n {
                return Err(StoreError::Corrupt(format!(
                    "commit log: segment {:?} starts at lsn {} but the records before it end at {}",
                    s.path,
                    s.first_lsn,
                    n - 1
                )));
            }
        }
        let data = std::fs::read(&s.path).map_err(|e| io("read a segment", e))?;
        let recs = parse(&data, s.first_lsn);
        read.next = Some(s.first_lsn + recs.len() as u64);
        for r in recs {
            read.bytes += (HEADER_BYTES + r.payload.len()) as u64;
            if r.lsn > applied {
                read.records.push(r);
            }
        }
    }
    if let Some(first) = found.first() {
        if first.first_lsn > applied + 1 {
            return Err(StoreError::Corrupt(format!(
                "commit log: its oldest segment {:?} starts at lsn {} but the store holds records only up to {applied}",
                first.path, first.first_lsn
            )));
        }
    }
    Ok(read)
}

fn lock_poisoned() -> StoreError {
    StoreError::Write("commit log: segment list lock poisoned".into())
}

/// Delete the closed segments whose every record has an lsn at or before `applied`
/// (sled holds them, flushed and synced), then sync the directory so that a deleted
/// segment cannot come back after a power loss. Returns how many were deleted.
///
/// While a spare name is free ([`super::spares::SPARES`]), the first of them of
/// `segment_bytes` are not deleted but renamed to it: the log's next segments, their
/// blocks already written, with no file of zeros to make for them ([`prepare_spare`]).
/// Their old records are harmless there: every one has an lsn below the first of any
/// segment it becomes, and reading a segment stops at the first record that does not
/// carry the next lsn, as it does at a torn tail.
pub fn trim_before(
    dir: &Path,
    closed: &Mutex<Closed>,
    applied: u64,
    segment_bytes: u64,
) -> Result<usize, StoreError> {
    let doomed: Vec<Segment> = {
        let mut c = closed.lock().map_err(|_| lock_poisoned())?;
        let mut doomed = Vec::new();
        loop {
            // A segment ends where the next one (or the active one) starts.
            let ends_before = match c.segments.get(1) {
                Some(next) => next.first_lsn,
                None => c.next_first,
            };
            match c.segments.front() {
                Some(_) if ends_before <= applied + 1 => {
                    if let Some(s) = c.segments.pop_front() {
                        doomed.push(s);
                    }
                }
                _ => break,
            }
        }
        doomed
    };
    let mut free = spare_paths(dir).filter(|p| !p.exists());
    for s in &doomed {
        if std::fs::metadata(&s.path).is_ok_and(|m| m.len() == segment_bytes) {
            if let Some(spare) = free.next() {
                std::fs::rename(&s.path, &spare)
                    .map_err(|e| io("keep a trimmed segment as a spare", e))?;
                closed.lock().map_err(|_| lock_poisoned())?.recycled += 1;
                continue;
            }
        }
        std::fs::remove_file(&s.path).map_err(|e| io("remove a trimmed segment", e))?;
    }
    if !doomed.is_empty() {
        sync_dir(dir)?;
    }
    Ok(doomed.len())
}

/// The records with `after < lsn <= upto`, read from the segment files in `dir`
/// while the log is open (by the thread that trims it, so no segment it needs goes
/// away meanwhile). Records up to `upto` were acknowledged, so they are whole on
/// disk: a missing one is an error, never a torn tail.
pub fn read_range(dir: &Path, after: u64, upto: u64) -> Result<Vec<Record>, StoreError> {
    let mut found: Vec<u64> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io("list segments", e))? {
        let entry = entry.map_err(|e| io("list segments", e))?;
        if let Some(first) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_suffix(".seg"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            found.push(first);
        }
    }
    found.sort_unstable();
    let mut out = Vec::new();
    for (i, first) in found.iter().enumerate() {
        let ends = found.get(i + 1).copied().unwrap_or(u64::MAX);
        if ends <= after + 1 || *first > upto {
            continue;
        }
        let path = dir.join(segment_name(*first));
        let data = std::fs::read(&path).map_err(|e| io("read a segment", e))?;
        out.extend(
            parse(&data, *first)
                .into_iter()
                .filter(|r| r.lsn > after && r.lsn <= upto),
        );
    }
    let contiguous = out
        .iter()
        .enumerate()
        .all(|(i, r)| r.lsn == after + 1 + i as u64);
    if !contiguous || out.len() as u64 != upto.saturating_sub(after) {
        return Err(StoreError::Corrupt(format!(
            "commit log: records {} to {upto} are not all in {dir:?} ({} found)",
            after + 1,
            out.len()
        )));
    }
    Ok(out)
}

/// The number of closed segments.
pub fn closed_count(closed: &Mutex<Closed>) -> usize {
    segment_counts(closed).closed
}

/// The closed segments and how segments were begun and trimmed.
pub fn segment_counts(closed: &Mutex<Closed>) -> SegmentCounts {
    closed
        .lock()
        .map(|c| SegmentCounts {
            closed: c.segments.len(),
            reserved: c.reserved,
            recycled: c.recycled,
        })
        .unwrap_or_default()
}
