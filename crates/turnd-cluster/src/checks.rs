//! What cluster mode asks of the NATS servers, checked before a node serves: that
//! each can sync a write before it acknowledges it.
//!
//! JetStream syncs before acknowledging only with `jetstream { sync_interval:
//! always }`, which exists from 2.10.0 and which the Raft log of a replicated
//! stream honours from 2.10.23; by default a stream's blocks are synced every two
//! minutes, and acknowledged writes can be lost to a power failure.
//!
//! What a client can learn (nats-server 2.15's source and the 2.15.1 binary):
//!
//! - **The version**, from each server's `INFO` (`version`): checked, by connecting
//!   to every URL given. Below 2.10.23 is refused.
//! - **Whether JetStream is on** (`INFO.jetstream`): checked.
//! - **The sync setting** is not in `INFO`, nor in `$JS.API.INFO` (account limits
//!   and usage only). It is in the server's `varz` under
//!   `jetstream.config.sync_always`, which the monitoring port (`/varz`) and the
//!   system account (`$SYS.REQ.SERVER.PING.VARZ`, every server of the cluster
//!   answers) serve. Checked through a system-account connection when the node has
//!   one: every server that answers must say `sync_always: true`, and the servers
//!   that answer must cover the JetStream cluster (its meta group's size).
//!   Without one it cannot be checked, and counts as not proven.
//!
//! Whatever cannot be proven is refused unless the operator set the explicit unsafe
//! flag; then it is allowed with a warning naming what was not proven.
//!
//! A server that is down does not answer. When a majority of the JetStream cluster
//! answered and every server that answered is proven, the servers missing are
//! *pending*, not refused: a node may start while one server of three is down, and
//! checks the missing ones again ([`check_servers`] once more) until they answer.

use std::time::Duration;

use futures_util::StreamExt;
use serde::Deserialize;

use crate::error::LogError;
use crate::nats::shown;

/// The first version whose replicated streams sync before acknowledging with
/// `sync_interval: always`.
pub const MIN_VERSION: (u64, u64, u64) = (2, 10, 23);

/// How long a check waits for servers.
const WAIT: Duration = Duration::from_secs(3);

/// What was learnt of one server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFacts {
    pub name: String,
    pub version: String,
    pub jetstream: bool,
    /// `jetstream.config.sync_always` as the server reported it (None: not learnt).
    pub sync_always: Option<bool>,
}

/// What the checks found: the servers, and what was not proven safe (empty when
/// everything was).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub servers: Vec<ServerFacts>,
    pub unproven: Vec<String>,
    /// Servers that did not answer while a majority of the cluster did and was
    /// proven: to be checked when they answer.
    pub pending: Vec<String>,
}

/// `major.minor.patch` of a server's version string (`2.15.1`, `v2.10.23-RC.1`).
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let v = v.trim_start_matches('v');
    let core = v.split(['-', '+']).next()?;
    let mut it = core.split('.').map(|n| n.parse::<u64>().ok());
    Some((it.next()??, it.next()??, it.next()??))
}

/// Check the servers at `urls` (each connected to in turn) and, with `sys` (a
/// connection of the system account), their sync setting. Err when no server
/// answers, or when something is not proven safe and `allow_unsafe` is false;
/// servers missing while a proven majority answered are `pending` in the report.
pub async fn check_servers(
    urls: &[String],
    sys: Option<&async_nats::Client>,
    allow_unsafe: bool,
) -> Result<Report, LogError> {
    let (mut servers, unreachable) = server_infos(urls).await;
    if servers.is_empty() {
        return Err(LogError::Nats(format!(
            "no NATS server answered: {}",
            unreachable.join("; ")
        )));
    }
    let mut unproven = Vec::new();
    let mut pending = Vec::new();
    match sys {
        Some(sys) => {
            let heard = sync_settings(sys, &mut servers, &mut unproven).await?;
            let missing = heard.size.saturating_sub(heard.answered);
            let to = if heard.majority() {
                &mut pending
            } else {
                &mut unproven
            };
            if missing > 0 || heard.answered == 0 {
                to.push(format!(
                    "the sync setting of every server ({} of {} answered)",
                    heard.answered,
                    heard.size.max(1)
                ));
            }
            to.extend(unreachable.into_iter().map(|u| format!("server {u}")));
        }
        None => {
            unproven.push(
                "the servers' sync setting (no system-account connection to read their varz)"
                    .into(),
            );
            unproven.extend(unreachable.into_iter().map(|u| format!("server {u}")));
        }
    }
    for s in &servers {
        unproven.extend(judge(s));
    }
    let report = Report {
        servers,
        unproven,
        pending,
    };
    if !report.pending.is_empty() && report.unproven.is_empty() {
        tracing::warn!(
            "NATS: a majority of the servers is proven to sync before it acknowledges; checked again until they answer: {}",
            report.pending.join("; ")
        );
    }
    if report.unproven.is_empty() {
        return Ok(report);
    }
    if allow_unsafe {
        tracing::warn!(
            "NATS not proven to sync before it acknowledges, allowed by the unsafe flag: {}",
            report.unproven.join("; ")
        );
        return Ok(report);
    }
    Err(LogError::Config(format!(
        "NATS is not proven to sync before it acknowledges (set the unsafe flag to run anyway): {}",
        report.unproven.join("; ")
    )))
}

/// What each server at `urls` says of itself (connected to in turn), and the URLs
/// that did not answer, each with why.
async fn server_infos(urls: &[String]) -> (Vec<ServerFacts>, Vec<String>) {
    let mut servers = Vec::new();
    let mut unreachable = Vec::new();
    for url in urls {
        let c = match tokio::time::timeout(WAIT, crate::nats::connect_one(url)).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                unreachable.push(format!("{}: {e}", shown(url)));
                continue;
            }
            Err(_) => {
                unreachable.push(format!("{}: timed out", shown(url)));
                continue;
            }
        };
        let info = c.server_info();
        servers.push(ServerFacts {
            name: info.server_name.clone(),
            version: info.version.clone(),
            jetstream: info.jetstream,
            sync_always: None,
        });
        if let Err(e) = c.drain().await {
            tracing::debug!("close the check's connection to {}: {e}", shown(url));
        }
    }
    (servers, unreachable)
}

/// What is not proven safe of one server.
fn judge(s: &ServerFacts) -> Vec<String> {
    let mut out = Vec::new();
    match parse_version(&s.version) {
        Some(v) if v >= MIN_VERSION => {}
        _ => out.push(format!(
            "server {} is nats-server {} (2.10.23 or later syncs a replicated stream before it acknowledges)",
            s.name, s.version
        )),
    }
    if !s.jetstream {
        out.push(format!("server {} has JetStream off", s.name));
    }
    if s.sync_always == Some(false) {
        out.push(format!(
            "server {} does not sync before it acknowledges (set jetstream {{ sync_interval: always }})",
            s.name
        ));
    }
    out
}

#[derive(Deserialize)]
struct VarzReply {
    server: VarzServer,
    data: Option<Varz>,
}

#[derive(Deserialize)]
struct VarzServer {
    name: String,
}

#[derive(Deserialize)]
struct Varz {
    version: String,
    jetstream: Option<VarzJs>,
}

#[derive(Deserialize)]
struct VarzJs {
    config: Option<VarzJsConfig>,
    meta: Option<VarzMeta>,
}

#[derive(Deserialize)]
struct VarzJsConfig {
    #[serde(default)]
    sync_always: bool,
}

#[derive(Deserialize)]
struct VarzMeta {
    #[serde(default)]
    cluster_size: usize,
}

/// How many servers answered a varz request, of the JetStream cluster's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Heard {
    answered: usize,
    size: usize,
}

impl Heard {
    /// Whether more than half of the cluster answered.
    fn majority(self) -> bool {
        self.answered > 0 && self.answered * 2 > self.size
    }
}

/// Ask every server for its varz over the system account, and note each one's
/// sync setting in `servers` (adding those not connected to by URL); a server
/// that answered without its setting is `unproven`.
async fn sync_settings(
    sys: &async_nats::Client,
    servers: &mut Vec<ServerFacts>,
    unproven: &mut Vec<String>,
) -> Result<Heard, LogError> {
    let inbox = sys.new_inbox();
    let mut sub = sys
        .subscribe(inbox.clone())
        .await
        .map_err(|e| LogError::nats("subscribe for varz", e))?;
    sys.publish_with_reply("$SYS.REQ.SERVER.PING.VARZ", inbox, "{}".into())
        .await
        .map_err(|e| LogError::nats("ask for varz", e))?;
    let mut cluster_size = 0;
    let mut answered = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    while let Ok(Some(m)) = tokio::time::timeout_at(deadline, sub.next()).await {
        let Ok(r) = serde_json::from_slice::<VarzReply>(&m.payload) else {
            continue;
        };
        let Some(data) = r.data else { continue };
        answered += 1;
        let js = data.jetstream.as_ref();
        let sync = js.and_then(|j| j.config.as_ref()).map(|c| c.sync_always);
        cluster_size = cluster_size.max(
            js.and_then(|j| j.meta.as_ref())
                .map_or(0, |m| m.cluster_size),
        );
        match servers.iter_mut().find(|s| s.name == r.server.name) {
            Some(s) => s.sync_always = sync,
            None => servers.push(ServerFacts {
                name: r.server.name,
                version: data.version,
                jetstream: js.is_some(),
                sync_always: sync,
            }),
        }
        if cluster_size > 0 && answered >= cluster_size {
            break;
        }
    }
    for s in servers.iter().filter(|s| s.sync_always.is_none()) {
        unproven.push(format!("the sync setting of server {}", s.name));
    }
    Ok(Heard {
        answered,
        size: cluster_size.max(answered),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_the_floor_is_2_10_23() {
        assert_eq!(parse_version("2.15.1"), Some((2, 15, 1)));
        assert_eq!(parse_version("v2.10.23-RC.1"), Some((2, 10, 23)));
        assert_eq!(parse_version("2.9"), None);
        let s = |v: &str| ServerFacts {
            name: "n".into(),
            version: v.into(),
            jetstream: true,
            sync_always: Some(true),
        };
        assert_eq!(judge(&s("2.10.23")), Vec::<String>::new());
        assert_eq!(judge(&s("2.10.22")).len(), 1);
        assert_eq!(judge(&s("2.9.10")).len(), 1);
    }

    #[test]
    fn a_majority_is_more_than_half_and_urls_lose_their_password() {
        let h = |answered, size| Heard { answered, size }.majority();
        assert!(h(2, 3));
        assert!(h(1, 1));
        assert!(!h(1, 3));
        assert!(!h(2, 4));
        assert!(!h(0, 0));
        assert_eq!(
            shown("nats://sys:secret@10.0.0.1:4222"),
            "nats://10.0.0.1:4222"
        );
        assert_eq!(shown("nats://10.0.0.1:4222"), "nats://10.0.0.1:4222");
        assert_eq!(shown("tls://u:p@w@h:1"), "tls://h:1");
    }
}
