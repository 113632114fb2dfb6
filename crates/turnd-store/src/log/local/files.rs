//! The local log's dealings with the file system that both its segments and its
//! spares need: an I/O error in the log's words, a directory synced, a file a failed
//! step left behind removed.

use std::fs::File;
use std::path::Path;

use crate::error::{IoOp, StoreError};

/// An I/O error of the commit log, doing `what`.
pub(super) fn io(what: &str, e: std::io::Error) -> StoreError {
    StoreError::io(IoOp::Write, format_args!("commit log: {what}"), &e)
}

/// Sync `dir`, so that the entries made or removed in it survive a power loss.
pub(super) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| {
        StoreError::io(
            IoOp::Sync,
            format_args!("commit log: fsync dir {dir:?}"),
            &e,
        )
    })
}

/// Remove a file a failed step left behind, if it is there (a failure to is logged:
/// the step's own error is what the caller reports).
pub(super) fn remove_if_there(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("failed to remove {path:?}: {e}");
        }
    }
}
