//! The daemon's commit log: segment files on the local disk, in `DATA_DIR/log/`, a
//! [`CommitLog`] that keeps the contract of [`crate::log`] with one `fdatasync` per
//! group.
//!
//! **Files.** `log/<first lsn, 20 digits>.seg`. Each segment is `segment_bytes` long
//! from the start (so an append does not change the file's size, and a full disk shows
//! up when a segment is made, before anything is written to it) and its directory entry
//! is synced before the first record in it is acknowledged. The next segment is made
//! ahead of need, off the commit path: the oldest segments trimmed while a spare name
//! is free, renamed `spare` or `spare.1` ([`trim_before`], [`spares::SPARES`]), or else
//! (only while no closed segment waits for its trim) a file written with zeros and
//! synced as `spare` ([`spares::prepare_spare`], the log's [`CommitLog::upkeep`]); the
//! log renames a spare when it rolls over to it. A segment whose blocks were only
//! reserved (`fallocate`) makes every `fdatasync` write the file's extent map as well,
//! since ext4 marks reserved blocks as written only as they are (measured here: p50 190
//! – 207 µs per `fdatasync` of 4 – 16 KiB, against 128 – 134 µs into written zeros; on
//! ext4 with a journal 575 – 735 against 251 – 261 µs); without a spare ready (a disk
//! too full to make one) a segment is still reserved with `fallocate`.
//! [`LocalLog::open`] makes the first segment the same way, unless the last run left a
//! spare.
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
//! The log is written by one thread (the store's committer, [`SegmentWriter`]),
//! and trimmed and read by another (the applier), which never waits for an append:
//! they share only the list of closed segments.

mod files;
mod segments;
mod spares;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use segments::{closed_count, read_range, segment_counts, trim_before, Closed, SegmentWriter};

use super::{CommitLog, Opened, Record};
use crate::error::StoreError;
use crate::stats::CommitStats;

/// The commit log in a directory of segment files. See the module documentation.
pub struct LocalLog {
    dir: PathBuf,
    segment_bytes: u64,
    /// The committer's end: taken by one thread at a time, for a group at a time.
    writer: Mutex<SegmentWriter>,
    /// The closed segments, shared with the writer (which adds to them at a roll).
    closed: Arc<Mutex<Closed>>,
    /// Spare segments written with zeros ([`CommitLog::upkeep`]).
    zeroed: AtomicU64,
}

impl LocalLog {
    /// Open the log in `dir` (created if missing) with segments of `segment_bytes`,
    /// at `applied`, the last lsn the store holds: read every record after it, delete
    /// the segments wholly at or before it, and start a fresh segment for appends.
    pub fn open(
        dir: &Path,
        segment_bytes: u64,
        applied: u64,
    ) -> Result<Opened<LocalLog>, StoreError> {
        let opened = SegmentWriter::open(dir, segment_bytes, applied)?;
        Ok(Opened {
            log: LocalLog {
                dir: dir.to_path_buf(),
                segment_bytes,
                closed: opened.log.closed(),
                writer: Mutex::new(opened.log),
                zeroed: AtomicU64::new(0),
            },
            records: opened.records,
            bytes: opened.bytes,
        })
    }

    fn writer(&self) -> Result<std::sync::MutexGuard<'_, SegmentWriter>, StoreError> {
        self.writer
            .lock()
            .map_err(|_| StoreError::Write("commit log: writer lock poisoned".into()))
    }
}

impl CommitLog for LocalLog {
    fn next_lsn(&self) -> u64 {
        self.writer().map_or(0, |w| w.next_lsn())
    }

    fn append(&self, group: &[&[u8]], sync: bool) -> Result<u64, StoreError> {
        self.writer()?.append_group(group, sync)
    }

    fn is_failed(&self) -> bool {
        self.writer().map_or(true, |w| w.is_failed())
    }

    fn heal(&self) -> Result<(), StoreError> {
        self.writer()?.heal()
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.writer()?.flush()
    }

    fn read_range(&self, after: u64, upto: u64) -> Result<Vec<Record>, StoreError> {
        read_range(&self.dir, after, upto)
    }

    fn wants_trim(&self) -> bool {
        closed_count(&self.closed) > 0
    }

    fn trim(&self, applied: u64) -> Result<usize, StoreError> {
        trim_before(&self.dir, &self.closed, applied, self.segment_bytes)
    }

    /// Make the next segment ahead of need when none is ready
    /// ([`spares::prepare_spare`]).
    fn upkeep(&self) -> Result<(), StoreError> {
        // A closed segment becomes the spare when it is trimmed ([`trim_before`]),
        // with no zeros to write and no file to delete. At full load a segment is
        // trimmed well before the active one fills, so a spare of zeros made now
        // would only be written (a segment's worth of zeros, synced chunk by chunk)
        // to have the trimmed segment deleted instead: at full load 25 MB/s of
        // zeros written and as much deleted, beside which the log's `fdatasync`
        // stalled for up to 471 ms in a traced soak (`docs/benchmarks.md`).
        if closed_count(&self.closed) > 0 {
            return Ok(());
        }
        let made = spares::prepare_spare(&self.dir, self.segment_bytes).map_err(|e| {
            StoreError::Write(format!(
                "the commit log's next segment could not be made ahead of need (it is reserved when needed instead): {e}"
            ))
        })?;
        if made {
            tracing::debug!("made the commit log's next segment ahead of need");
            self.zeroed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn report(&self, stats: &mut CommitStats) {
        let seg = segment_counts(&self.closed);
        stats.log_segments = seg.closed as u64 + 1;
        stats.log_recycled = seg.recycled;
        stats.log_reserved = seg.reserved;
        stats.log_zeroed = self.zeroed.load(Ordering::Relaxed);
    }
}
