//! Wall-clock milliseconds driven by tokio time.
//!
//! Deadlines are stored as absolute Unix milliseconds so they survive restarts, and
//! armed as `tokio::time::Instant`s so tests can pause and advance time. The clock
//! pins one wall-clock reading to one tokio instant at start-up and derives every
//! later reading from tokio time, so on paused time the wall clock advances exactly
//! as far as the test advances it.
//!
//! Times shown to people (in wait reasons and on the operator page) are formatted
//! here too: [`fmt_utc`], and [`fmt_time`] with how long ago or ahead.

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
        Clock::starting_at(base_ms)
    }

    /// A clock that reads `base_ms` now, whatever the machine's wall clock says: a
    /// simulated world's time, or one a test sets. Must be called inside a runtime.
    pub fn starting_at(base_ms: u64) -> Clock {
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

/// A Unix-ms time for a reason string: ISO-like UTC plus how long ago or ahead.
pub fn fmt_time(ms: u64, now: u64) -> String {
    let rel = if ms <= now {
        format!("{} ago", fmt_dur(now - ms))
    } else {
        format!("in {}", fmt_dur(ms - now))
    };
    format!("{} ({rel})", fmt_utc(ms))
}

fn fmt_dur(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 {
        format!("{}m{}s", ms / 60_000, (ms / 1000) % 60)
    } else {
        format!("{}h{}m", ms / 3_600_000, (ms / 60_000) % 60)
    }
}

/// Unix ms as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn fmt_utc(ms: u64) -> String {
    match time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            t.millisecond()
        ),
        // Past the year 9999: no calendar date to show.
        Err(_) => format!("{ms} ms after the Unix epoch"),
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
        let pinned = Clock::starting_at(5_000);
        assert_eq!(pinned.now_ms(), 5_000);
        tokio::time::advance(Duration::from_millis(7)).await;
        assert_eq!(pinned.now_ms(), 5_007);
    }

    #[test]
    fn utc_formatting() {
        assert_eq!(fmt_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(fmt_utc(1_764_480_000_123), "2025-11-30T05:20:00.123Z");
        assert_eq!(fmt_time(1000, 5000), "1970-01-01T00:00:01.000Z (4.0s ago)");
    }
}
