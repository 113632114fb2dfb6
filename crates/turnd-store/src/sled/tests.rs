//! The sled handle's own rules: blob files synced once unless they grow, and a
//! failed sync that fails every later one until the database is opened again.

use std::collections::HashMap;

use super::files::sync_blobs;
use super::{Shared, SledOptions};

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
