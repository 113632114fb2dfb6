//! `ui`: N sessions each waiting for a worker of a function nobody serves, then the
//! time to render pages of the operator page (`/ui`) over HTTP and to answer
//! `sessions.list`, each asked `repeat` times one after the other.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;
use turnd_client::turnd_proto::{SessionOrder, SessionsListArgs};
use turnd_client::Caller;
use turnd_server::ui::pct_encode;

use crate::daemon::{callers, close_callers, BenchDaemon, NOBODY};
use crate::measure::{http_get, mb, proc_status_kb, Latencies};
use crate::Common;

/// GET `path` on the admin listener; the status and the body's length.
async fn get(admin: &str, path: &str) -> anyhow::Result<(u16, usize)> {
    let (status, body) = http_get(admin, path).await?;
    Ok((status, body.len()))
}

fn line(what: &str, lat: &mut Latencies, extra: &str) {
    let [p50, p90, p99, max] = lat.summary();
    let f = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    println!(
        "| {what} | {} | {} | {} | {} | {} | {extra} |",
        lat.len(),
        f(p50),
        f(p90),
        f(p99),
        f(max)
    );
}

pub async fn ui(common: &Common, n: usize, inflight: usize, repeat: usize) -> anyhow::Result<()> {
    let tmp = match &common.tmp {
        Some(p) => tempfile::Builder::new()
            .prefix("turnd-bench-")
            .tempdir_in(p)?,
        None => tempfile::Builder::new().prefix("turnd-bench-").tempdir()?,
    };
    let d = BenchDaemon::start(&tmp.path().join("data"), common).await?;
    let admin = d.daemon.admin_url();
    let cs = callers(&d.url, common.callers).await?;
    let rss_before = proc_status_kb("VmRSS");
    let start = Instant::now();
    fill_waiting(&cs, n, inflight).await?;
    let fill = start.elapsed();
    let rss_after = proc_status_kb("VmRSS");
    let total = cs[0]
        .sessions(&SessionsListArgs {
            limit: Some(1),
            ..Default::default()
        })
        .await?
        .total;
    if total != n as u64 {
        bail!("sessions.list counts {total} sessions, {n} were submitted");
    }
    println!(
        "ui: {n} sessions waiting, submitted in {:.1} s; process RSS {} before, {} after",
        fill.as_secs_f64(),
        mb(rss_before),
        mb(rss_after)
    );

    // A cursor half-way through, in wait order.
    let mut args = SessionsListArgs {
        limit: Some(1000),
        ..Default::default()
    };
    for _ in 0..(n / 2000) {
        let p = cs[0].sessions(&args).await?;
        args.after = p.next;
    }
    let middle = args.after.clone().unwrap_or_default();

    time_pages(&admin, &middle, repeat).await?;
    time_lists(&cs[0], repeat).await?;
    close_callers(cs).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    d.shutdown().await
}

/// `n` sessions each with one turn waiting for a worker nobody runs, `inflight`
/// submits at a time.
async fn fill_waiting(cs: &[Arc<Caller>], n: usize, inflight: usize) -> anyhow::Result<()> {
    let mut set = JoinSet::new();
    for s in 0..n {
        while set.len() >= inflight.max(1) {
            if let Some(r) = set.join_next().await {
                r??;
            }
        }
        let caller = cs[s % cs.len()].clone();
        // Two functions, so that the function filter selects half.
        let f = if s % 2 == 0 { NOBODY } else { "nobody.else" };
        set.spawn(async move {
            caller
                .submit_simple(&format!("ui-{s:06}"), f, json!({"s": s}))
                .await
                .map(|_| ())
                .map_err(anyhow::Error::from)
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(())
}

/// Time the operator page's pages, each `repeat` times after one unmeasured request.
async fn time_pages(admin: &str, middle: &str, repeat: usize) -> anyhow::Result<()> {
    println!("\n| request | n | p50 ms | p90 ms | p99 ms | max ms | notes |");
    println!("|---|---|---|---|---|---|---|");
    let pages = [
        (
            "GET /ui/sessions (first 50 rows, oldest wait first)",
            "/ui/sessions".to_string(),
        ),
        (
            "GET /ui/sessions half-way through (cursor at row n/2)",
            format!("/ui/sessions?after={}", pct_encode(middle)),
        ),
        (
            "GET /ui/sessions?order=id",
            "/ui/sessions?order=id".to_string(),
        ),
        (
            "GET /ui/sessions?state=awaiting_worker",
            "/ui/sessions?state=awaiting_worker".to_string(),
        ),
        (
            "GET /ui/sessions?function=nobody (half the sessions)",
            format!("/ui/sessions?function={NOBODY}"),
        ),
        (
            "GET /ui (overview: counts, 10 oldest waits)",
            "/ui".to_string(),
        ),
        (
            "GET /ui/sessions?stuck=1 (walks every session)",
            "/ui/sessions?stuck=1".to_string(),
        ),
    ];
    for (what, path) in &pages {
        let mut lat = Latencies::default();
        let mut bytes = 0;
        // One unmeasured request first.
        get(admin, path).await?;
        for _ in 0..repeat {
            let t0 = Instant::now();
            let (status, len) = get(admin, path).await?;
            lat.push(t0.elapsed());
            if status != 200 {
                bail!("{path}: HTTP {status}");
            }
            bytes = len;
        }
        line(what, &mut lat, &format!("{} KB of HTML", bytes / 1024));
    }
    Ok(())
}

/// Time `sessions.list` of a few sizes and orders, then `stats`, `repeat` times each.
async fn time_lists(caller: &Caller, repeat: usize) -> anyhow::Result<()> {
    for (what, limit, order) in [
        (
            "sessions.list limit 100 (wait order)",
            100,
            SessionOrder::Wait,
        ),
        (
            "sessions.list limit 1000 (wait order)",
            1000,
            SessionOrder::Wait,
        ),
        ("sessions.list limit 100 (id order)", 100, SessionOrder::Id),
    ] {
        let args = SessionsListArgs {
            limit: Some(limit),
            order: Some(order),
            ..Default::default()
        };
        let mut lat = Latencies::default();
        caller.sessions(&args).await?;
        for _ in 0..repeat {
            let t0 = Instant::now();
            let p = caller.sessions(&args).await?;
            lat.push(t0.elapsed());
            if p.sessions.len() as u64 != limit {
                bail!("{what}: {} rows", p.sessions.len());
            }
        }
        line(what, &mut lat, "through the SDK over WebSocket");
    }
    let mut lat = Latencies::default();
    for _ in 0..repeat {
        let t0 = Instant::now();
        caller.stats().await?;
        lat.push(t0.elapsed());
    }
    line(
        "stats (counts and the oldest wait, from the wait index)",
        &mut lat,
        "",
    );
    Ok(())
}
