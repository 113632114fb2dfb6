//! The system under test, started the way the binary starts it: the real
//! [`Daemon`] on `127.0.0.1:0` over a real sled store in a data directory, with echo
//! workers and callers that speak protocol v1 over WebSocket through the SDK.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use turnd_client::turnd_proto::Outcome;
use turnd_client::{Caller, FunctionSpec, InvocationCtx, Worker, WorkerHandle, WorkerOptions};
use turnd_server::{open_store, Config, Daemon, Listeners};

use crate::Common;
use turnd_store::{
    Batch, CommitStats, CommitTicket, Entry, Kv, KvOp, LoggedKv, MemKv, StoreError, WindowInfo,
};

/// The function every benchmark turn runs: completes with its input after
/// `input.steps` steps (default 1), continuing with the same state until then.
pub const ECHO: &str = "echo";

/// A function no worker serves: its turns wait as `awaiting_worker`.
pub const NOBODY: &str = "nobody";

/// The daemon's config for benchmarks: defaults except loopback port 0 and the data
/// directory, sync mode and checkpoint size given. (The per-connection request rate limit stays at its
/// default: a worker's results for its own invocations are not counted against it,
/// and the callers' connections stay under it.)
pub fn bench_config(data_dir: &Path, sync: &str, checkpoint_mb: u64) -> Config {
    let mut cfg = Config::default();
    cfg.server.listen = "127.0.0.1:0".into();
    cfg.server.admin_listen = "127.0.0.1:0".into();
    cfg.storage.data_dir = data_dir.to_path_buf();
    cfg.set_storage_sync(sync);
    cfg.storage.checkpoint_mb = checkpoint_mb;
    cfg
}

/// What the engine asks of the store: batches, key-value operations and bytes
/// committed, and reads. Counted by [`CountingKv`] around the store.
#[derive(Debug, Default)]
pub struct KvCounts {
    pub batches: AtomicU64,
    pub ops: AtomicU64,
    pub bytes: AtomicU64,
    pub reads: AtomicU64,
}

/// A snapshot of [`KvCounts`].
#[derive(Debug, Clone, Copy, Default)]
pub struct KvSnapshot {
    pub batches: u64,
    pub ops: u64,
    pub bytes: u64,
    pub reads: u64,
}

impl KvSnapshot {
    pub fn since(self, earlier: KvSnapshot) -> KvSnapshot {
        KvSnapshot {
            batches: self.batches.saturating_sub(earlier.batches),
            ops: self.ops.saturating_sub(earlier.ops),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            reads: self.reads.saturating_sub(earlier.reads),
        }
    }

    pub fn describe(&self) -> String {
        let b = self.batches.max(1) as f64;
        format!(
            "store writes: {:.1} keys and {:.0} bytes per batch; {} point/range reads",
            self.ops as f64 / b,
            self.bytes as f64 / b,
            self.reads
        )
    }
}

/// Forwards everything to the store and counts it (a few relaxed atomic adds per
/// call: no measurable cost next to a commit). Every method of [`Kv`] is passed on,
/// so that the in-process daemon reads through the time windows and holds back
/// retention as `turnd serve` does.
pub struct CountingKv {
    inner: Arc<dyn Kv>,
    counts: KvCounts,
}

impl Kv for CountingKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.counts.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.get(key)
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.counts.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.scan(start, end, reverse, limit)
    }

    fn scan_session(
        &self,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        limit: usize,
        from_ms: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        self.counts.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.scan_session(start, end, reverse, limit, from_ms)
    }

    fn scan_one(
        &self,
        start: &[u8],
        end: &[u8],
        from_ms: Option<u64>,
    ) -> Result<Option<Entry>, StoreError> {
        self.counts.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.scan_one(start, end, from_ms)
    }

    fn scan_window(
        &self,
        window_start: u64,
        start: &[u8],
        end: &[u8],
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.counts.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.scan_window(window_start, start, end, limit)
    }

    fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
        self.inner.windows()
    }

    fn commit(&self, batch: Batch) -> CommitTicket {
        let bytes: usize = batch
            .ops
            .iter()
            .map(|op| match op {
                KvOp::Put(k, v) => k.len() + v.len(),
                KvOp::Delete(k) => k.len(),
            })
            .sum();
        let c = &self.counts;
        c.batches.fetch_add(1, Ordering::Relaxed);
        c.ops.fetch_add(batch.ops.len() as u64, Ordering::Relaxed);
        c.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.inner.commit(batch)
    }

    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }

    fn commit_stats(&self) -> CommitStats {
        self.inner.commit_stats()
    }

    fn busy(&self) -> bool {
        self.inner.busy()
    }

    fn hold_event_merges(&self, session_id: &str) {
        self.inner.hold_event_merges(session_id);
    }

    fn release_event_merges(&self, session_id: &str) {
        self.inner.release_event_merges(session_id);
    }

    fn health(&self) -> Result<(), String> {
        self.inner.health()
    }
}

/// An in-process daemon on its own data directory.
pub struct BenchDaemon {
    pub daemon: Daemon,
    /// The sled store (None with `--store memory`).
    pub kv: Option<Arc<LoggedKv>>,
    counting: Arc<CountingKv>,
    pub url: String,
}

impl BenchDaemon {
    pub async fn start(data_dir: &Path, common: &Common) -> anyhow::Result<BenchDaemon> {
        let mut cfg = bench_config(data_dir, &common.sync, common.checkpoint_mb);
        cfg.storage.cache_mb = common.cache_mb;
        cfg.storage.apply_delay_ms = common.apply_delay_ms;
        cfg.validate()?;
        let listeners = Listeners::bind(&cfg).await?;
        let (kv, inner): (_, Arc<dyn Kv>) = if common.store == "memory" {
            (None, Arc::new(MemKv::new()))
        } else {
            let kv = open_store(&cfg)?;
            (Some(kv.clone()), kv)
        };
        let counting = Arc::new(CountingKv {
            inner,
            counts: KvCounts::default(),
        });
        let daemon = Daemon::start(cfg, listeners, counting.clone()).await?;
        let url = daemon.ws_url();
        Ok(BenchDaemon {
            daemon,
            kv,
            counting,
            url,
        })
    }

    pub fn kv_counts(&self) -> KvSnapshot {
        let c = &self.counting.counts;
        KvSnapshot {
            batches: c.batches.load(Ordering::Relaxed),
            ops: c.ops.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
        }
    }

    pub fn commit_stats(&self) -> CommitStats {
        self.counting.commit_stats()
    }

    /// Keys committed but not yet in sled (0 with `--store memory`).
    pub fn overlay_len(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.overlay_len())
    }

    /// Graceful shutdown (drain, sync). The store closes when the last reference to
    /// it is gone.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.daemon.shutdown().await
    }
}

/// The echo handler: `continue` until the last step, then `complete`, both with the
/// input unchanged, except that an input with `"reverse_pad": true` has its `pad`
/// string returned reversed (an output that repeats no run of the input, as a real
/// function's would not).
pub async fn echo(ctx: InvocationCtx) -> Outcome {
    let input = &ctx.invoke.input;
    let steps = input.get("steps").and_then(Value::as_u64).unwrap_or(1);
    let out = echoed(input);
    if u64::from(ctx.invoke.step) + 1 < steps {
        Outcome::Continue(out)
    } else {
        Outcome::Complete(out)
    }
}

/// What [`echo`] returns for `input`.
fn echoed(input: &Value) -> Value {
    let mut out = input.clone();
    if input.get("reverse_pad").and_then(Value::as_bool) == Some(true) {
        if let Some(pad) = input.get("pad").and_then(Value::as_str) {
            out["pad"] = Value::String(pad.chars().rev().collect());
        }
    }
    out
}

/// Echo workers: `n` connections serving [`ECHO`] with `concurrency` each; returns
/// once all are connected and registered.
pub struct Workers {
    pub handles: Vec<WorkerHandle>,
    shutdown: CancellationToken,
}

impl Workers {
    pub async fn start(url: &str, n: usize, concurrency: u32) -> anyhow::Result<Workers> {
        let shutdown = CancellationToken::new();
        let pid = std::process::id();
        let mut handles = Vec::with_capacity(n);
        for i in 0..n {
            let mut opts = WorkerOptions::new(url, format!("bench-{pid}-w{i}"));
            opts.reconnect_delay = Duration::from_millis(50);
            let h = Worker::new(opts)
                .function(FunctionSpec::new(ECHO).concurrency(concurrency), echo)
                .spawn(shutdown.clone());
            handles.push(h);
        }
        for h in &handles {
            tokio::time::timeout(Duration::from_secs(10), h.connected())
                .await
                .context("echo worker did not connect within 10 s")?;
        }
        Ok(Workers { handles, shutdown })
    }

    /// Stop every worker and wait for them.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        for h in self.handles {
            h.join().await.context("echo worker ended with an error")?;
        }
        Ok(())
    }
}

/// `n` client connections.
pub async fn callers(url: &str, n: usize) -> anyhow::Result<Vec<Arc<Caller>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        out.push(Arc::new(
            Caller::connect(url, None)
                .await
                .context("connect a caller")?,
        ));
    }
    Ok(out)
}

/// Close every caller connection.
pub async fn close_callers(callers: Vec<Arc<Caller>>) {
    for c in callers {
        c.connection().close().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn echo_returns_the_input_and_a_pad_reversed_only_when_asked() {
        let plain = json!({"i": 1, "pad": "abc"});
        assert_eq!(echoed(&plain), plain);
        assert_eq!(
            echoed(&json!({"i": 1, "pad": "abc", "reverse_pad": true})),
            json!({"i": 1, "pad": "cba", "reverse_pad": true})
        );
    }

    /// A store with one window, always busy, whose session reads answer from the
    /// windows only (`scan` alone finds nothing), `scan_one` with a key of its own.
    struct Windowed(MemKv);

    const IN_WINDOW: &[u8] = b"Lin-window";
    const ONE: &[u8] = b"Lthe-newest-window";

    impl Kv for Windowed {
        fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            self.0.get(key)
        }
        fn scan(&self, s: &[u8], e: &[u8], r: bool, l: usize) -> Result<Vec<Entry>, StoreError> {
            self.0.scan(s, e, r, l)
        }
        fn scan_session(
            &self,
            _: &[u8],
            _: &[u8],
            _: bool,
            _: usize,
            _: Option<u64>,
        ) -> Result<Vec<Entry>, StoreError> {
            Ok(vec![(IN_WINDOW.to_vec(), b"v".to_vec())])
        }
        fn scan_one(
            &self,
            _: &[u8],
            _: &[u8],
            _: Option<u64>,
        ) -> Result<Option<Entry>, StoreError> {
            Ok(Some((ONE.to_vec(), b"v".to_vec())))
        }
        fn scan_window(
            &self,
            _: u64,
            _: &[u8],
            _: &[u8],
            _: usize,
        ) -> Result<Vec<Entry>, StoreError> {
            Ok(vec![(IN_WINDOW.to_vec(), b"v".to_vec())])
        }
        fn commit(&self, batch: Batch) -> CommitTicket {
            self.0.commit(batch)
        }
        fn sync(&self) -> Result<(), StoreError> {
            self.0.sync()
        }
        fn busy(&self) -> bool {
            true
        }
        fn windows(&self) -> Result<Vec<WindowInfo>, StoreError> {
            Ok(vec![WindowInfo {
                start_ms: 7,
                end_ms: None,
                bytes: 0,
                dropped: false,
            }])
        }
    }

    /// The counting wrapper passes on what the daemon asks of a store with time
    /// windows: a default method left in its place would read every window, or see
    /// none, and never hold retention back.
    #[test]
    fn the_counting_store_passes_windows_busy_and_session_reads_on() {
        let kv = CountingKv {
            inner: Arc::new(Windowed(MemKv::new())),
            counts: KvCounts::default(),
        };
        assert!(kv.busy());
        let wins = kv.windows().expect("windows");
        assert_eq!(wins.iter().map(|w| w.start_ms).collect::<Vec<_>>(), [7]);
        let found = kv.scan_one(b"L", b"M", Some(7)).expect("scan_one");
        assert_eq!(found.map(|(k, _)| k), Some(ONE.to_vec()));
        let listed = kv
            .scan_session(b"L", b"M", false, 10, Some(7))
            .expect("scan");
        assert_eq!(listed.len(), 1);
        let window = kv.scan_window(7, b"L", b"M", 10).expect("scan_window");
        assert_eq!(window.len(), 1);
        assert_eq!(kv.counts.reads.load(Ordering::Relaxed), 3);
    }
}
