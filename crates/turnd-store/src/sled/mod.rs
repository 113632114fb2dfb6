//! The sled 0.34 databases behind the commit log: the main one and each time
//! window's ([`Shared`], one handle each, reopened in place after a failure, a
//! checkpoint or a park), their durability ([`Shared::sync_files`]: sled's own
//! `flush` ends in `sync_file_range`, which does not flush the disk's write cache,
//! so sled's files are `fdatasync`ed too), the checkpoints that bound what sled
//! replays at its next open ([`Checkpoints`]), a window's value file ([`values`])
//! and a read of several databases as one ([`merged`]).
//!
//! Nothing here knows what the keys mean or where they come from: the commit path
//! (`crate::logged`) decides what goes to which database, and when.

mod checkpoints;
mod files;
mod handle;
pub(crate) mod merged;
#[cfg(test)]
mod tests;
pub(crate) mod values;

pub(crate) use checkpoints::Checkpoints;
#[cfg(test)]
pub(crate) use files::remove_unfinished_snapshots;
pub(crate) use files::sync_dir;
pub(crate) use files::{making_path, MAKING_SUFFIX};
pub(crate) use handle::{Handle, Shared};

use tokio::runtime::RuntimeFlavor;

use crate::error::StoreError;

/// Whether commits are made durable with an fsync before they are acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncMode {
    /// fsync before every acknowledgement (group commit). The default.
    #[default]
    Always,
    /// No fsync: acknowledgements survive a crash of the process only as far as the
    /// operating system wrote the commit log out. For tests and benchmarks only.
    Never,
}

impl SyncMode {
    pub fn parse(s: &str) -> Option<SyncMode> {
        match s {
            "always" => Some(SyncMode::Always),
            "never" => Some(SyncMode::Never),
            _ => None,
        }
    }
}

/// Default of `storage.checkpoint_mb`.
pub const DEFAULT_CHECKPOINT_MB: u64 = 256;

/// How the store is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SledOptions {
    pub sync: SyncMode,
    /// MiB of decoded pages sled keeps in memory.
    pub cache_mb: u64,
    /// MiB of keys and values written since the store was last opened after which
    /// the applier checkpoints (see [`Checkpoints`]); 0 never checkpoints.
    pub checkpoint_mb: u64,
    /// How long a due checkpoint gives way to reads in progress (it is tried again
    /// after each later group) before it waits for them, new reads queueing behind it.
    pub checkpoint_patience: std::time::Duration,
    /// Whether sled runs its own flusher thread: every [`FLUSH_EVERY_MS`] it writes
    /// sled's buffer out, cleans segments (sled's only reclaiming of the space of
    /// rewritten pages) and `fsync`s sled's file. A database that takes writes needs
    /// the cleaning; one that takes almost none (a time window past its turns) does
    /// without the thread, its wake-ups and its `fsync`s, which with hundreds of
    /// windows open add up. Its rare writes are flushed and synced by whoever needs
    /// them durable ([`Shared::sync_files`]), as every database's are.
    pub background: bool,
    /// Whether large values go to a value file beside sled's
    /// ([`values`]): a time window's database.
    pub values: bool,
}

/// sled's own default period of its flusher thread.
pub const FLUSH_EVERY_MS: u64 = 500;

impl Default for SledOptions {
    fn default() -> Self {
        SledOptions {
            sync: SyncMode::Always,
            cache_mb: DEFAULT_CACHE_MB,
            checkpoint_mb: DEFAULT_CHECKPOINT_MB,
            checkpoint_patience: std::time::Duration::from_secs(1),
            background: true,
            values: false,
        }
    }
}

/// Default size of sled's page cache (`storage.cache_mb`). The engine holds every
/// live turn itself and the commit log's overlay serves what sled has not applied,
/// so the cache serves only reads of finished work; at 8 MiB the benchmarks run as
/// fast as at 64 MiB, and a burst of finished sessions leaves 56 MiB less behind
/// (docs/benchmarks.md).
pub const DEFAULT_CACHE_MB: u64 = 8;

/// Run `f`, which may block for a while: on a worker thread of a multi-threaded tokio
/// runtime inside `block_in_place`, so that the runtime's other tasks move to other
/// threads; elsewhere (a plain thread, a current-thread runtime) as it is.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    let in_multi_thread_runtime = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if in_multi_thread_runtime {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// How long an open waits for sled's file lock to be released.
const REOPEN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// Run `open` until sled's file lock is no longer refused, for up to
/// `REOPEN_PATIENCE`. The lock goes with the last reference to sled's file, which a
/// thread of sled's may hold for a moment after a handle on the same directory is
/// dropped (a checkpoint's close, a standby stopped before its node takes the
/// partition over, or a store closed and opened again in one process). Only for a
/// directory this process itself just closed: another process's lock is waited for
/// in vain.
pub fn open_when_unlocked<T>(
    mut open: impl FnMut() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let give_up = std::time::Instant::now() + REOPEN_PATIENCE;
    loop {
        match open() {
            Err(e)
                if std::time::Instant::now() < give_up
                    && e.to_string().contains("could not acquire lock") =>
            {
                tracing::debug!("store still locked by a closed handle: {e}");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => return r,
        }
    }
}
