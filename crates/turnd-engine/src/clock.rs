//! Wall-clock milliseconds driven by tokio time.
//!
//! Deadlines are stored as absolute Unix milliseconds so they survive restarts, and
//! armed as `tokio::time::Instant`s so tests can pause and advance time. The clock
//! pins one wall-clock reading to one tokio instant at start-up and derives every
//! later reading from tokio time, so on paused time the wall clock advances exactly
//! as far as the test advances it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base_ms: u64,
    base: Instant,
}

impl Clock {
    /// A clock pinned to the current wall time. Must be called inside a runtime.
    pub fn new() -> Clock {
        let base_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Clock {
            base_ms,
            base: Instant::now(),
        }
    }

    /// Current Unix time in milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.base_ms + self.base.elapsed().as_millis() as u64
    }

    /// The tokio instant at which the Unix time `ms` is reached (now, if passed).
    pub fn instant_at(&self, ms: u64) -> Instant {
        let now_ms = self.now_ms();
        Instant::now() + Duration::from_millis(ms.saturating_sub(now_ms))
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn follows_paused_time() {
        let c = Clock::new();
        let t0 = c.now_ms();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(c.now_ms() - t0, 90_000);
        let at = c.instant_at(c.now_ms() + 500);
        assert_eq!(at - Instant::now(), Duration::from_millis(500));
        assert!(c.instant_at(0) <= Instant::now());
    }
}
