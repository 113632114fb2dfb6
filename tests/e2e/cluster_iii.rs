//! The iii endpoint on every node of a cluster, through the real binaries: three
//! NATS servers (R=3, `sync_interval: always`) and three turnd nodes on loopback,
//! each with `iii.listen`. A reattach token one node signed verifies on the others
//! (the secret is in the bucket every node shares); iii-sdk's Python worker, keeping
//! a connection to every node, runs calls made through one node on whichever node
//! leads each call's session; a queue defined through one node is the same queue
//! through the others, its messages enqueued through one node run with the queue's
//! retries on their partitions' leaders, and `topic_stats` counts the waiting
//! messages of every partition. Every wait is bounded.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use turnd_cluster::testing::Rig;
use turnd_tests::cluster::{all_led, placed, start_three};
use turnd_tests::{need_nats, BinDaemon};

/// The iii endpoint's URL a node's ready file names.
fn iii_url(n: &BinDaemon) -> anyhow::Result<String> {
    let ready = std::fs::read_to_string(n.data_dir.with_extension("ready.json"))?;
    let v: Value = serde_json::from_str(&ready)?;
    Ok(v["iii"]
        .as_str()
        .context("no iii in the ready file")?
        .to_string())
}

/// The venv's Python beside its nats-server (`make venv` installs iii-sdk there).
fn python() -> Option<PathBuf> {
    let p = Rig::binary()?.parent()?.join("python");
    p.exists().then_some(p)
}

/// Open an iii connection whose first frame is `first`; its `workerregistered`.
async fn registered(url: &str, first: Value) -> anyhow::Result<Value> {
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await?;
    ws.send(Message::text(first.to_string())).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = tokio::time::timeout_at(deadline, ws.next())
            .await
            .context("no workerregistered within 5 s")?
            .context("closed")??;
        if let Message::Text(t) = m {
            let v: Value = serde_json::from_str(t.as_str())?;
            if v["type"] == "workerregistered" {
                return Ok(v);
            }
        }
    }
}

#[tokio::test]
async fn iii_workers_and_callers_use_any_node_of_a_cluster() -> anyhow::Result<()> {
    need_nats!();
    let Some(python) = python() else {
        bail!("no Python beside nats-server: run `make venv`");
    };
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let env = [
        ("TURND_III__LISTEN", "127.0.0.1:0"),
        ("TURND_SERVER__HEARTBEAT_MS", "500"),
    ];
    let nodes = start_three(&rig, root.path(), &env).await?;
    all_led(&nodes[0].admin, &["n0", "n1", "n2"], 30).await?;
    // Partitions that move while an invocation is in flight are the loss rules'
    // (tested elsewhere): start once they are where they stay.
    placed(&nodes[0].admin, &["n0", "n1", "n2"], 30).await?;
    let iii: Vec<String> = nodes.iter().map(iii_url).collect::<Result<_, _>>()?;

    // A token signed by n0 verifies on n1 and n2: the same lineage.
    let first = registered(&iii[0], json!({"type": "registerfunction", "id": "cl::r"})).await?;
    let id = first["worker_id"].as_str().context("worker_id")?;
    let token = first["reattach_token"].as_str().context("token")?;
    for url in &iii[1..] {
        let again = registered(
            url,
            json!({"type": "reattach", "previous_worker_id": id, "reattach_token": token}),
        )
        .await?;
        assert_eq!(again["worker_id"], id, "a reattach on {url}");
        assert_eq!(again["reattach_token"], token);
    }

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("iii/python/cluster_scenario.py");
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(script).args(&iii);
    cmd.args(nodes.iter().map(|n| n.url.clone()));
    cmd.kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .context("the iii scenario ran past 90 s")??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("the iii scenario failed: {stderr}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let seen: Value = serde_json::from_str(stdout.lines().last().context("no output")?)
        .with_context(|| format!("the scenario's output: {stdout}"))?;
    eprintln!("seen: {seen}");

    // Calls made through n1 ran where their sessions are led, n1's or not.
    let vias: Vec<u64> = seen["call_vias"]
        .as_array()
        .context("call_vias")?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(vias.len(), 8);
    assert!(
        vias.iter().any(|v| *v != 1),
        "every call ran on n1 (nothing forwarded): {vias:?}"
    );

    // The queue defined through n1 is the same queue through n2 and n0.
    assert_eq!(seen["define_n1"], json!({"queue": "clq", "changed": true}));
    assert_eq!(seen["define_n2"], json!({"queue": "clq", "changed": false}));
    assert_eq!(
        seen["config_n0"],
        json!({"type": "fifo", "message_group_field": "g", "max_retries": 2, "backoff_ms": 50})
    );
    // Every message ran twice (the queue's retries), on every node that leads.
    let messages = seen["messages"].as_array().context("messages")?;
    assert_eq!(messages.len(), 6);
    for m in messages {
        assert_eq!(m["status"], "completed", "{messages:?}");
    }
    let ran_on: std::collections::BTreeSet<u64> =
        messages.iter().filter_map(|m| m["via"].as_u64()).collect();
    assert!(
        ran_on.iter().any(|v| *v != 2),
        "every message ran on n2, where they were enqueued: {messages:?}"
    );
    // Waiting messages of every partition are counted, through any node.
    assert_eq!(seen["waiting_depth_n1"], 6);

    for n in nodes {
        n.kill().await?;
    }
    drop(rig);
    Ok(())
}
