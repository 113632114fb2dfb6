//! The counters of a store's commit path ([`CommitStats`]), which every layer that
//! commits, applies or logs adds to and the daemon's metrics read. They sit below
//! the layers that fill them, so that none of those names another to report.

/// Upper bounds, in seconds, of the buckets of [`CommitStats::sync_buckets`]: from
/// the quarter millisecond a sync of a few pages takes on an idle SSD to the half
/// second of a disk that stalls every writer.
pub const SYNC_BUCKET_BOUNDS: [f64; 11] = [
    0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5,
];
/// Buckets of [`CommitStats::sync_buckets`]: one per bound and one past the last.
pub const SYNC_BUCKETS: usize = SYNC_BUCKET_BOUNDS.len() + 1;

/// The bucket of [`CommitStats::sync_buckets`] a sync of `took` belongs to.
fn sync_bucket(took: std::time::Duration) -> usize {
    let secs = took.as_secs_f64();
    SYNC_BUCKET_BOUNDS
        .iter()
        .position(|bound| secs <= *bound)
        .unwrap_or(SYNC_BUCKET_BOUNDS.len())
}

/// Counters of the group-commit writer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Group commits (syncs) performed.
    pub syncs: u64,
    /// Batches written.
    pub batches: u64,
    /// Total microseconds spent in apply + sync.
    pub commit_micros: u64,
    /// Of `commit_micros`, the microseconds spent making the writes durable (sled
    /// flush and fdatasync); the rest is applying the batches.
    pub sync_micros: u64,
    /// Largest number of batches that shared one sync.
    pub max_group: u64,
    /// Group commits by the time their write and `fdatasync` of the commit log took
    /// (the time `sync_micros` adds up):
    /// `sync_buckets[i]` counts those that took at most [`SYNC_BUCKET_BOUNDS`]`[i]`
    /// seconds and more than the bound before; the last counts the longer ones.
    pub sync_buckets: [u64; SYNC_BUCKETS],
    /// Checkpoints performed (sled closed and opened again to bound the log sled
    /// replays at its next open).
    pub checkpoints: u64,
    /// Total microseconds spent in checkpoints, during which applies and reads of
    /// sled wait.
    pub checkpoint_micros: u64,
    /// Longest single checkpoint, in microseconds.
    pub max_checkpoint_micros: u64,
    /// Bytes of batches appended to the commit log.
    pub log_bytes: u64,
    /// Rounds in which the applier wrote the commit log's records to sled.
    pub applies: u64,
    /// Keys those rounds wrote (each key once per round, however often committed).
    pub applied_keys: u64,
    /// Microseconds those rounds took.
    pub apply_micros: u64,
    /// Deletes those rounds dropped instead of writing: of keys that no store but
    /// the overlay ever held (a turn's or invocation's record created and deleted
    /// before the applier took it).
    pub dropped_deletes: u64,
    /// Event values those rounds wrote as part of a later value of the same session
    /// instead of under their own key.
    pub merged_event_values: u64,
    /// Records of live turns and invocations appended to the commit log again
    /// instead of written to sled (carried: the applier's `carries`).
    pub carried_records: u64,
    /// Group commits that waited before their write because the overlay was full
    /// (more keys committed but not yet in sled than it may hold): sled was behind.
    pub room_waits: u64,
    /// Microseconds those groups waited.
    pub room_wait_micros: u64,
    /// Keys committed but not yet in sled (a gauge).
    pub overlay_keys: u64,
    /// Bytes of those keys and their values (a gauge).
    pub overlay_bytes: u64,
    /// Files of the commit log (a gauge).
    pub log_segments: u64,
    /// Commit log segments deleted once sled held their records.
    pub log_trims: u64,
    /// Of those, the ones kept as the log's next segment instead of deleted.
    pub log_recycled: u64,
    /// Spare segments written with zeros because no trimmed one was at hand.
    pub log_zeroed: u64,
    /// Segments begun with blocks only reserved because no spare was ready at the
    /// roll (each `fdatasync` into one also writes the file's extent map).
    pub log_reserved: u64,
    /// Keys a time window still held when its drop was taken, moved to the main
    /// database (turns that ended, or events written, between retention's judging
    /// the window empty and the drop; see [`crate::windows`]).
    pub window_leftovers: u64,
    /// Time windows closed until needed (a gauge; see
    /// [`crate::LoggedOptions::window_close_after`]).
    pub windows_closed: u64,
    /// Closed windows opened again by a read or write that needed them.
    pub window_reopens: u64,
}

impl CommitStats {
    /// Count a group commit's write and sync of `took` (its time in `sync_micros`,
    /// and its bucket in `sync_buckets`).
    pub fn record_sync(&mut self, took: std::time::Duration) {
        self.sync_micros += took.as_micros() as u64;
        self.sync_buckets[sync_bucket(took)] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_falls_in_the_first_bucket_whose_bound_it_does_not_pass() {
        let ms = |m: f64| std::time::Duration::from_secs_f64(m / 1000.0);
        assert_eq!(sync_bucket(ms(0.1)), 0);
        assert_eq!(sync_bucket(ms(0.25)), 0);
        assert_eq!(sync_bucket(ms(0.3)), 1);
        assert_eq!(sync_bucket(ms(40.0)), 7);
        assert_eq!(sync_bucket(ms(100.0)), 8);
        assert_eq!(sync_bucket(ms(500.0)), 10);
        assert_eq!(sync_bucket(ms(900.0)), SYNC_BUCKETS - 1);
    }
}
