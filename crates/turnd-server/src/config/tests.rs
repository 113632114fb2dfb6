//! The config's own tests: layering, warnings, every problem at once.

use std::path::Path;

use super::*;

#[test]
fn layers_and_warnings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("t.toml");
    std::fs::write(
        &f,
        "[server]\nheartbeat_ms = 250\nbogus = 1\n[turns]\ndispatch_timeout_ms = 900\n",
    )
    .expect("write");
    let env = vec![
        (
            "TURND_TURNS__PROBE_TIMEOUT_MS".to_string(),
            "77".to_string(),
        ),
        ("TURND_STORAGE__DATA_DIR".to_string(), "/tmp/x".to_string()),
        ("TURND_NOPE__X".to_string(), "1".to_string()),
        ("HOME".to_string(), "/root".to_string()),
    ];
    let l = Config::load(Some(&f), env).expect("loads");
    assert_eq!(l.config.server.heartbeat_ms, 250);
    assert_eq!(l.config.turns.probe_timeout_ms, 77);
    assert_eq!(l.config.turns.dispatch_timeout_ms, Some(900));
    assert_eq!(l.config.storage.data_dir, PathBuf::from("/tmp/x"));
    assert_eq!(l.config.turns.reconnect_grace_ms, 10_000);
    assert_eq!(l.warnings.len(), 2, "{:?}", l.warnings);
    l.config.validate().expect("valid");
}

/// `storage.window_ms` left unset follows `retention.terminal_ms` (a 24th of it,
/// 10 s to 1 h); set, in a file or the environment, it is taken as it is, without
/// an unknown-key warning. The store is opened with the length in effect, and the
/// printed config shows it.
#[test]
fn window_ms_follows_the_retention_unless_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let window = |file: &str, env: &[(&str, &str)]| {
        let f = dir.path().join("w.toml");
        std::fs::write(&f, file).expect("write");
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let l = Config::load(Some(&f), env).expect("loads");
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        l.config.validate().expect("valid");
        let opened = crate::store_options(&l.config).expect("options");
        assert_eq!(opened.windows.window_ms, l.config.window_ms());
        l.config
    };
    let retention = |ms: &str| format!("[retention]\nterminal_ms = {ms}\n");
    // The defaults: 72 h of retention, so the 1 h cap.
    assert_eq!(window("", &[]).window_ms(), 3_600_000);
    assert_eq!(window(&retention("3600000"), &[]).window_ms(), 150_000);
    assert_eq!(window(&retention("60000"), &[]).window_ms(), 10_000);
    // Turns kept for good.
    assert_eq!(window(&retention("0"), &[]).window_ms(), 3_600_000);
    // Set: as it is, 0 (no windows) included.
    let set = format!("{}[storage]\nwindow_ms = 0\n", retention("3600000"));
    assert_eq!(window(&set, &[]).window_ms(), 0);
    let env = [("TURND_STORAGE__WINDOW_MS", "5000")];
    let c = window(&retention("3600000"), &env);
    assert_eq!(c.window_ms(), 5_000);
    assert!(window(&retention("3600000"), &[])
        .to_toml_redacted()
        .contains("window_ms = 150000"));
    assert!(c.to_toml_redacted().contains("window_ms = 5000"));
}

/// `storage.window_close_ms` is 0 (windows stay open) or at least 100 ms: a
/// shorter time would close and open old windows all the time.
#[test]
fn window_close_ms_is_zero_or_at_least_100() {
    let validated = |ms: &str| {
        let env = vec![("TURND_STORAGE__WINDOW_CLOSE_MS".to_string(), ms.to_string())];
        Config::load(None, env).and_then(|l| l.config.validate().map(|()| l.config))
    };
    for ok in ["0", "100", "60000"] {
        assert!(validated(ok).is_ok(), "{ok}");
    }
    for bad in ["1", "99"] {
        match validated(bad) {
            Err(e) => assert!(e.to_string().contains("storage.window_close_ms"), "{e}"),
            Ok(_) => panic!("window_close_ms = {bad} accepted"),
        }
    }
}

/// The hours key of earlier versions is refused, naming the key that replaced it
/// and the value to write, from a file and from the environment alike.
#[test]
fn the_old_retention_key_is_refused_with_its_replacement() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("t.toml");
    std::fs::write(&f, "[retention]\nterminal_hours = 24\n").expect("write");
    let load = |file: Option<&Path>, env: Vec<(String, String)>| {
        Config::load(file, env).and_then(|l| l.config.validate().map(|()| l))
    };
    let msg = match load(Some(&f), Vec::new()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("terminal_hours accepted"),
    };
    assert!(
        msg.contains("retention.terminal_ms") && msg.contains("86400000"),
        "{msg}"
    );
    let env = vec![(
        "TURND_RETENTION__TERMINAL_HOURS".to_string(),
        "1".to_string(),
    )];
    let msg = match load(None, env) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("terminal_hours accepted"),
    };
    assert!(msg.contains("terminal_ms = 3600000"), "{msg}");
    let ok = vec![(
        "TURND_RETENTION__TERMINAL_MS".to_string(),
        "5000".to_string(),
    )];
    let loaded = load(None, ok).expect("terminal_ms loads");
    assert_eq!(loaded.config.engine_config().retention_terminal_ms, 5000);
}

/// The SDK-only key of earlier versions is refused with a message that says
/// where a worker's resend interval is set, from a file and from the environment.
#[test]
fn the_dead_result_ack_key_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("t.toml");
    std::fs::write(&f, "[turns]\nresult_ack_timeout_ms = 2000\n").expect("write");
    for (file, env) in [
        (Some(f.as_path()), Vec::new()),
        (
            None,
            vec![(
                "TURND_TURNS__RESULT_ACK_TIMEOUT_MS".to_string(),
                "2000".to_string(),
            )],
        ),
    ] {
        let msg = match Config::load(file, env) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("result_ack_timeout_ms accepted"),
        };
        assert!(
            msg.contains("turns.result_ack_timeout_ms")
                && msg.contains("WorkerOptions::result_ack_timeout"),
            "{msg}"
        );
    }
}

/// A value of `storage.sync` or `log.format` that is none of the allowed ones is
/// reported with the config's other problems, naming the allowed values; a good
/// value from the environment replaces a bad one of the file.
#[test]
fn a_bad_choice_is_reported_with_every_other_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("t.toml");
    std::fs::write(
        &f,
        "[storage]\nsync = \"sometimes\"\n[server]\nmax_frame_bytes = 10\n[log]\nformat = 3\n",
    )
    .expect("write");
    let l = Config::load(Some(&f), Vec::new()).expect("loads; validate reports");
    let e = l.config.validate().expect_err("invalid");
    assert_eq!(e.problems.len(), 3, "{e}");
    for want in [
        "storage.sync must be \"always\" or \"never\", not \"sometimes\"",
        "log.format must be \"text\" or \"json\", not 3",
        "server.max_frame_bytes must be at least 1024",
    ] {
        assert!(e.problems.iter().any(|p| p == want), "{want}: {e}");
    }
    let env = vec![("TURND_STORAGE__SYNC".to_string(), "never".to_string())];
    let l = Config::load(Some(&f), env).expect("loads");
    assert_eq!(l.config.storage.sync, StorageSync::Never);
    let e = l.config.validate().expect_err("still invalid");
    assert_eq!(e.problems.len(), 2, "{e}");
}

#[test]
fn validate_reports_every_problem() {
    let mut c = Config::default();
    c.server.listen = "0.0.0.0:7420".into();
    c.set_storage_sync("sometimes");
    c.turns.max_steps = 0;
    let e = c.validate().expect_err("invalid");
    assert_eq!(e.problems.len(), 3, "{e}");
    c.auth.allow_unauthenticated = true;
    c.set_storage_sync("never");
    c.turns.max_steps = 5;
    c.validate().expect("valid with allow_unauthenticated");
}

/// `[cluster]` is off unless the table is there; its keys are known keys (no
/// warning), settable from the environment, and validated with the rest.
#[test]
fn the_cluster_table_is_off_unless_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let l = Config::load(None, Vec::<(String, String)>::new()).expect("loads");
    assert_eq!(l.config.cluster, None);
    assert!(!l.config.to_toml_redacted().contains("[cluster]"));
    let f = dir.path().join("c.toml");
    std::fs::write(
        &f,
        "[cluster]\nnode_id = \"n1\"\nnats = [\"nats://127.0.0.1:4222\"]\npartitions = 8\nlease_ms = 900\n",
    )
    .expect("write");
    let env = vec![("TURND_CLUSTER__STANDBYS".to_string(), "2".to_string())];
    let l = Config::load(Some(&f), env).expect("loads");
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
    let c = l.config.cluster.clone().expect("the table");
    assert_eq!(
        (
            c.node_id.as_str(),
            c.partitions,
            c.lease_ms,
            c.standbys,
            c.replicas
        ),
        ("n1", 8, 900, 2, 3)
    );
    l.config.validate().expect("valid");
    assert!(l.config.to_toml_redacted().contains("[cluster]"));
    // A table with a misspelt key: the warning names the key meant, and the
    // missing servers are a problem.
    std::fs::write(&f, "[cluster]\nnode_id = \"n1\"\nnats_urls = []\n").expect("write");
    let l = Config::load(Some(&f), Vec::<(String, String)>::new()).expect("loads");
    assert_eq!(
        l.warnings,
        vec!["unknown config key cluster.nats_urls ignored; did you mean cluster.nats?"]
    );
    let e = l.config.validate().expect_err("no servers");
    assert!(e.to_string().contains("cluster.nats must list"), "{e}");
}
