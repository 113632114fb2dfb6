//! systemd's watchdog: `WATCHDOG=1` while the store can go on.
//!
//! When the unit sets `WatchdogSec=`, systemd passes `WATCHDOG_USEC` (and
//! `WATCHDOG_PID`) and kills the daemon when no `WATCHDOG=1` arrives within that
//! time; `Restart=on-failure` then starts it again, and the start replays the commit
//! log. After `READY=1` the daemon checks the store's health (`Kv::health`, as
//! `/healthz` does) every half of the interval and pings only while it is Ok. The
//! first failure is logged, sent as `STATUS=<reason>` (shown by `systemctl status`)
//! and ends the pings for good: a store that fails its health check needs a restart.

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use turnd_store::Kv;

/// Start the pings when systemd enabled the watchdog for this process
/// (`WATCHDOG_USEC` set and above 0, `WATCHDOG_PID` unset or this pid); they end when
/// `stop` is cancelled (a graceful shutdown, after `STOPPING=1`). None: not enabled.
pub fn spawn(kv: Arc<dyn Kv>, stop: CancellationToken) -> Option<JoinHandle<()>> {
    let timeout = sd_notify::watchdog_enabled().filter(|t| !t.is_zero())?;
    let period = timeout / 2;
    tracing::info!(
        "systemd watchdog on ({} ms): WATCHDOG=1 every {} ms while the store is healthy",
        timeout.as_millis(),
        period.as_millis()
    );
    Some(tokio::spawn(ping(
        period,
        move || kv.health(),
        sd_notify::notify,
        stop,
    )))
}

/// Every `period`, starting at once: `WATCHDOG=1` through `notify` while `health` is
/// Ok. On its first Err: an error log line, `STATUS=<reason>`, and no more pings.
/// Ends then, or when `stop` is cancelled. A failed `notify` is logged at debug.
async fn ping<N>(
    period: Duration,
    health: impl Fn() -> Result<(), String>,
    mut notify: N,
    stop: CancellationToken,
) where
    N: FnMut(&[NotifyState<'_>]) -> std::io::Result<()>,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match health() {
            Ok(()) => {
                if let Err(e) = notify(&[NotifyState::Watchdog]) {
                    tracing::debug!("sd_notify WATCHDOG not sent: {e}");
                }
            }
            Err(reason) => {
                tracing::error!(
                    "the store needs a restart: {reason}; the systemd watchdog is no longer \
                     pinged, so systemd restarts turnd once WatchdogSec= has passed"
                );
                // One line: the notify protocol separates its fields by newlines.
                let status = reason.replace(['\n', '\r'], " ");
                if let Err(e) = notify(&[NotifyState::Status(&status)]) {
                    tracing::debug!("sd_notify STATUS not sent: {e}");
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    const PERIOD: Duration = Duration::from_millis(10);

    /// `ping` with a switchable health and a notify that records each message.
    fn started(
        healthy: &Arc<AtomicBool>,
        fail_notify: bool,
    ) -> (Arc<Mutex<Vec<String>>>, CancellationToken, JoinHandle<()>) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (h, s) = (healthy.clone(), sent.clone());
        let task = tokio::spawn(ping(
            PERIOD,
            move || {
                if h.load(Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err("the store's applier thread has ended\nsecond line".into())
                }
            },
            move |states: &[NotifyState<'_>]| {
                let msg: Vec<String> = states.iter().map(ToString::to_string).collect();
                s.lock().expect("lock").push(msg.join("\n"));
                if fail_notify {
                    Err(std::io::Error::other("no socket"))
                } else {
                    Ok(())
                }
            },
            stop.clone(),
        ));
        (sent, stop, task)
    }

    /// Wait for `task` to end, at most 20 periods.
    async fn ends(task: JoinHandle<()>, what: &str) {
        match tokio::time::timeout(PERIOD * 20, task).await {
            Ok(r) => r.expect("the ping task"),
            Err(_) => panic!("the pings did not end: {what}"),
        }
    }

    fn count(sent: &Mutex<Vec<String>>, msg: &str) -> usize {
        sent.lock()
            .expect("lock")
            .iter()
            .filter(|m| *m == msg)
            .count()
    }

    /// After `periods` periods, at least `n` pings were sent.
    async fn pinged(sent: &Mutex<Vec<String>>, periods: u32, n: usize) {
        tokio::time::sleep(PERIOD * periods).await;
        assert!(count(sent, "WATCHDOG=1") >= n, "{sent:?}");
    }

    #[tokio::test]
    async fn pings_while_healthy_then_sends_the_reason_once_and_stops() {
        let healthy = Arc::new(AtomicBool::new(true));
        let (sent, _stop, task) = started(&healthy, false);
        pinged(&sent, 10, 3).await;
        healthy.store(false, Ordering::SeqCst);
        ends(task, "the pings end once the store is unhealthy").await;
        let sent = sent.lock().expect("lock").clone();
        let (last, pings) = sent.split_last().expect("messages");
        assert_eq!(
            last, "STATUS=the store's applier thread has ended second line",
            "{sent:?}"
        );
        assert!(pings.iter().all(|m| m == "WATCHDOG=1"), "{sent:?}");
    }

    #[tokio::test]
    async fn an_unhealthy_store_is_never_pinged() {
        let healthy = Arc::new(AtomicBool::new(false));
        let (sent, _stop, task) = started(&healthy, false);
        ends(task, "ends at the first check").await;
        assert_eq!(count(&sent, "WATCHDOG=1"), 0);
        assert_eq!(sent.lock().expect("lock").len(), 1);
    }

    #[tokio::test]
    async fn failed_notifies_go_on_and_stop_ends_the_pings() {
        let healthy = Arc::new(AtomicBool::new(true));
        let (sent, stop, task) = started(&healthy, true);
        pinged(&sent, 5, 2).await;
        stop.cancel();
        ends(task, "ends when stopped").await;
        assert!(sent.lock().expect("lock").iter().all(|m| m == "WATCHDOG=1"));
    }
}
