//! The callers of a fault run: one task per session submitting `echo` turns one at
//! a time, each with an idempotency key, through a node picked at random (seeded)
//! for each try. A try that fails retryably (no leader yet, a connection closed on
//! a write in doubt, a node down) goes again with the same key through another
//! pick, within a bound; every acknowledgement goes to the [`History`] in the order
//! it came. Every error is kept with the time its request was sent, so that a
//! window of the run (a rolling restart) can be asked how many of the requests
//! sent in it failed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turnd_client::{Caller, ClientError};
use turnd_proto::SubmitArgs;
use turnd_testkit::SplitMix64;
use turnd_tests::cluster::PARTITIONS;

use crate::checker::{Acked, History};

/// How long one submit may keep trying before it is given up (unacknowledged).
const SUBMIT_BOUND: Duration = Duration::from_secs(60);
/// At most this many submits per session in a run.
const MAX_PER_SESSION: u64 = 5_000;

/// An error a caller saw, and when.
#[derive(Debug, Clone)]
pub struct Seen {
    /// When the request was sent.
    pub sent: Instant,
    /// Which node the request went to.
    pub node: usize,
    pub what: String,
    pub retryable: bool,
}

impl Seen {
    /// When the request was sent, as the daemons' logs print time (UTC, of day).
    pub fn sent_utc(&self) -> String {
        let at = std::time::SystemTime::now()
            .checked_sub(self.sent.elapsed())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() % 86_400_000);
        format!(
            "{:02}:{:02}:{:02}.{:03}Z",
            at / 3_600_000,
            at / 60_000 % 60,
            at / 1_000 % 60,
            at % 1_000
        )
    }
}

/// Running callers.
pub struct Load {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    pub errors: Arc<Mutex<Vec<Seen>>>,
}

impl Load {
    /// Start one caller per session (`sessions` of them) on `urls`.
    pub fn start(urls: &[String], sessions: usize, seed: u64, h: &History) -> Load {
        let stop = CancellationToken::new();
        let errors = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..sessions)
            .map(|s| {
                let caller = SessionCaller {
                    session: session_name(s),
                    urls: urls.to_vec(),
                    rng: SplitMix64::new(seed ^ (s as u64 + 1).wrapping_mul(0x9E37_79B9)),
                    history: h.clone(),
                    errors: errors.clone(),
                    callers: (0..urls.len()).map(|_| None).collect(),
                };
                tokio::spawn(caller.run(stop.clone()))
            })
            .collect();
        Load {
            stop,
            tasks,
            errors,
        }
    }

    /// Stop submitting and wait for every caller (each finishes its submit).
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        self.stop.cancel();
        for t in std::mem::take(&mut self.tasks) {
            tokio::time::timeout(SUBMIT_BOUND + Duration::from_secs(10), t).await??;
        }
        Ok(())
    }

    /// The errors of the requests sent between `from` and `to` (one sent before
    /// `from` failed for what happened before).
    pub fn errors_between(&self, from: Instant, to: Instant) -> Vec<Seen> {
        self.errors
            .lock()
            .map(|v| {
                v.iter()
                    .filter(|s| s.sent >= from && s.sent <= to)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Errors that no retry can help (a bug, or a refusal that should not be).
    pub fn fatal(&self) -> Vec<Seen> {
        self.errors
            .lock()
            .map(|v| v.iter().filter(|s| !s.retryable).cloned().collect())
            .unwrap_or_default()
    }
}

/// The name of session `s`: one of partition `s % PARTITIONS`, so that the load
/// reaches every partition.
fn session_name(s: usize) -> String {
    let p = (s as u32) % PARTITIONS;
    (0..10_000)
        .map(|k| format!("fs{s}-{k}"))
        .find(|name| turnd_proto::session_partition(name, PARTITIONS) == p)
        .unwrap_or_else(|| format!("fs{s}"))
}

/// The kind of error `e` is: refused by a node that stops (`shutting_down`),
/// refused with no leader, refused otherwise, a node that could not be reached,
/// closed unanswered, or something else.
pub fn kind(e: &Seen) -> &'static str {
    if e.what.contains("shutting_down") {
        "shutting_down"
    } else if e.what.contains("has no leader now") {
        "unavailable: no leader"
    } else if e.what.starts_with("server refused") {
        "refused otherwise"
    } else if e.what.starts_with("failed to connect") {
        "not reached"
    } else if e
        .what
        .contains("connection closed before the answer arrived")
    {
        "closed unanswered"
    } else {
        "other"
    }
}

/// `errors` counted by [`kind`].
pub fn tally(errors: &[Seen]) -> std::collections::BTreeMap<&'static str, usize> {
    let mut t = std::collections::BTreeMap::new();
    for e in errors {
        *t.entry(kind(e)).or_insert(0) += 1;
    }
    t
}

struct SessionCaller {
    session: String,
    urls: Vec<String>,
    rng: SplitMix64,
    history: History,
    errors: Arc<Mutex<Vec<Seen>>>,
    callers: Vec<Option<Caller>>,
}

impl SessionCaller {
    async fn run(mut self, stop: CancellationToken) {
        for k in 0..MAX_PER_SESSION {
            if stop.is_cancelled() {
                return;
            }
            let key = format!("{}-{k}", self.session);
            self.submit(&key, k).await;
            let pause = Duration::from_millis(self.rng.range(30, 120));
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Submit the turn of `key` until acknowledged or [`SUBMIT_BOUND`] passed.
    async fn submit(&mut self, key: &str, k: u64) {
        let deadline = Instant::now() + SUBMIT_BOUND;
        while Instant::now() < deadline {
            let node = self.rng.below(self.urls.len() as u64) as usize;
            let args = SubmitArgs {
                session_id: self.session.clone(),
                function_id: "echo".into(),
                input: json!({ "k": k }),
                idempotency_key: Some(key.to_string()),
                turn_timeout_ms: None,
                on_busy: None,
            };
            let sent = Instant::now();
            match self.try_on(node, args).await {
                Ok(ok) => {
                    self.history.ack(Acked {
                        session: self.session.clone(),
                        turn_id: ok.turn.turn_id,
                        key: key.to_string(),
                        seq: ok.turn.seq,
                    });
                    return;
                }
                Err(e) => {
                    let seen = Seen {
                        sent,
                        node,
                        what: e.to_string(),
                        retryable: e.is_retryable() || matches!(e, ClientError::Connect(_)),
                    };
                    if !matches!(e, ClientError::Protocol(_)) {
                        self.callers[node] = None;
                    }
                    if let Ok(mut v) = self.errors.lock() {
                        v.push(seen);
                    }
                    tokio::time::sleep(Duration::from_millis(self.rng.range(20, 80))).await;
                }
            }
        }
        eprintln!("load: {key} never acknowledged within {SUBMIT_BOUND:?}");
    }

    async fn try_on(
        &mut self,
        node: usize,
        args: SubmitArgs,
    ) -> Result<turnd_proto::SubmitOk, ClientError> {
        // A connection the node closed (it drained, it stopped) is not sent on: a
        // caller connects again, as the SDKs do.
        if self.callers[node]
            .as_ref()
            .is_some_and(|c| c.connection().is_closed())
        {
            self.callers[node] = None;
        }
        if self.callers[node].is_none() {
            let c = tokio::time::timeout(
                Duration::from_secs(3),
                Caller::connect(&self.urls[node], None),
            )
            .await
            .map_err(|_| ClientError::Connect("connect timed out".into()))??;
            self.callers[node] = Some(c);
        }
        let Some(c) = self.callers[node].as_ref() else {
            return Err(ClientError::Connect("no caller".into()));
        };
        tokio::time::timeout(Duration::from_secs(15), c.submit(args))
            .await
            .map_err(|_| ClientError::Timeout)?
    }
}
