//! The cluster a fault schedule runs on: three `nats-server` (R=3, `sync_interval:
//! always`, not advertising each other to clients) and three `turnd` nodes, each
//! node's NATS connections through a TCP proxy per server so that a node can be cut
//! from NATS; and a worker connected to every node that records every invocation
//! it runs. Every process is started here and ended by its PID.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use turnd_client::{FunctionSpec, Worker, WorkerHandle};
use turnd_cluster::testing::{Rig, RigOptions};
use turnd_proto::Outcome;
use turnd_testkit::TcpProxy;
use turnd_tests::cluster::{all_led, signal, start_node};
use turnd_tests::{worker_options, BinDaemon};

use crate::checker::{History, Run};

/// How a node is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    Up,
    Down,
    Paused,
    Cut,
}

pub struct Cluster {
    pub rig: Rig,
    root: tempfile::TempDir,
    /// Per node, one proxy per NATS server.
    proxies: Vec<Vec<TcpProxy>>,
    nodes: Vec<Option<BinDaemon>>,
    pub state: Vec<NodeState>,
    /// Each node's WebSocket address (kept across restarts) and admin URL.
    listen: Vec<String>,
    pub urls: Vec<String>,
    admins: Vec<String>,
}

/// The node names.
pub const NAMES: [&str; 3] = ["n0", "n1", "n2"];

impl Cluster {
    pub async fn start() -> anyhow::Result<Cluster> {
        let opts = RigOptions {
            no_advertise: true,
            ..RigOptions::default()
        };
        let rig = Rig::start_with(3, opts).await.map_err(anyhow::Error::msg)?;
        let root = tempfile::Builder::new().prefix("turnd-faults-").tempdir()?;
        let mut c = Cluster {
            rig,
            root,
            proxies: Vec::new(),
            nodes: Vec::new(),
            state: vec![NodeState::Up; 3],
            listen: Vec::new(),
            urls: Vec::new(),
            admins: Vec::new(),
        };
        for i in 0..3 {
            let mut ps = Vec::new();
            for j in 0..3 {
                let up = format!("127.0.0.1:{}", c.rig.client_port(j)).parse()?;
                ps.push(TcpProxy::start(up).await?);
            }
            c.proxies.push(ps);
            let n = c.spawn(i, "127.0.0.1:0").await?;
            let listen = n
                .url
                .trim_start_matches("ws://")
                .trim_end_matches("/v1")
                .to_string();
            c.listen.push(listen);
            c.urls.push(n.url.clone());
            c.admins.push(n.admin.clone());
            c.nodes.push(Some(n));
        }
        eprintln!(
            "cluster: nats-server pids {:?}, turnd pids {:?}",
            c.rig.pids(),
            c.pids()
        );
        Ok(c)
    }

    async fn spawn(&self, i: usize, listen: &str) -> anyhow::Result<BinDaemon> {
        let nats: Vec<String> = self.proxies[i]
            .iter()
            .map(|p| format!("nats://turnd:turnd@{}", p.addr()))
            .collect();
        // Two system-account URLs, so that a node starts while one server is down.
        let sys = format!("{},{}", self.rig.sys_url(i), self.rig.sys_url((i + 1) % 3));
        start_node(self.root.path(), i, &nats, &sys, listen).await
    }

    pub fn pids(&self) -> Vec<Option<u32>> {
        self.nodes
            .iter()
            .map(|n| n.as_ref().and_then(|n| n.child.id()))
            .collect()
    }

    fn pid(&self, i: usize) -> anyhow::Result<u32> {
        self.pids()[i].with_context(|| format!("n{i} is not running"))
    }

    /// Each node's data directory.
    pub fn roots(&self) -> Vec<PathBuf> {
        (0..3).map(|i| self.root.path().join(NAMES[i])).collect()
    }

    /// An admin URL of a node that answers (up, not paused nor cut).
    pub fn admin(&self) -> anyhow::Result<&str> {
        (0..3)
            .find(|i| self.state[*i] == NodeState::Up)
            .map(|i| self.admins[i].as_str())
            .context("no node is up")
    }

    /// A WebSocket URL of a node that is up.
    pub fn url(&self) -> anyhow::Result<&str> {
        (0..3)
            .find(|i| self.state[*i] == NodeState::Up)
            .map(|i| self.urls[i].as_str())
            .context("no node is up")
    }

    /// kill -9 node `i`.
    pub async fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(n) = self.nodes[i].take() {
            eprintln!("faults: kill -9 n{i} (pid {:?})", n.child.id());
            n.kill().await?;
        }
        self.state[i] = NodeState::Down;
        Ok(())
    }

    /// SIGTERM node `i` (it drains) and wait for its exit.
    pub async fn terminate(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(n) = self.nodes[i].take() {
            eprintln!("faults: SIGTERM n{i} (pid {:?})", n.child.id());
            self.state[i] = NodeState::Down;
            let status = n.terminate().await?;
            if !status.success() {
                bail!("n{i} drained and exited {status}");
            }
        }
        Ok(())
    }

    /// Start node `i` again on its data, at its address.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let listen = self.listen[i].clone();
        let n = self.spawn(i, &listen).await?;
        eprintln!("faults: restarted n{i} as pid {:?}", n.child.id());
        self.admins[i] = n.admin.clone();
        self.nodes[i] = Some(n);
        self.state[i] = NodeState::Up;
        Ok(())
    }

    pub fn pause(&mut self, i: usize) -> anyhow::Result<()> {
        eprintln!("faults: SIGSTOP n{i}");
        signal(self.pid(i)?, "STOP")?;
        self.state[i] = NodeState::Paused;
        Ok(())
    }

    pub fn resume(&mut self, i: usize) -> anyhow::Result<()> {
        eprintln!("faults: SIGCONT n{i}");
        signal(self.pid(i)?, "CONT")?;
        self.state[i] = NodeState::Up;
        Ok(())
    }

    /// Cut node `i` from every NATS server.
    pub fn cut(&mut self, i: usize) {
        eprintln!("faults: cut n{i} from NATS");
        for p in &self.proxies[i] {
            p.cut();
        }
        self.state[i] = NodeState::Cut;
    }

    pub fn heal(&mut self, i: usize) {
        eprintln!("faults: n{i} reaches NATS again");
        for p in &self.proxies[i] {
            p.heal();
        }
        self.state[i] = NodeState::Up;
    }

    /// Wait until every partition is led by a node that is up, as every node that
    /// is up sees it, and every such node is ready (a node back from a cut reaches
    /// NATS again); how long it took.
    pub async fn settled(&self, secs: u64) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let up: Vec<usize> = (0..3).filter(|i| self.state[*i] == NodeState::Up).collect();
        let names: Vec<&str> = up.iter().map(|i| NAMES[*i]).collect();
        all_led(self.admin()?, &names, secs).await?;
        let led = start.elapsed();
        for i in up {
            let left = Duration::from_secs(secs).saturating_sub(start.elapsed());
            all_led(&self.admins[i], &names, left.as_secs().max(1)).await?;
            self.readyz_says(i, "ready", left).await?;
        }
        Ok(led)
    }

    /// Wait (at most `limit`) until node `i`'s `/readyz` says `what`.
    pub async fn readyz_says(&self, i: usize, what: &str, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let said = turnd_tests::http_get(&self.admins[i], "/readyz").await;
            if matches!(&said, Ok((_, body)) if body.trim() == what) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("n{i}'s /readyz did not say {what:?} within {limit:?}: {said:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// kill -9 every node (the end of a run: their stores are then read here).
    pub async fn stop_nodes(&mut self) -> anyhow::Result<()> {
        for i in 0..3 {
            if self.state[i] == NodeState::Paused {
                self.resume(i)?;
            }
            self.kill(i).await?;
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A paused node would not die of its kill-on-drop until continued.
        for i in 0..3 {
            if self.state[i] == NodeState::Paused {
                if let Ok(pid) = self.pid(i) {
                    if let Err(e) = signal(pid, "CONT") {
                        eprintln!("faults: continue n{i}: {e}");
                    }
                }
            }
        }
    }
}

/// A worker serving `echo` on every node: each invocation takes a few
/// milliseconds (so that two of one session would overlap if the cluster let
/// them) and is recorded in `h`.
pub async fn recording_worker(urls: &[String], h: &History) -> WorkerHandle {
    let mut o = worker_options(&urls[0], "w");
    o.also = urls[1..].to_vec();
    let h = h.clone();
    let w = Worker::new(o).function(FunctionSpec::new("echo").concurrency(16), move |ctx| {
        let h = h.clone();
        async move {
            let start = Instant::now();
            let ms = 2 + ctx.invoke.invocation_id.bytes().map(u64::from).sum::<u64>() % 12;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            h.ran(Run {
                session: ctx.invoke.session_id.clone(),
                turn_id: ctx.invoke.turn_id.clone(),
                invocation_id: ctx.invoke.invocation_id.clone(),
                start,
                end: Instant::now(),
            });
            Outcome::Complete(ctx.invoke.input.clone())
        }
    });
    let handle = w.spawn(tokio_util::sync::CancellationToken::new());
    handle.connected().await;
    handle
}
