//! `turnd serve` and `turnd check-config`.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use tokio_util::sync::CancellationToken;
use turnd_server::config::{LogFormat, StorageSync};
use turnd_server::{open_store, Config, Daemon, Listeners};

/// Where the configuration comes from.
#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// TOML config file; without it the embedded defaults apply.
    #[arg(long, short = 'c', env = "TURND_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration (tokens redacted).
    #[arg(long)]
    pub dump_config: bool,
}

#[derive(Args, Debug)]
pub struct CheckConfigArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Fail (exit 2) when the file or the environment has keys turnd does not know,
    /// such as a misspelt `listen_addr`; without it they are reported and the check
    /// passes, as `serve` starts with them ignored.
    #[arg(long)]
    pub strict: bool,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// WebSocket listen address (overrides server.listen); port 0 picks a free port.
    #[arg(long)]
    pub listen: Option<String>,
    /// Admin HTTP listen address (overrides server.admin_listen).
    #[arg(long)]
    pub admin_listen: Option<String>,
    /// Data directory (overrides storage.data_dir).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Once serving, write {"ws": …, "admin": …, "pid": …} here (and "iii": … when the iii endpoint is on).
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    /// Log format: text or json (overrides log.format).
    #[arg(long)]
    pub log_format: Option<String>,
}

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// Show the cluster as its NATS servers hold it: the members, and each
    /// partition's leader, epoch, lease, stream position and standbys' lag.
    ///
    /// Reads the [cluster] table of the config (--config, TURND_CONFIG, TURND_*);
    /// needs no running node. Exit 0, or 2 when the table is missing or NATS
    /// cannot be read.
    Status {
        #[command(flatten)]
        config: ConfigArgs,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
}

/// `turnd cluster …`.
pub fn cluster(c: ClusterCommand) -> i32 {
    let ClusterCommand::Status { config, json } = c;
    let (cfg, _) = match load(&config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let Some(cluster) = cfg.cluster else {
        eprintln!("turnd: the configuration has no [cluster] table");
        return 2;
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("turnd: start a runtime: {e}");
            return 2;
        }
    };
    match rt.block_on(turnd_server::cluster::view::read(&cluster)) {
        Ok(v) if json => match serde_json::to_string_pretty(&v) {
            Ok(t) => {
                println!("{t}");
                0
            }
            Err(e) => {
                eprintln!("turnd: {e}");
                2
            }
        },
        Ok(v) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            print!("{}", turnd_server::cluster::view::render(&v, now));
            0
        }
        Err(e) => {
            eprintln!("turnd: cluster status: {e:#}");
            2
        }
    }
}

/// Load the configuration, printing a warning for each unknown key; returns it with
/// the number of unknown keys.
fn load(args: &ConfigArgs) -> Result<(Config, usize), i32> {
    match Config::load(args.config.as_deref(), std::env::vars()) {
        Ok(l) => {
            for w in &l.warnings {
                eprintln!("turnd: warning: {w}");
            }
            Ok((l.config, l.warnings.len()))
        }
        Err(e) => {
            eprintln!("turnd: {e}");
            Err(2)
        }
    }
}

pub fn check_config(args: CheckConfigArgs) -> i32 {
    let (cfg, unknown) = match load(&args.config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Err(e) = cfg.validate() {
        eprintln!("turnd: {e}");
        return 2;
    }
    if let Some(problem) = data_dir_problem(&cfg.storage.data_dir) {
        eprintln!("turnd: {problem}");
        return 2;
    }
    if unknown > 0 && args.strict {
        eprintln!(
            "turnd: the configuration has {unknown} unknown key(s), listed above; \
             --strict refuses them (fix or remove them)"
        );
        return 2;
    }
    if args.config.dump_config {
        print!("{}", cfg.to_toml_redacted());
    } else if unknown == 0 {
        println!("configuration ok");
    } else {
        println!(
            "configuration valid, but {unknown} unknown key(s) are ignored (listed on stderr); \
             check their spelling, or run with --strict to refuse them"
        );
    }
    0
}

/// Whether text logs on stderr get ANSI colour codes: only on a terminal, and not
/// when `NO_COLOR` is set to anything (<https://no-color.org>).
pub fn log_colours() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn init_tracing(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TURND_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cfg.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(log_colours())
        .with_writer(std::io::stderr);
    match cfg.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

pub fn serve(args: ServeArgs) -> i32 {
    let mut cfg = match load(&args.config) {
        Ok((c, _)) => c,
        Err(code) => return code,
    };
    if let Some(l) = &args.listen {
        cfg.server.listen = l.clone();
    }
    if let Some(l) = &args.admin_listen {
        cfg.server.admin_listen = l.clone();
    }
    if let Some(d) = &args.data_dir {
        cfg.storage.data_dir = d.clone();
    }
    if let Some(f) = &args.log_format {
        cfg.set_log_format(f);
    }
    if let Err(e) = cfg.validate() {
        eprintln!("turnd: {e}");
        return 2;
    }
    if args.config.dump_config {
        print!("{}", cfg.to_toml_redacted());
    }
    init_tracing(&cfg);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("turnd: failed to start the runtime: {e}");
            return 1;
        }
    };
    let json_logs = match cfg.log.format {
        LogFormat::Json => true,
        LogFormat::Text => false,
    };
    match rt.block_on(run(cfg, args.ready_file)) {
        Ok(()) => 0,
        Err(e) => {
            // Once: as a log record where stderr carries JSON records (a plain line
            // would break their parsers), else as one plain line.
            if json_logs {
                tracing::error!("failed to serve: {e:#}");
            } else {
                eprintln!("turnd: {e:#}");
            }
            1
        }
    }
}

async fn run(cfg: Config, ready_file: Option<PathBuf>) -> anyhow::Result<()> {
    match cfg.storage.sync {
        StorageSync::Never => tracing::warn!("storage.sync = \"never\": acknowledged writes can be lost on a crash; use only for tests and benchmarks"),
        StorageSync::Always => {}
    }
    // Take over SIGTERM/SIGINT before anything can report readiness, so a signal
    // right after READY starts a graceful shutdown instead of killing the process.
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let int = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    // Claim the data directory first: a second daemon on it is told so, whatever
    // else (such as its ports) would also fail.
    let _claim = claim_data_dir(&cfg.storage.data_dir)?;
    // Bind before the heavy work (opening and recovering the store).
    let listeners = Listeners::bind(&cfg).await?;
    let daemon = if cfg.cluster.is_some() {
        Daemon::start_cluster(cfg, listeners).await?
    } else {
        let kv = open_store(&cfg)?;
        Daemon::start(cfg, listeners, kv).await?
    };
    let line = format!(
        "turnd listening on {} admin {} (operator page {}/ui)",
        daemon.ws_url(),
        daemon.admin_url(),
        daemon.admin_url()
    );
    println!("{line}");
    tracing::info!("{line}");
    if let Some(url) = daemon.iii_url() {
        tracing::info!("iii endpoint listening on {url}");
    }
    if let Some(path) = &ready_file {
        let mut body = serde_json::json!({
            "ws": daemon.ws_url(),
            "admin": daemon.admin_url(),
            "pid": std::process::id(),
        });
        if let (Some(url), Some(o)) = (daemon.iii_url(), body.as_object_mut()) {
            o.insert("iii".into(), url.into());
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, body.to_string())
            .with_context(|| format!("write {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("write {}", path.display()))?;
    }
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::debug!("sd_notify READY not sent: {e}");
    }
    let shutdown = daemon.shutdown_token();
    if let Some(engine) = daemon.engine() {
        crate::watchdog::spawn(engine.store().kv().clone(), shutdown.clone());
    }
    tokio::spawn(watch_signals(shutdown, term, int));
    daemon.join().await?;
    if let Some(path) = &ready_file {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::debug!("remove ready file: {e}");
        }
    }
    Ok(())
}

/// Why `serve`, run as this user, could not use `dir` as its data directory, if it
/// could not: `serve` creates the directory when it is missing and writes in it, so
/// it must be a directory this user may write in and enter, or be missing under a
/// nearest existing ancestor that is one. `check-config` runs as the service's user
/// (the unit's `ExecStartPre`), so this is the service's view.
fn data_dir_problem(dir: &Path) -> Option<String> {
    use rustix::fs::{access, Access};
    let shown = dir.display();
    let writable = |p: &Path| access(p, Access::WRITE_OK | Access::EXEC_OK).is_ok();
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Some(format!(
            "storage.data_dir {shown} is not a directory; point it at a directory (it is \
             created when missing)"
        )),
        Ok(_) if !writable(dir) => Some(format!(
            "storage.data_dir {shown} is not writable by this user ({}); give it to the \
             user the daemon runs as",
            user_name()
        )),
        Ok(_) => None,
        Err(e)
            if !matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            Some(format!("storage.data_dir {shown}: {e}"))
        }
        Err(_) => {
            // Missing: `serve` creates it and any missing parents, under the nearest
            // ancestor that exists.
            let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
            let parent = absolute.ancestors().skip(1).find(|a| a.exists())?;
            if !parent.is_dir() {
                Some(format!(
                    "storage.data_dir {shown} cannot be created: {} is not a directory",
                    parent.display()
                ))
            } else if !writable(parent) {
                Some(format!(
                    "storage.data_dir {shown} does not exist and cannot be created: {} is not \
                     writable by this user ({}); create it for the user the daemon runs as",
                    parent.display(),
                    user_name()
                ))
            } else {
                None
            }
        }
    }
}

/// This process's user, for messages: the name when the environment says it, else
/// the numeric uid.
fn user_name() -> String {
    let uid = rustix::process::getuid().as_raw();
    match std::env::var("USER") {
        Ok(name) if !name.is_empty() => format!("{name}, uid {uid}"),
        _ => format!("uid {uid}"),
    }
}

/// The file in the data directory that a running daemon holds an exclusive advisory
/// lock on, and whose content is its pid.
pub const PID_FILE: &str = "turnd.pid";

/// A daemon's claim on its data directory: the locked [`PID_FILE`], released when
/// the process ends (however it ends).
struct DirClaim {
    _file: std::fs::File,
}

/// Create `dir` and whichever directories above it are missing, each made durable
/// in its parent (an fsync of the parent after it was made): the store syncs what it
/// makes inside `dir`, and a directory entry is durable only once its parent is
/// synced, so a power loss soon after a first start could otherwise take the whole
/// data directory with the writes it acknowledged.
fn create_data_dir(dir: &Path) -> std::io::Result<()> {
    let mut made = Vec::new();
    let mut d = Some(dir);
    while let Some(p) = d.filter(|p| !p.as_os_str().is_empty() && !p.exists()) {
        made.push(p);
        d = p.parent();
    }
    std::fs::create_dir_all(dir)?;
    for p in made {
        let parent = match p.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// Claim `dir` for this process, or say which process holds it.
fn claim_data_dir(dir: &Path) -> anyhow::Result<DirClaim> {
    create_data_dir(dir).with_context(|| format!("create the data directory {}", dir.display()))?;
    let path = dir.join(PID_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            anyhow::bail!(
                "another turnd holds {} (pid {}); stop it first, or give this one another \
                 --data-dir",
                dir.display(),
                holder_pid(&mut file)
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(anyhow::Error::new(e).context(format!("lock {}", path.display())));
        }
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .with_context(|| format!("write {}", path.display()))?;
    Ok(DirClaim { _file: file })
}

/// The pid a [`PID_FILE`] names, or "unknown".
fn holder_pid(file: &mut std::fs::File) -> String {
    let mut s = String::new();
    match file.read_to_string(&mut s) {
        Ok(_) if s.trim().parse::<u32>().is_ok() => s.trim().to_string(),
        _ => "unknown".to_string(),
    }
}

/// The pid in `dir`'s [`PID_FILE`], when one is there.
pub fn data_dir_holder(dir: &Path) -> Option<String> {
    let mut file = std::fs::File::open(dir.join(PID_FILE)).ok()?;
    Some(holder_pid(&mut file)).filter(|p| p != "unknown")
}

/// First SIGTERM/SIGINT: graceful shutdown. Second: exit at once.
async fn watch_signals(
    shutdown: CancellationToken,
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("signal received: shutting down gracefully (send it again to exit at once)");
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Stopping]) {
        tracing::debug!("sd_notify STOPPING not sent: {e}");
    }
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    eprintln!("turnd: second signal: exiting now");
    std::process::exit(130);
}
