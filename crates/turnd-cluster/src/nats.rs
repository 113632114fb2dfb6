//! The connection to NATS, on a small tokio runtime of its own.
//!
//! The store's committer and applier are std threads that block (`CommitLog`'s
//! contract), and the node above runs its own runtime: the log's client therefore
//! lives on a runtime of one worker thread (`turnd-nats`) that only drives NATS,
//! which std threads wait on with [`Nats::block_on`] and async code awaits directly
//! (the client's calls work from any runtime while this one runs).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_nats::jetstream;
use futures_util::StreamExt;

use crate::error::LogError;

/// How long the first connection may take before [`Nats::connect`] fails.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `opts` with the user and password the first of `urls` carries (`nats://user:pass@host`),
/// which the client does not take from a URL by itself.
pub fn with_url_auth(
    opts: async_nats::ConnectOptions,
    urls: &[String],
) -> Result<async_nats::ConnectOptions, LogError> {
    let Some(url) = urls.first() else {
        return Err(LogError::Config("no NATS URL".into()));
    };
    let addr: async_nats::ServerAddr = url
        .parse()
        .map_err(|e| LogError::Config(format!("NATS URL {url:?}: {e}")))?;
    Ok(match (addr.username(), addr.password()) {
        (Some(u), Some(p)) => opts.user_and_password(u.to_string(), p.to_string()),
        _ => opts,
    })
}

/// `url` without the user and password it may carry (what errors and logs show).
pub fn shown(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}{}", &url[..s + 3], &url[at + 1..]),
        _ => url.to_string(),
    }
}

/// Connect to `url` alone with the defaults (and the URL's user and password).
pub async fn connect_one(url: &str) -> Result<async_nats::Client, LogError> {
    connect_any(&[url.to_string()]).await
}

/// Connect to the first of `urls` that answers, with the defaults (and the first
/// URL's user and password).
pub async fn connect_any(urls: &[String]) -> Result<async_nats::Client, LogError> {
    let opts = with_url_auth(
        async_nats::ConnectOptions::new().connection_timeout(CONNECT_TIMEOUT),
        urls,
    )?;
    let shown: Vec<String> = urls.iter().map(|u| shown(u)).collect();
    async_nats::connect_with_options(urls.to_vec(), opts)
        .await
        .map_err(|e| LogError::nats(&format!("connect to {}", shown.join(",")), e))
}

/// The options every connection of a node starts from: named `name`, reconnecting
/// for ever.
fn reconnecting(name: &str) -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(CONNECT_TIMEOUT)
        .max_reconnects(None)
}

/// Connect to `urls` with `opts` (and the first URL's user and password) from a task
/// on `rt`, so that the client's connection task runs on that runtime.
async fn connect_on(
    rt: &tokio::runtime::Handle,
    urls: &[String],
    opts: async_nats::ConnectOptions,
) -> Result<async_nats::Client, LogError> {
    let opts = with_url_auth(opts, urls)?;
    let addrs = urls.to_vec();
    rt.spawn(async move { async_nats::connect_with_options(addrs, opts).await })
        .await
        .map_err(|e| LogError::nats("connect", e))?
        .map_err(|e| {
            let shown: Vec<String> = urls.iter().map(|u| shown(u)).collect();
            LogError::nats(&format!("connect to {}", shown.join(",")), e)
        })
}

/// A tokio runtime that shuts down in the background when dropped, so that a
/// [`Nats`] may be dropped from async code too.
struct Runtime(Option<tokio::runtime::Runtime>);

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// A NATS connection and its JetStream context, with the runtime that drives them.
/// Cheap to share (`Arc`).
pub struct Nats {
    client: async_nats::Client,
    js: jetstream::Context,
    rt: Runtime,
    /// The bound of one request to the control buckets (leases, members), in ms:
    /// [`Nats::control`].
    control_ms: AtomicU64,
    /// A connection held to each configured server, for [`Nats::on_server`]
    /// (none until [`Nats::connect_each`]).
    each: OnceLock<Vec<async_nats::Client>>,
}

/// The control buckets' bound until [`Nats::set_control_timeout`]: JetStream's
/// own request timeout.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

impl Nats {
    /// Connect to any of `urls` (a client reconnects among the servers it learns
    /// of), naming the connection `name`.
    pub async fn connect(urls: &[String], name: &str) -> Result<Arc<Nats>, LogError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("turnd-nats")
            .enable_all()
            .build()
            .map_err(|e| LogError::Config(format!("start the NATS runtime: {e}")))?;
        let opts = reconnecting(name).event_callback(|event| async move {
            match event {
                async_nats::Event::Connected => tracing::info!("NATS connected"),
                async_nats::Event::Disconnected => tracing::warn!("NATS disconnected"),
                e => tracing::debug!("NATS: {e}"),
            }
        });
        let client = connect_on(rt.handle(), urls, opts).await?;
        let js = jetstream::new(client.clone());
        Ok(Arc::new(Nats {
            client,
            js,
            rt: Runtime(Some(rt)),
            control_ms: AtomicU64::new(CONTROL_TIMEOUT.as_millis() as u64),
            each: OnceLock::new(),
        }))
    }

    /// Hold a connection to each of `urls` besides the main one, each kept to its
    /// own server (it reconnects to that server alone), so that [`Nats::on_server`]
    /// finds the one to a server by its name: a partition's appends go to its
    /// stream's leader without a hop through another server. The connections are
    /// made in the background: one to a server that is down now is made when it is
    /// back, and until then the main connection carries what it would have.
    pub async fn connect_each(&self, urls: &[String], name: &str) -> Result<(), LogError> {
        let Some(rt) = &self.rt.0 else {
            unreachable!("the runtime lives as long as its Nats")
        };
        let mut made = Vec::with_capacity(urls.len());
        for url in urls {
            // With `retry_on_initial_connect` the connect returns at once.
            let opts = reconnecting(&format!("{name}-direct"))
                .ignore_discovered_servers()
                .retry_on_initial_connect()
                .event_callback(move |event| async move {
                    tracing::debug!("NATS (a server's own connection): {event}");
                });
            made.push(connect_on(rt.handle(), std::slice::from_ref(url), opts).await?);
        }
        self.each
            .set(made)
            .map_err(|_| LogError::Config("the connections to each server are made once".into()))
    }

    /// A connection up now to the server named `server`: the main one when it is
    /// on that server, else the one [`Nats::connect_each`] holds to it.
    pub fn on_server(&self, server: &str) -> Option<async_nats::Client> {
        let up = |c: &async_nats::Client| {
            c.connection_state() == async_nats::connection::State::Connected
                && c.server_info().server_name == server
        };
        if up(&self.client) {
            return Some(self.client.clone());
        }
        self.each.get()?.iter().find(|c| up(c)).cloned()
    }

    /// Bound each request to the control buckets (a lease's renewal or take, a
    /// membership's write or read) by `limit`. A request to a stream with no leader
    /// (JetStream electing one after a server died) is answered by nobody: it waits
    /// out its whole bound, and the next try starts only then. A node's loop, which
    /// tries again every third of a lease, sets the bound to that period, so that
    /// it gets through within about one period of JetStream's election rather than
    /// within the default 5 s.
    pub fn set_control_timeout(&self, limit: Duration) {
        self.control_ms
            .store(limit.as_millis().max(1) as u64, Ordering::Relaxed);
    }

    /// The keys of KV bucket `bucket` whose subjects match `filter` (after the
    /// bucket's `$KV.<bucket>.` prefix: `>`, `p3.*`), read from its stream's info:
    /// one request answered by the stream's leader, where a listing by a reader of
    /// the stream (`kv::Store::keys`) takes seconds while a server is down. A
    /// deleted key is listed too (its delete marker is a message): read each entry.
    pub async fn bucket_keys(&self, bucket: &str, filter: &str) -> Result<Vec<String>, LogError> {
        let prefix = format!("$KV.{bucket}.");
        let what = format!("list the keys of {bucket}");
        let stream = self
            .js
            .get_stream(format!("KV_{bucket}"))
            .await
            .map_err(|e| LogError::nats(&what, e))?;
        let mut subjects = stream
            .info_with_subjects(format!("{prefix}{filter}"))
            .await
            .map_err(|e| LogError::nats(&what, e))?;
        let mut keys = Vec::new();
        while let Some(s) = subjects.next().await {
            let (subject, _) = s.map_err(|e| LogError::nats(&what, e))?;
            if let Some(k) = subject.strip_prefix(&prefix) {
                keys.push(k.to_string());
            }
        }
        keys.sort();
        Ok(keys)
    }

    /// Run `request` (to a control bucket) within the control bound; an error
    /// naming `what` when it is not answered by then (its outcome is unknown).
    pub(crate) async fn control<T>(
        &self,
        what: &str,
        request: impl Future<Output = T>,
    ) -> Result<T, LogError> {
        let limit = Duration::from_millis(self.control_ms.load(Ordering::Relaxed));
        tokio::time::timeout(limit, request)
            .await
            .map_err(|_| LogError::nats(what, format!("no answer within {limit:?}")))
    }

    /// [`Nats::connect`] from a thread outside any runtime.
    pub fn connect_blocking(urls: &[String], name: &str) -> Result<Arc<Nats>, LogError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| LogError::Config(format!("start a runtime: {e}")))?;
        rt.block_on(Nats::connect(urls, name))
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The largest message the server takes (payload and headers).
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// Bind the KV bucket `name`, making it (file storage on `replicas` servers, one
    /// value per key) when there is none.
    pub async fn bucket(
        &self,
        name: &str,
        replicas: usize,
    ) -> Result<jetstream::kv::Store, LogError> {
        if let Ok(kv) = self.js.get_key_value(name).await {
            return Ok(kv);
        }
        self.js
            .create_key_value(jetstream::kv::Config {
                bucket: name.into(),
                history: 1,
                num_replicas: replicas,
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| LogError::nats(&format!("make the bucket {name}"), e))
    }

    /// Run `f` on this connection's runtime and wait for it, from a thread outside
    /// any runtime (the store's committer and applier).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        match &self.rt.0 {
            Some(rt) => rt.block_on(f),
            None => unreachable!("the runtime lives as long as its Nats"),
        }
    }

    /// Spawn `f` on this connection's runtime.
    pub fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.rt.0 {
            Some(rt) => rt.spawn(f),
            None => unreachable!("the runtime lives as long as its Nats"),
        }
    }
}
