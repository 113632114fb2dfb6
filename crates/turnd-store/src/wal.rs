//! turnd's commit log: the first place a committed batch goes.
//!
//! Every batch the engine commits is appended here as one record, and a group of
//! records is made durable with one `fdatasync` before any of them is acknowledged.
//! sled is written behind the log ([`crate::logged`]), and the log is trimmed only
//! once sled holds, flushed and synced, everything the trimmed part held.
//!
//! The interface is narrow on purpose (append a group, read everything from the
//! start at open, read a range of acknowledged records while open, trim before a
//! position), so that a replicated log could take its place.
//!
//! **Files.** `log/<first lsn, 20 digits>.seg`. Each segment is `segment_bytes`
//! long from the start (so an append does not change the file's size, and a full
//! disk shows up when a segment is made, before anything is written to it) and its
//! directory entry is synced before the first record in it is acknowledged. The next
//! segment is made ahead of need, off the commit path: the oldest segments trimmed
//! while a spare name is free, renamed `spare` or `spare.1` ([`trim_before`],
//! [`SPARES`]), or else (only while no closed segment waits for its trim) a file
//! written with zeros and synced as `spare` ([`prepare_spare`]); the log renames a
//! spare when it rolls over to it. A segment whose blocks were only reserved (`fallocate`) makes every
//! `fdatasync` write the file's extent map as well, since ext4 marks reserved blocks
//! as written only as they are (measured here: p50 190 – 207 µs per `fdatasync` of
//! 4 – 16 KiB, against 128 – 134 µs into written zeros; on ext4 with a journal 575 –
//! 735 against 251 – 261 µs); without a spare ready (a disk too full to make one) a
//! segment is still reserved with `fallocate`. [`CommitLog::open`] makes the first
//! segment the same way, unless the last run left a spare.
//!
//! **Records.** `len: u32 LE | crc32: u32 LE | lsn: u64 LE | payload (len bytes)`,
//! the CRC over the lsn's bytes and the payload. Sequence numbers (lsn) are
//! consecutive across segments; a segment is named by the lsn of its first record.
//! Preallocated space reads as zeros, and a zero length ends a segment's records; a
//! segment made from a trimmed one ([`trim_before`]) holds older records past the
//! newest, whose lsns end reading there.
//!
//! **Reading at open.** Records are read in order until the first one that is
//! incomplete, fails its CRC or does not carry the next lsn: that is a torn tail (a
//! group whose `fdatasync` had not returned, so nothing in it was acknowledged), and
//! reading goes on with the next segment, which must start at the next lsn. New
//! appends always go to a fresh segment, so a torn tail is never written over and
//! can never be read as valid later. A segment that starts past the next lsn means
//! acknowledged records are missing: the open fails rather than start without them.
//!
//! **A failed append** (a write or an `fdatasync` that returns an error) leaves the
//! log *failed* at the offset where the group started: every later group is refused
//! until [`CommitLog::heal`] has written zeros over what the failed group may have
//! left and synced them, after which appends go on from that offset with the same
//! lsn. A failure to create the next segment (a full disk) writes nothing, so only
//! that group fails and the next one tries again.
//!
//! The log is written by one thread (the store's committer), outside any tokio
//! runtime.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::{IoOp, StoreError};

/// Bytes of a record's header: length, CRC, lsn.
pub const HEADER_BYTES: usize = 16;

/// Capacity of the group buffer kept for the next group; a larger one is freed.
const KEEP_BUFFER_BYTES: usize = 4 << 20;

/// Default size of one segment file.
pub const DEFAULT_SEGMENT_BYTES: u64 = 32 * 1024 * 1024;

/// One record read back at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub lsn: u64,
    pub payload: Vec<u8>,
}

#[derive(Debug, Clone)]
struct Segment {
    first_lsn: u64,
    path: PathBuf,
}

/// The segments before the one being written, oldest first: shared with the thread
/// that trims them, so that a trim never waits for an append.
#[derive(Debug, Default)]
pub struct Closed {
    segments: VecDeque<Segment>,
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

/// What [`CommitLog::open`] found.
pub struct Opened {
    pub log: CommitLog,
    /// Every readable record after `applied`, in lsn order.
    pub records: Vec<Record>,
    /// Segments read, and bytes of records in them.
    pub segments: usize,
    pub bytes: u64,
}

/// The commit log. See the module documentation.
pub struct CommitLog {
    dir: PathBuf,
    segment_bytes: u64,
    active: Segment,
    file: File,
    /// Where the next record goes in the active segment.
    offset: u64,
    /// Size the active segment was allocated with.
    allocated: u64,
    next_lsn: u64,
    closed: Arc<Mutex<Closed>>,
    /// Set by a failed write or sync: the range of the active segment that the failed
    /// group may have touched.
    failed: Option<(u64, u64)>,
    /// The buffer a group is framed in, kept between groups.
    buf: Vec<u8>,
}

fn segment_name(first_lsn: u64) -> String {
    format!("{first_lsn:020}.seg")
}

fn io(what: &str, e: std::io::Error) -> StoreError {
    StoreError::io(IoOp::Write, format_args!("commit log: {what}"), &e)
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| {
        StoreError::io(
            IoOp::Sync,
            format_args!("commit log: fsync dir {dir:?}"),
            &e,
        )
    })
}

fn crc(lsn: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&lsn.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Append one framed record to `buf`.
fn frame(buf: &mut Vec<u8>, lsn: u64, payload: &[u8]) -> Result<(), StoreError> {
    let len = u32::try_from(payload.len())
        .map_err(|_| StoreError::Write(format!("record of {} bytes", payload.len())))?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&crc(lsn, payload).to_le_bytes());
    buf.extend_from_slice(&lsn.to_le_bytes());
    buf.extend_from_slice(payload);
    Ok(())
}

/// The valid records at the start of `data`, the first carrying `first_lsn`.
fn parse(data: &[u8], first_lsn: u64) -> Vec<Record> {
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

impl CommitLog {
    /// Open the log in `dir` (created if missing), read every record with an lsn after
    /// `applied` (the last lsn already in sled), delete the segments wholly at or
    /// before it, and start a fresh segment for appends.
    pub fn open(dir: &Path, segment_bytes: u64, applied: u64) -> Result<Opened, StoreError> {
        let fresh = !dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| io(&format!("create {dir:?}"), e))?;
        // The directory's own name is durable only once its parent is synced: before
        // a record in it is acknowledged.
        if let Some(parent) = dir.parent().filter(|p| fresh && !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        let mut found: Vec<Segment> = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| io("list segments", e))? {
            let entry = entry.map_err(|e| io("list segments", e))?;
            let name = entry.file_name();
            if name == SPARE_TMP {
                // A spare whose making a crash cut: never renamed, never used.
                std::fs::remove_file(entry.path())
                    .map_err(|e| io("remove a half-made spare", e))?;
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

        // Segments wholly applied: the next one starts at or before `applied + 1`.
        let mut stale = 0;
        while stale + 1 < found.len() && found[stale + 1].first_lsn <= applied + 1 {
            stale += 1;
        }
        for s in found.drain(..stale) {
            std::fs::remove_file(&s.path).map_err(|e| io("remove an applied segment", e))?;
        }

        let mut records = Vec::new();
        let mut bytes = 0u64;
        let mut next: Option<u64> = None;
        let mut kept = VecDeque::new();
        for s in &found {
            if let Some(n) = next {
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
            next = Some(s.first_lsn + recs.len() as u64);
            for r in recs {
                bytes += (HEADER_BYTES + r.payload.len()) as u64;
                if r.lsn > applied {
                    records.push(r);
                }
            }
            kept.push_back(s.clone());
        }
        if let Some(first) = kept.front() {
            if first.first_lsn > applied + 1 {
                return Err(StoreError::Corrupt(format!(
                    "commit log: its oldest segment {:?} starts at lsn {} but the store holds records only up to {applied}",
                    first.path, first.first_lsn
                )));
            }
        }
        let segments = kept.len();
        let next_lsn = next.unwrap_or(applied + 1).max(applied + 1);
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
            log: CommitLog {
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
            records,
            segments,
            bytes,
        })
    }

    /// Create, preallocate and sync a new segment starting at `first_lsn`: the spare
    /// when one of `bytes` is ready ([`prepare_spare`]), else a new file reserved with
    /// `fallocate` (then the last value returned is `true`).
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

    /// Whether a failed append waits for [`CommitLog::heal`].
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
    /// [`CommitLog::append_group`]).
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

/// The name of the segment file made ahead of need, and of it while it is made.
const SPARE: &str = "spare";
const SPARE_TMP: &str = "spare.tmp";
/// The names of the segments made ahead of need, taken in this order: [`SPARE`], and
/// a second one that only a trim fills ([`trim_before`]). A trim deletes several
/// segments at once when the applier's mark passes several (once a second): with
/// 2 KiB of input and output the log filled a 32 MiB segment about every 0.6 s, and
/// with one spare kept 17 – 26 % of the roll-overs found none and began a segment
/// with reserved blocks, whose every `fdatasync` also writes the file's extent map
/// (and on ext4 with a journal commits it, [`ZEROS_CHUNK`]).
const SPARES: [&str; 2] = [SPARE, "spare.1"];

/// The paths of [`SPARES`] in `dir`, in their order.
fn spare_paths(dir: &Path) -> impl Iterator<Item = PathBuf> + '_ {
    SPARES.iter().map(move |name| dir.join(name))
}

/// Bytes of zeros written, and synced, at a time while a spare is made: on ext4 with
/// a journal an `fdatasync` of the log commits the journal, which first writes back
/// the dirty data of files whose blocks it allocates, so a spare written whole and
/// synced once held a concurrent commit up for the 32 MiB (a 54 ms worst commit in
/// `turnd-bench sequential`); synced per chunk, at most one chunk is pending (with
/// 1 MiB chunks the p99 of that benchmark still doubled while a spare was made).
const ZEROS_CHUNK: usize = 256 << 10;

/// Make the next segment ahead of need, unless a spare of `bytes` is ready: a file of
/// `bytes` zeros, written and synced as `spare.tmp` and then renamed `spare`, which
/// [`CommitLog`] renames to its next segment when it rolls over. Returns whether it
/// made one. Runs off the commit path (the store's applier); a failure (a full disk)
/// leaves nothing behind, and the log then reserves its next segment itself.
pub fn prepare_spare(dir: &Path, bytes: u64) -> Result<bool, StoreError> {
    let mut ready = false;
    for path in spare_paths(dir) {
        match std::fs::metadata(&path) {
            Ok(m) if m.len() == bytes => ready = true,
            // Made for another segment size: replaced.
            Ok(_) => std::fs::remove_file(&path).map_err(|e| io("remove a spare", e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("look for a spare", e)),
        }
    }
    if ready {
        return Ok(false);
    }
    let spare = dir.join(SPARE);
    let tmp = dir.join(SPARE_TMP);
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .and_then(|f| {
            let zeros = vec![0u8; ZEROS_CHUNK];
            let mut at = 0u64;
            while at < bytes {
                let n = (bytes - at).min(ZEROS_CHUNK as u64) as usize;
                f.write_all_at(&zeros[..n], at)?;
                f.sync_data()?;
                at += n as u64;
            }
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, &spare));
    if let Err(e) = made {
        remove_if_there(&tmp);
        return Err(io("make a spare segment", e));
    }
    Ok(true)
}

/// Remove a file a failed step left behind, if it is there (a failure to is logged:
/// the step's own error is what the caller reports).
fn remove_if_there(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("failed to remove {path:?}: {e}");
        }
    }
}

/// A new file at `path` of `bytes` reserved with `fallocate`, and synced.
fn reserve(path: &Path, bytes: u64) -> Result<(File, u64), StoreError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io(&format!("create {path:?}"), e))?;
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes)
        .map_err(|e| io("preallocate a segment", std::io::Error::from(e)))?;
    file.sync_all()
        .map_err(|e| StoreError::io(IoOp::Sync, "commit log: fsync a new segment", &e))?;
    Ok((file, bytes))
}

/// A spare renamed to `path` and opened, when one of `bytes` is ready.
fn take_spare(dir: &Path, path: &Path, bytes: u64) -> Option<File> {
    let spare = spare_paths(dir).find(|p| std::fs::metadata(p).is_ok_and(|m| m.len() == bytes))?;
    if let Err(e) = std::fs::rename(&spare, path) {
        tracing::debug!("the spare segment could not be taken: {e}");
        return None;
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::debug!("the spare segment could not be opened: {e}");
            remove_if_there(path);
            None
        }
    }
}

fn lock_poisoned() -> StoreError {
    StoreError::Write("commit log: segment list lock poisoned".into())
}

/// Delete the closed segments whose every record has an lsn at or before `applied`
/// (sled holds them, flushed and synced), then sync the directory so that a deleted
/// segment cannot come back after a power loss. Returns how many were deleted.
///
/// While a spare name is free ([`SPARES`]), the first of them of `segment_bytes` are
/// not deleted but renamed to it: the log's next segments, their blocks already
/// written, with no file of zeros to make for them ([`prepare_spare`]). Their old
/// records are harmless there:
/// every one has an lsn below the first of any segment it becomes, and reading a
/// segment stops at the first record that does not carry the next lsn, as it does at
/// a torn tail.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn payloads(range: std::ops::Range<u32>) -> Vec<Vec<u8>> {
        range.map(|i| format!("record {i}").into_bytes()).collect()
    }

    fn lsns(records: &[Record]) -> Vec<u64> {
        records.iter().map(|r| r.lsn).collect()
    }

    fn segment_files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").path())
            .collect();
        v.sort();
        v
    }

    /// A spare made ahead of need becomes the next segment when the log rolls over
    /// (the same file: its inode), one at a time; records written into it read back
    /// after a reopen. A half-made spare (a crash while it was written) is removed at
    /// open, and a spare of another segment size is replaced.
    #[test]
    fn the_next_segment_is_the_spare_made_ahead_of_need() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let seg = 256u64;
        let mut log = CommitLog::open(dir.path(), seg, 0).expect("open").log;
        let first = log.active.path.clone();
        assert!(prepare_spare(dir.path(), seg).expect("spare"));
        assert!(
            !prepare_spare(dir.path(), seg).expect("spare"),
            "one is ready"
        );
        let spare = dir.path().join(SPARE);
        let made = std::fs::metadata(&spare).expect("spare");
        assert_eq!(made.len(), seg);
        for p in payloads(0..20) {
            log.append_group(&[p], true).expect("append");
        }
        assert_ne!(log.active.path, first, "the log rolled over");
        assert!(!spare.exists(), "the roll took the spare");
        let active = std::fs::metadata(&log.active.path).expect("active");
        assert_eq!(active.ino(), made.ino(), "the new segment is the spare");
        drop(log);
        let o = CommitLog::open(dir.path(), seg, 0).expect("reopen");
        assert_eq!(lsns(&o.records), (1..=20).collect::<Vec<u64>>());
        let want: Vec<Vec<u8>> = payloads(0..20);
        let got: Vec<Vec<u8>> = o.records.into_iter().map(|r| r.payload).collect();
        assert_eq!(got, want);

        std::fs::write(dir.path().join(SPARE_TMP), b"cut short").expect("write");
        std::fs::write(&spare, b"another size").expect("write");
        drop(CommitLog::open(dir.path(), seg, 20).expect("open"));
        assert!(
            !dir.path().join(SPARE_TMP).exists(),
            "a half-made spare is removed"
        );
        assert!(prepare_spare(dir.path(), seg).expect("spare"), "replaced");
        assert_eq!(std::fs::metadata(&spare).expect("spare").len(), seg);
    }

    /// A segment trimmed while no spare is ready becomes the spare (the same file),
    /// and is the next segment the log rolls over to. Its old records are never read
    /// again: not after the new ones, not after a torn group written over them, and
    /// not when a reopen finds it with nothing new in it.
    #[test]
    fn a_trimmed_segment_becomes_the_spare_and_its_old_records_are_never_read() {
        use std::os::unix::fs::MetadataExt;
        // Records of one size, so that the new records in a segment made from an old
        // one end exactly where an old record starts, whole and with a valid checksum.
        fn one(n: u64) -> Vec<Vec<u8>> {
            vec![format!("rec {n:04}").into_bytes()]
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let seg = 256u64;
        let spare = dir.path().join(SPARE);
        let mut log = CommitLog::open(dir.path(), seg, 0).expect("open").log;
        // The open made its first segment from a spare; the first roll-over reserves
        // the next with fallocate.
        let closed = log.closed();
        while closed_count(&closed) == 0 {
            log.append_group(&one(log.next_lsn()), true)
                .expect("append");
        }
        assert!(!spare.exists());
        let oldest = closed.lock().expect("lock").segments[0].path.clone();
        let ino = std::fs::metadata(&oldest).expect("oldest").ino();
        let last = log.next_lsn() - 1;
        assert_eq!(
            trim_before(dir.path(), &closed, last, seg).expect("trim"),
            1
        );
        assert!(!oldest.exists());
        assert_eq!(std::fs::metadata(&spare).expect("spare").ino(), ino);
        assert!(
            !prepare_spare(dir.path(), seg).expect("spare"),
            "one is ready"
        );
        // The next roll-over takes it: its first record is the one that rolled over.
        while spare.exists() {
            log.append_group(&one(log.next_lsn()), true)
                .expect("append");
        }
        assert_eq!(
            std::fs::metadata(&log.active.path).expect("active").ino(),
            ino
        );
        assert_eq!(log.offset, (HEADER_BYTES + 8) as u64);
        let first = log.next_lsn() - 1;
        drop(log);
        let o = CommitLog::open(dir.path(), seg, first - 1).expect("reopen");
        assert_eq!(lsns(&o.records), vec![first]);
        assert_eq!(
            o.log.next_lsn(),
            first + 1,
            "the old records are not counted"
        );
        drop(o);
        // A torn group in it: a header written, its payload still the old bytes.
        let path = dir.path().join(segment_name(first));
        let mut torn = Vec::new();
        frame(&mut torn, first + 1, b"torn rec").expect("frame");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open")
            .write_all_at(&torn[..HEADER_BYTES], (HEADER_BYTES + 8) as u64)
            .expect("write");
        let o = CommitLog::open(dir.path(), seg, first - 1).expect("reopen");
        assert_eq!(lsns(&o.records), vec![first]);
        let mut log = o.log;
        log.append_group(&one(first + 1), true).expect("append");
        drop(log);
        let o = CommitLog::open(dir.path(), seg, first - 1).expect("reopen");
        assert_eq!(lsns(&o.records), vec![first, first + 1]);
        let got: Vec<Vec<u8>> = o.records.into_iter().map(|r| r.payload).collect();
        assert_eq!(got, [one(first), one(first + 1)].concat());
    }

    /// A trim that deletes several segments at once keeps two of them as spares, and
    /// the next two roll-overs take them: no segment is begun with reserved blocks
    /// while a trim has given the log spares. A third trimmed segment is deleted.
    #[test]
    fn a_trim_of_several_segments_keeps_two_spares_for_the_next_roll_overs() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let seg = 256u64;
        let mut log = CommitLog::open(dir.path(), seg, 0).expect("open").log;
        let closed = log.closed();
        while closed_count(&closed) < 3 {
            log.append_group(&payloads(0..1), true).expect("append");
        }
        let reserved = segment_counts(&closed).reserved;
        let trimmed: Vec<PathBuf> = closed
            .lock()
            .expect("lock")
            .segments
            .iter()
            .map(|s| s.path.clone())
            .collect();
        let inos: Vec<u64> = trimmed
            .iter()
            .map(|p| std::fs::metadata(p).expect("segment").ino())
            .collect();
        let last = log.next_lsn() - 1;
        assert_eq!(
            trim_before(dir.path(), &closed, last, seg).expect("trim"),
            3
        );
        let spares: Vec<u64> = SPARES
            .iter()
            .map(|n| {
                std::fs::metadata(dir.path().join(n))
                    .expect("a spare")
                    .ino()
            })
            .collect();
        assert_eq!(spares, inos[..2], "the first two trimmed are the spares");
        assert!(trimmed.iter().all(|p| !p.exists()));
        assert_eq!(segment_counts(&closed).recycled, 2);
        // The next two roll-overs take them, in order, and reserve nothing.
        let mut began = Vec::new();
        while began.len() < 2 {
            let active = log.active.path.clone();
            log.append_group(&payloads(0..1), true).expect("append");
            if log.active.path != active {
                began.push(std::fs::metadata(&log.active.path).expect("active").ino());
            }
        }
        assert_eq!(began, spares);
        assert_eq!(segment_counts(&closed).reserved, reserved);
        assert!(SPARES.iter().all(|n| !dir.path().join(n).exists()));
    }

    #[test]
    fn records_read_back_in_order_across_segments_and_opens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = CommitLog::open(dir.path(), 256, 0).expect("open");
        assert!(o.records.is_empty());
        let mut log = o.log;
        assert_eq!(log.append_group(&payloads(0..3), true).expect("append"), 1);
        // 10 records of ~25 bytes do not fit the 256-byte segment: a new one.
        assert_eq!(log.append_group(&payloads(3..13), true).expect("append"), 4);
        assert_eq!(
            log.append_group(&payloads(13..14), true).expect("append"),
            14
        );
        drop(log);
        let o = CommitLog::open(dir.path(), 256, 0).expect("reopen");
        assert_eq!(lsns(&o.records), (1..=14).collect::<Vec<_>>());
        assert_eq!(o.records[13].payload, b"record 13");
        assert_eq!(o.log.next_lsn(), 15);
        // Records at or before `applied` are not returned, and wholly applied
        // segments are deleted.
        drop(o);
        let before = segment_files(dir.path()).len();
        let o = CommitLog::open(dir.path(), 256, 13).expect("reopen");
        assert_eq!(lsns(&o.records), vec![14]);
        assert!(segment_files(dir.path()).len() < before);
    }

    /// While the log is open, any acknowledged range is read back from its segment
    /// files (the active one included), and a range that is not all there is an
    /// error rather than a short answer.
    #[test]
    fn a_range_of_records_reads_back_while_the_log_is_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = CommitLog::open(dir.path(), 256, 0).expect("open").log;
        log.append_group(&payloads(0..3), true).expect("append");
        log.append_group(&payloads(3..13), true).expect("append");
        log.append_group(&payloads(13..14), true).expect("append");
        assert!(segment_files(dir.path()).len() >= 2);
        let all = read_range(dir.path(), 0, 14).expect("read");
        assert_eq!(lsns(&all), (1..=14).collect::<Vec<_>>());
        assert_eq!(all[13].payload, b"record 13");
        assert_eq!(
            lsns(&read_range(dir.path(), 2, 5).expect("read")),
            vec![3, 4, 5]
        );
        assert!(read_range(dir.path(), 14, 14).expect("read").is_empty());
        assert!(
            read_range(dir.path(), 10, 15).is_err(),
            "15 was never written"
        );
        // Trimmed away: the range is not all there any more.
        let closed = log.closed();
        trim_before(dir.path(), &closed, 13, 256).expect("trim");
        assert!(read_range(dir.path(), 0, 14).is_err());
        assert_eq!(
            lsns(&read_range(dir.path(), 13, 14).expect("read")),
            vec![14]
        );
    }

    #[test]
    fn a_torn_tail_ends_reading_and_is_never_read_later() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = CommitLog::open(dir.path(), 1 << 20, 0).expect("open").log;
        log.append_group(&payloads(0..5), true).expect("append");
        let path = log.active.path.clone();
        let offset = log.offset;
        drop(log);
        // A group whose sync never returned: its second record is complete and
        // valid, its first was not written whole (a byte of it is wrong).
        let mut torn = Vec::new();
        frame(&mut torn, 6, b"first of the torn group").expect("frame");
        frame(&mut torn, 7, b"second, complete").expect("frame");
        torn[HEADER_BYTES + 2] ^= 0xff;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open seg");
        f.write_all_at(&torn, offset).expect("write");
        drop(f);
        let o = CommitLog::open(dir.path(), 1 << 20, 0).expect("reopen");
        assert_eq!(lsns(&o.records), vec![1, 2, 3, 4, 5]);
        let mut log = o.log;
        assert_eq!(log.append_group(&payloads(5..7), true).expect("append"), 6);
        drop(log);
        let o = CommitLog::open(dir.path(), 1 << 20, 0).expect("reopen");
        assert_eq!(lsns(&o.records), vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(o.records[5].payload, b"record 5");
    }

    #[test]
    fn a_corrupted_record_ends_reading_and_a_later_gap_fails_the_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = CommitLog::open(dir.path(), 48, 0).expect("open").log;
        for i in 0..6 {
            log.append_group(&payloads(i..i + 1), true).expect("append");
        }
        drop(log);
        let files = segment_files(dir.path());
        assert!(files.len() >= 3, "{files:?}");
        // One flipped payload byte in the last record of the first segment.
        let mut data = std::fs::read(&files[0]).expect("read");
        let recs = parse(&data, 1);
        let last_end: usize = recs.iter().map(|r| HEADER_BYTES + r.payload.len()).sum();
        data[last_end - 1] ^= 0xff;
        std::fs::write(&files[0], &data).expect("write");
        match CommitLog::open(dir.path(), 48, 0) {
            Err(StoreError::Corrupt(m)) => assert!(m.contains("starts at lsn"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(o) => panic!("opened with records {:?}", lsns(&o.records)),
        }
    }

    #[test]
    fn a_failed_append_is_zeroed_by_heal_and_appends_go_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = CommitLog::open(dir.path(), 1 << 20, 0).expect("open").log;
        log.append_group(&payloads(0..2), true).expect("append");
        // What a failed group may leave: valid-looking records 3 and 4.
        let start = log.offset;
        let mut left = Vec::new();
        frame(&mut left, 3, b"never acknowledged").expect("frame");
        frame(&mut left, 4, b"never acknowledged either").expect("frame");
        log.file.write_all_at(&left, start).expect("write");
        log.failed = Some((start, start + left.len() as u64));
        assert!(
            log.append_group(&payloads(9..10), true).is_err(),
            "refused until healed"
        );
        log.heal().expect("heal");
        assert_eq!(log.append_group(&[b"x".to_vec()], true).expect("append"), 3);
        drop(log);
        let o = CommitLog::open(dir.path(), 1 << 20, 0).expect("reopen");
        assert_eq!(lsns(&o.records), vec![1, 2, 3]);
        assert_eq!(o.records[2].payload, b"x");
    }

    #[test]
    fn trimming_deletes_only_segments_wholly_applied() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = CommitLog::open(dir.path(), 50, 0).expect("open").log;
        for i in 0..8 {
            log.append_group(&payloads(i..i + 1), true).expect("append");
        }
        let closed = log.closed();
        let before = closed_count(&closed);
        assert!(before >= 3, "{before}");
        // Nothing before lsn 1 is applied: nothing goes.
        assert_eq!(trim_before(dir.path(), &closed, 0, 50).expect("trim"), 0);
        let first_seg_end = closed.lock().expect("lock").segments[1].first_lsn - 1;
        assert_eq!(
            trim_before(dir.path(), &closed, first_seg_end - 1, 50).expect("trim"),
            0
        );
        assert_eq!(
            trim_before(dir.path(), &closed, first_seg_end, 50).expect("trim"),
            1
        );
        assert_eq!(
            trim_before(dir.path(), &closed, 8, 50).expect("trim"),
            before - 1
        );
        drop(log);
        let o = CommitLog::open(dir.path(), 50, 8).expect("reopen");
        assert!(o.records.is_empty());
        assert_eq!(o.log.next_lsn(), 9);
    }
}
