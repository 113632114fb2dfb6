//! `turnd-bench sled-batching`: sled 0.34 alone, to see where a group commit's time
//! goes and what merging a group's batches would save.
//!
//! sled 0.34's `apply_batch` rolls (seals and writes) the current IO buffer before
//! and after it reserves its batch manifest (`PageCache::pin_log`), and every sealed
//! buffer is written with `pwrite` + a waiting `sync_file_range`: each batch costs
//! synchronous device writes of its own, however many batches share the following
//! `fdatasync`. This probe applies groups of batches shaped like the daemon's
//! (keys, bytes per batch: measured by the scenarios' "store writes" note) in three
//! ways and times them: one `apply_batch` per batch (what the store's writer does),
//! one merged `apply_batch` per group, and — for reference — one batch per group
//! without any flush or sync.

use std::fs::File;
use std::time::Duration;

use anyhow::Context;
use tokio::time::Instant;

/// Settings of the probe.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub groups: usize,
    pub per_group: usize,
    pub keys: usize,
    pub value_bytes: usize,
}

fn key(n: u64, i: usize) -> Vec<u8> {
    // Spread like the daemon's random turn and invocation ids.
    let h = n
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17)
        .wrapping_add(i as u64);
    format!("{}{:016x}{:04}", (b'A' + (i % 7) as u8) as char, h, i).into_bytes()
}

fn batch(n: u64, s: &Shape) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..s.keys)
        .map(|i| (key(n, i), vec![b'x'; s.value_bytes]))
        .collect()
}

fn run(dir: &std::path::Path, s: &Shape, merged: bool, sync: bool) -> anyhow::Result<Duration> {
    let db = sled::Config::new()
        .path(dir)
        .cache_capacity(256 * 1024 * 1024)
        .open()
        .context("open sled")?;
    let log = File::open(dir.join("db")).context("open sled's db file")?;
    let mut n = 0u64;
    let start = Instant::now();
    for _ in 0..s.groups {
        let mut group = sled::Batch::default();
        for _ in 0..s.per_group {
            n += 1;
            if merged {
                for (k, v) in batch(n, s) {
                    group.insert(k, v);
                }
            } else {
                let mut b = sled::Batch::default();
                for (k, v) in batch(n, s) {
                    b.insert(k, v);
                }
                db.apply_batch(b).context("apply_batch")?;
            }
        }
        if merged {
            db.apply_batch(group).context("apply_batch")?;
        }
        if sync {
            db.flush().context("flush")?;
            log.sync_data().context("fdatasync")?;
        }
    }
    Ok(start.elapsed())
}

pub fn probe(s: Shape) -> anyhow::Result<()> {
    let batches = (s.groups * s.per_group) as f64;
    println!(
        "sled 0.34 probe: {} groups × {} batches of {} keys × {} bytes; flush + fdatasync of db after each group",
        s.groups, s.per_group, s.keys, s.value_bytes
    );
    println!("| way | wall | batches/s | µs per group |\n|---|---|---|---|");
    for (name, merged, sync) in [
        (
            "one apply_batch per batch (as the store's writer does)",
            false,
            true,
        ),
        (
            "the group's batches merged into one apply_batch",
            true,
            true,
        ),
        (
            "one apply_batch per batch, no flush/fdatasync (not durable)",
            false,
            false,
        ),
    ] {
        let tmp = tempfile::tempdir()?;
        let took = run(tmp.path(), &s, merged, sync)?;
        println!(
            "| {name} | {:.2} s | {:.0} | {:.0} |",
            took.as_secs_f64(),
            batches / took.as_secs_f64().max(1e-9),
            took.as_secs_f64() * 1e6 / s.groups.max(1) as f64
        );
    }
    Ok(())
}
