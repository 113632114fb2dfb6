//! The operator page on a node of a cluster, through the real binaries: three
//! nats-server and three turnd nodes on loopback, one of them with an operator token.
//! The page answers on a node under the same access rules as a daemon on its own;
//! its cluster screen names each partition's leader and epoch as `GET /cluster` does;
//! the sessions, turn, workers, go-to and store.check screens read through the node
//! (forwarded to the partitions' leaders, gathered from every partition); the session
//! screen shows a session of a partition the node leads, and names the page of the
//! node that leads any other.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use turnd_client::Caller;
use turnd_cluster::testing::Rig;
use turnd_proto::session_partition;
use turnd_tests::cluster::{
    all_led, echo_worker_named, placed, start_node_with, status, PARTITIONS,
};
use turnd_tests::need_nats;
use turnd_tests::page::{get, http, next_sse, open_feed, Reply};

const OP: &str = "operator-secret-1";

/// Each partition's (leader, epoch) as `GET /cluster` shows it.
fn leaders(st: &serde_json::Value) -> BTreeMap<u64, (String, u64)> {
    st["partitions"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter_map(|p| {
                    Some((
                        p["partition"].as_u64()?,
                        (p["leader"].as_str()?.to_string(), p["epoch"].as_u64()?),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The text of the first `<td class="{class}">` after `<tr data-partition="{p}">`.
fn cell(body: &str, p: u64, class: &str) -> Option<String> {
    let row = body.split(&format!("<tr data-partition=\"{p}\">")).nth(1)?;
    let row = row.split("</tr>").next()?;
    let td = row.split(&format!("<td class=\"{class}\">")).nth(1)?;
    Some(td.split("</td>").next()?.to_string())
}

/// Each partition's (leader, epoch) as the cluster screen shows it.
fn page_leaders(body: &str) -> BTreeMap<u64, (String, u64)> {
    (0..u64::from(PARTITIONS))
        .filter_map(|p| {
            let leader = cell(body, p, "leader")?;
            let epoch = cell(body, p, "epoch num")?.parse().ok()?;
            Some((p, (leader, epoch)))
        })
        .collect()
}

/// The cluster screen of `admin`, read between two reads of `GET /cluster` that
/// agree (a settled cluster), with those leaders; at most 20 s.
async fn screen_beside_status(
    admin: &str,
) -> anyhow::Result<(BTreeMap<u64, (String, u64)>, Reply)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let before = leaders(&status(admin).await?);
        let page = get(admin, "/ui/cluster").await?;
        let after = leaders(&status(admin).await?);
        if before == after && before.len() == PARTITIONS as usize {
            return Ok((before, page));
        }
        if Instant::now() > deadline {
            bail!("the leaders did not hold still: {before:?} then {after:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_the_page_and_its_cluster_screen() -> anyhow::Result<()> {
    need_nats!();
    let rig = Rig::start(3).await.map_err(anyhow::Error::msg)?;
    let root = tempfile::tempdir()?;
    let tokens = format!("[{{ role = \"operator\", token = \"{OP}\" }}]");
    let mut nodes = Vec::new();
    for i in 0..3 {
        let extra: Vec<(&str, &str)> = match i {
            1 => vec![("TURND_AUTH__TOKENS", tokens.as_str())],
            _ => Vec::new(),
        };
        let sys = rig.sys_url(i % 3);
        nodes
            .push(start_node_with(root.path(), i, &rig.urls(), &sys, "127.0.0.1:0", &extra).await?);
    }
    let (n0, n1) = (nodes[0].admin.clone(), nodes[1].admin.clone());
    all_led(&n0, &["n0", "n1", "n2"], 30).await?;
    // The hand-overs that follow the start are over: the leaders it reads stay.
    placed(&n0, &["n0", "n1", "n2"], 30).await?;

    // Access: the guard of a daemon on its own.
    let r = get(&n0, "/ui").await?;
    assert_eq!(r.status, 200, "no tokens: the page answers\n{}", r.body);
    assert!(r.body.contains("n0 of a cluster"), "{}", r.body);
    for path in ["/ui", "/ui/cluster", "/ui/sessions", "/ui/live/cluster"] {
        let r = get(&n1, path).await?;
        assert_eq!(r.status, 401, "{path} without the token\n{}", r.body);
        assert!(r.body.contains(r#"name="token""#), "{path}: a sign-in form");
    }
    let bearer = format!("Bearer {OP}");
    let r = http(&n1, "GET", "/ui/cluster", &[("Authorization", &bearer)], "").await?;
    assert_eq!(r.status, 200, "with the token\n{}", r.body);
    assert!(r.body.contains(r#"<dd id="node-id">n1</dd>"#), "{}", r.body);
    let evil = [("Host", "attacker.example")];
    assert_eq!(http(&n0, "GET", "/ui", &evil, "").await?.status, 403);

    // The cluster screen shows what GET /cluster shows at the same time.
    let (want, page) = screen_beside_status(&n0).await?;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(page_leaders(&page.body), want, "{}", page.body);
    for n in ["n0", "n1", "n2"] {
        assert!(
            page.body.contains(&format!("<tr data-member=\"{n}\">")),
            "member {n}: {}",
            page.body
        );
    }
    // ... and its feed sends it.
    let (code, mut lines) = open_feed(&n0, "/ui/live/cluster", "127.0.0.1").await?;
    assert_eq!(code, 200);
    let (name, data) = tokio::time::timeout(Duration::from_secs(10), next_sse(&mut lines))
        .await
        .context("no refresh within 10 s")??;
    assert_eq!(name, "refresh");
    assert!(data.contains("data-partition=\"0\""), "{data}");
    drop(lines);

    // A session of every partition, waiting for a function no worker serves,
    // submitted through n0; a worker connected to n0 alone.
    let c = Caller::connect(&nodes[0].url, None).await?;
    let mut turns: Vec<(String, turnd_proto::Turn)> = Vec::new();
    for i in 0..1000 {
        let s = format!("page-s{i}");
        let p = session_partition(&s, PARTITIONS);
        if turns
            .iter()
            .any(|(q, _)| session_partition(q, PARTITIONS) == p)
        {
            continue;
        }
        turns.push((s.clone(), c.submit_simple(&s, "nowork", json!(i)).await?));
        if turns.len() == PARTITIONS as usize {
            break;
        }
    }
    let n = turns.len();
    assert_eq!(n, PARTITIONS as usize, "a session of every partition");
    let _worker = echo_worker_named(&[nodes[0].url.clone()], "page-w", 2).await;
    let elsewhere = turns
        .iter()
        .find(|(s, _)| want[&u64::from(session_partition(s, PARTITIONS))].0 != "n0")
        .context("a session led by another node")?;

    let r = get(&n0, "/ui/sessions?order=id").await?;
    assert_eq!(r.status, 200, "{}", r.body);
    let total = format!("<strong>{n}</strong> matching");
    assert!(r.body.contains(&total), "{}", r.body);
    for (s, _) in &turns {
        assert!(
            r.body.contains(&format!("data-session=\"{s}\"")),
            "{s}: {}",
            r.body
        );
    }
    let r = get(&n0, "/ui").await?;
    let active = format!("<dd id=\"active\">{n}</dd>");
    assert!(r.body.contains(&active), "{}", r.body);

    let t = &elsewhere.1.turn_id;
    let r = get(&n0, &format!("/ui/turn?id={t}")).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body.contains(&format!("<span id=\"turn-id\">{t}</span>")),
        "{}",
        r.body
    );
    assert!(
        r.body.contains("<td>admitted</td>"),
        "its timeline: {}",
        r.body
    );
    let r = get(&n0, &format!("/ui/go?id={t}")).await?;
    assert_eq!(r.status, 303, "{}", r.head);
    assert_eq!(get(&n0, "/ui/turn?id=t_nope").await?.status, 404);

    let r = get(&n0, "/ui/workers").await?;
    assert!(r.body.contains("<td>page-w</td>"), "{}", r.body);

    // A session of a partition n0 leads: its screen and feed, from n0's engine.
    let here = turns
        .iter()
        .find(|(s, _)| want[&u64::from(session_partition(s, PARTITIONS))].0 == "n0")
        .context("a session led by n0")?;
    let r = get(&n0, &format!("/ui/session?id={}", here.0)).await?;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body
            .contains(&format!("<span id=\"session-id\">{}</span>", here.0)),
        "{}",
        r.body
    );
    assert!(
        r.body.contains("awaiting_worker"),
        "the holder's wait: {}",
        r.body
    );
    let feed = format!("/ui/session/feed?id={}&after=0", here.0);
    let (code, lines) = open_feed(&n0, &feed, "127.0.0.1").await?;
    assert_eq!(code, 200);
    drop(lines);
    // One another node leads: n0 names that node's page, which shows it.
    let (s, leader) = (
        &elsewhere.0,
        &want[&u64::from(session_partition(&elsewhere.0, PARTITIONS))].0,
    );
    let r = get(&n0, &format!("/ui/session?id={s}")).await?;
    assert_eq!(r.status, 421, "{}", r.body);
    let i: usize = leader.trim_start_matches('n').parse()?;
    let there = format!("{}/ui/session?id={s}", nodes[i].admin);
    assert!(
        r.body
            .contains(&format!("which node {leader} leads: {there}")),
        "{}",
        r.body
    );
    let path = format!("/ui/session?id={s}");
    let r = http(
        &nodes[i].admin,
        "GET",
        &path,
        &[("Authorization", &bearer)],
        "",
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.body);

    let r = http(&n0, "POST", "/ui/check", &[], "").await?;
    assert_eq!(r.status, 303, "{}", r.body);
    let r = get(&n0, "/ui/check").await?;
    assert!(r.body.contains("no violations"), "{}", r.body);
    Ok(())
}
