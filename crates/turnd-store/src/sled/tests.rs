//! The sled handle's own rules: blob files synced once unless they grow, synced
//! while sled removes old ones, and a failed sync that fails every later one until
//! the database is opened again.

use std::collections::HashMap;

use super::files::sync_blobs;
use super::{Shared, SledOptions};
use crate::error::StoreError;

/// Blob files are synced when new or grown since their last sync, not again.
#[test]
fn blobs_are_synced_once_unless_they_grow() {
    use std::io::Write;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut synced = HashMap::new();
    let blobs = dir.path().join("blobs");
    assert_eq!(sync_blobs(&blobs, &mut synced).expect("no dir yet"), 0);
    std::fs::create_dir(&blobs).expect("mkdir");
    let write = |name: &str, bytes: &[u8]| {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(blobs.join(name))
            .expect("open");
        f.write_all(bytes).expect("write");
    };
    write("100", b"abc");
    write("200", b"defg");
    assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 2);
    assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 0);
    write("200", b"more"); // caught while being written: grows after its sync
    write("300", b"h");
    assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 2);
    std::fs::remove_file(blobs.join("100")).expect("rm");
    assert_eq!(sync_blobs(&blobs, &mut synced).expect("sync"), 0);
    assert_eq!(synced.len(), 2, "{synced:?}");
    assert_eq!(synced.get(std::ffi::OsStr::new("200")), Some(&8));
}

/// A failed sync or value file append makes every later sync of the database
/// fail, also one that would succeed (Linux reports a failed write-back once
/// and may have dropped the pages), until its owner has written its writes
/// again and reopened it; a parked database is reopened by a later use after
/// that, and syncs again.
#[test]
fn a_failed_sync_fails_every_sync_until_the_database_is_reopened() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = Shared::open(
        dir.path(),
        SledOptions {
            values: true,
            background: false,
            ..SledOptions::default()
        },
    )
    .expect("open");
    let sync = |s: &Shared| s.with(|h| s.sync_files(h));
    sync(&s).expect("a sync");
    s.note_failure();
    assert!(sync(&s).is_err(), "the failure is reported");
    assert!(sync(&s).is_err(), "and again, though the disk works");
    assert!(s.park().is_err(), "not parked while failed");
    s.reopen_after_failure().expect("reopen");
    sync(&s).expect("a sync after the reopen");
    assert!(s.park().expect("park"));
    s.note_failure();
    s.reopen_after_failure().expect("a parked database");
    sync(&s).expect("opened by its use, and syncs");
    assert_eq!(s.unparks(), 1);
}

/// Values large enough to be blob files, replaced over and over from several
/// threads, each write synced as the applier syncs sled before a trim: sled deletes
/// the old blobs while a sync lists and syncs the directory, which must not fail.
#[test]
fn syncing_blobs_sled_removes_meanwhile_succeeds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = std::sync::Arc::new(Shared::open(dir.path(), SledOptions::default()).expect("open"));
    let writers: Vec<_> = (0..4u8)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..400u32 {
                    s.with(|h| {
                        h.db.insert([b'b', t], vec![i as u8; 64 * 1024])
                            .map_err(|e| StoreError::Write(e.to_string()))?;
                        s.sync_files(h)
                    })?;
                }
                Ok::<(), StoreError>(())
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer").expect("every write is synced");
    }
    let v = s.with(|h| {
        h.db.get([b'b', 3])
            .map_err(|e| StoreError::Read(e.to_string()))
    });
    assert_eq!(
        v.expect("get").map(|v| v.to_vec()),
        Some(vec![(399 % 256) as u8; 64 * 1024])
    );
}
