//! The segments a [`super::LocalLog`] makes ahead of need: a trimmed segment kept
//! under a spare name, or a file of zeros written off the commit path, which the
//! writer renames when it rolls over; and, when no spare is ready, a segment whose
//! blocks are only reserved.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::files::{io, remove_if_there};
use crate::error::{IoOp, StoreError};

/// The name of the segment file made ahead of need, and of it while it is made.
pub(super) const SPARE: &str = "spare";
pub(super) const SPARE_TMP: &str = "spare.tmp";
/// The names of the segments made ahead of need, taken in this order: [`SPARE`], and a
/// second one that only a trim fills ([`super::segments::trim_before`]). A trim deletes
/// several segments at once when the applier's mark passes several (once a second):
/// with 2 KiB of input and output the log filled a 32 MiB segment about every 0.6 s,
/// and with one spare kept 17 – 26 % of the roll-overs found none and began a segment
/// with reserved blocks, whose every `fdatasync` also writes the file's extent map (and
/// on ext4 with a journal commits it, [`ZEROS_CHUNK`]).
pub(super) const SPARES: [&str; 2] = [SPARE, "spare.1"];

/// The paths of [`SPARES`] in `dir`, in their order.
pub(super) fn spare_paths(dir: &Path) -> impl Iterator<Item = PathBuf> + '_ {
    SPARES.iter().map(move |name| dir.join(name))
}

/// Bytes of zeros written, and synced, at a time while a spare is made: on ext4 with
/// a journal an `fdatasync` of the log commits the journal, which first writes back
/// the dirty data of files whose blocks it allocates, so a spare written whole and
/// synced once held a concurrent commit up for the 32 MiB (a 54 ms worst commit in
/// `turnd-bench sequential`); synced per chunk, at most one chunk is pending (with
/// 1 MiB chunks the p99 of that benchmark still doubled while a spare was made).
const ZEROS_CHUNK: usize = 256 << 10;

/// Bytes of zeros one write of a spare puts down. The page cache keeps a write's pages
/// in folios as large as the write (ext4 on Linux 6.16 and later), and a log append
/// that dirties a byte of a folio has its `fdatasync` write back the whole folio:
/// zeros written 256 KiB at a time made every group commit on a new spare write
/// 261 KiB to the disk for a few KiB appended; written 16 KiB at a time, 21 KiB (4 KiB
/// writes: 9 KiB, but 55 – 63 ms rather than 28 – 30 ms to make a 32 MiB spare).
const ZEROS_WRITE: usize = 16 << 10;

/// Make the next segment ahead of need, unless a spare of `bytes` is ready: a file of
/// `bytes` zeros, written and synced as `spare.tmp` and then renamed `spare`, which
/// [`super::segments::SegmentWriter`] renames to its next segment when it rolls over.
/// Returns whether it made one. Runs off the commit path (the store's applier); a
/// failure (a full disk) leaves nothing behind, and the log then reserves its next
/// segment itself.
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
            let zeros = vec![0u8; ZEROS_WRITE];
            let mut at = 0u64;
            while at < bytes {
                let chunk_end = (at + ZEROS_CHUNK as u64).min(bytes);
                while at < chunk_end {
                    let n = (chunk_end - at).min(ZEROS_WRITE as u64) as usize;
                    f.write_all_at(&zeros[..n], at)?;
                    at += n as u64;
                }
                f.sync_data()?;
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

/// A new file at `path` of `bytes` reserved with `fallocate`, and synced.
pub(super) fn reserve(path: &Path, bytes: u64) -> Result<(File, u64), StoreError> {
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
pub(super) fn take_spare(dir: &Path, path: &Path, bytes: u64) -> Option<File> {
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
