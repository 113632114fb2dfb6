//! What sled leaves to its owner on disk: unfinished snapshots removed before an
//! open, blob files and directories synced, a new database made under another name
//! and renamed into place.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{IoOp, StoreError};

/// Remove the snapshot files sled left unfinished in `dir` (`snap.<lsn>.generating`).
///
/// sled 0.34 writes its snapshot while it opens a store: into `snap.<lsn>.generating`,
/// synced, then renamed to `snap.<lsn>`, and only then does it remove the older
/// snapshots. A process killed before the rename leaves the `.generating` file behind,
/// and sled's next open takes it for the newest snapshot (its file filter skips only
/// `.in___motion`): a partly written one fails the open with "Read corrupted data at
/// file offset None". Nothing was written to sled's log between the snapshot it
/// started from and the one it was generating (both are taken at open, before any
/// write), so without the file sled opens from the previous snapshot, still on disk,
/// or from its log alone, and finds the same data; it then writes the snapshot again.
///
/// Only while sled's lock on its `db` file can be taken: a process that holds it (a
/// running daemon, while `turnd check --data-dir` looks at its directory) may be
/// writing its snapshot right now, and sled writes one only while it holds the lock.
/// A held lock refuses the open as sled would. The lock is let go before sled opens
/// the store (sled takes it again then).
pub(crate) fn remove_unfinished_snapshots(dir: &Path) -> Result<(), StoreError> {
    let db = match File::open(dir.join("db")) {
        Ok(f) => f,
        // A new store: sled has written no snapshot in it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(StoreError::io(
                IoOp::Read,
                format_args!("open sled's file in {dir:?}"),
                &e,
            ))
        }
    };
    match db.try_lock() {
        Ok(()) => {}
        // In use: refused in the words of sled's own refusal, which the callers know
        // (`open_when_unlocked` tries again; `turnd check --data-dir` names the holder).
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(StoreError::Write(format!(
            "open sled at {dir:?}: could not acquire lock on its db file: held by another handle"
        )))
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(StoreError::io(
                IoOp::Read,
                format_args!("lock sled's file in {dir:?}"),
                &e,
            ))
        }
    }
    let listing_failed =
        |e: std::io::Error| StoreError::io(IoOp::Read, format_args!("list store dir {dir:?}"), &e);
    for entry in std::fs::read_dir(dir).map_err(listing_failed)? {
        let entry = entry.map_err(listing_failed)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!("removing {name} in {dir:?}: a snapshot sled did not finish writing");
            std::fs::remove_file(entry.path()).map_err(|e| {
                StoreError::io(
                    IoOp::Write,
                    format_args!("remove unfinished snapshot {:?}", entry.path()),
                    &e,
                )
            })?;
        }
    }
    Ok(())
}

/// Log messages larger than a quarter of sled's 512 KiB segment (a large value, or a
/// leaf node whose values add up to that) live as files under `blobs/`; a blob is
/// written before the log entry that points at it, so syncing the directory and the
/// new blob files keeps them durable too. sled writes a blob file once (created new,
/// then written in three `write_all`s) and never changes it, so a file already synced at
/// its current length needs nothing: only new files, and files that grew since their
/// last sync (one caught while sled was writing it), are synced; the list starts
/// empty at each open and after each checkpoint. A blob's removal becomes durable
/// with the next directory fsync, so after a power loss a collected blob may come
/// back as an unreferenced file (disk space only). With small values the directory
/// stays empty and this is one `readdir`; otherwise a `readdir` and a `stat` per
/// live blob. Returns how many files it synced.
pub(super) fn sync_blobs(
    dir: &Path,
    synced: &mut HashMap<OsString, u64>,
) -> Result<usize, StoreError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(StoreError::io(IoOp::Sync, "read blobs dir", &e)),
    };
    let mut live = HashMap::with_capacity(synced.len());
    let mut fresh = 0;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io(IoOp::Sync, "read blobs dir", &e))?;
        let name = entry.file_name();
        // sled removes a blob once its value was replaced and the old one collected,
        // possibly after the listing: a blob that is gone needs nothing made durable.
        let len = match entry.metadata() {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(StoreError::io(
                    IoOp::Sync,
                    format_args!("stat blob {name:?}"),
                    &e,
                ))
            }
        };
        if synced.get(&name) != Some(&len) {
            let f = match File::open(entry.path()) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(StoreError::io(
                        IoOp::Sync,
                        format_args!("open blob {:?}", entry.path()),
                        &e,
                    ))
                }
            };
            f.sync_data()
                .map_err(|e| StoreError::io(IoOp::Sync, "fdatasync blob", &e))?;
            fresh += 1;
        }
        live.insert(name, len);
    }
    if fresh > 0 {
        sync_dir(dir)?;
    }
    *synced = live;
    Ok(fresh)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(IoOp::Sync, format_args!("fsync dir {dir:?}"), &e))
}

/// What [`making_path`] appends to a directory's name.
pub(crate) const MAKING_SUFFIX: &str = ".new";

/// Where [`Shared::make`] makes the database of `dir` before renaming it into place:
/// `dir`'s name with [`MAKING_SUFFIX`] appended.
pub(crate) fn making_path(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(MAKING_SUFFIX);
    dir.with_file_name(name)
}

/// `fsync` every file under `dir`, then the directories, deepest first.
pub(super) fn sync_tree(dir: &Path) -> Result<(), StoreError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| StoreError::io(IoOp::Sync, format_args!("list {dir:?}"), &e))?;
    for entry in entries {
        let entry =
            entry.map_err(|e| StoreError::io(IoOp::Sync, format_args!("list {dir:?}"), &e))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(|e| StoreError::io(IoOp::Sync, format_args!("stat {path:?}"), &e))?;
        if kind.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| StoreError::io(IoOp::Sync, format_args!("fsync {path:?}"), &e))?;
        }
    }
    sync_dir(dir)
}
