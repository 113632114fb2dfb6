//! Small text formatters for human output: aligned tables, `key  value` blocks,
//! relative times ("4s ago", "in 12s"), UTC timestamps, durations and compact JSON.
//!
//! Written by hand rather than pulled in as dependencies: the CLI needs a few dozen
//! lines of each, and owning them keeps the output stable for scripts that grep it.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// Columns are separated by this.
const GAP: &str = "  ";

/// Now as Unix milliseconds (the daemon's timestamps are Unix milliseconds too).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A table with a header row and left-aligned columns (right-aligned where asked),
/// each as wide as its widest cell. The last column is not padded.
#[derive(Debug, Clone)]
pub struct Table {
    headers: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            right: vec![false; headers.len()],
            rows: Vec::new(),
        }
    }

    /// Right-align column `idx` (numbers).
    pub fn right(mut self, idx: usize) -> Table {
        if let Some(r) = self.right.get_mut(idx) {
            *r = true;
        }
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| width(h)).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(width(c));
            }
        }
        let mut out = String::new();
        for r in std::iter::once(&self.headers).chain(self.rows.iter()) {
            let mut line = String::new();
            for (i, (w, right)) in widths.iter().zip(&self.right).enumerate() {
                let cell = r.get(i).map(String::as_str).unwrap_or("");
                if i > 0 {
                    line.push_str(GAP);
                }
                let pad = w.saturating_sub(width(cell));
                if *right {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    if i + 1 < cols {
                        line.push_str(&" ".repeat(pad));
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// A block of `key  value` lines with the values aligned; keys may be indented to
/// show that they belong to the line above.
#[derive(Debug, Clone, Default)]
pub struct Fields {
    rows: Vec<(usize, String, String)>,
}

impl Fields {
    pub fn new() -> Fields {
        Fields::default()
    }

    pub fn add(&mut self, key: &str, value: impl Into<String>) {
        self.rows.push((0, key.to_string(), value.into()));
    }

    /// A line indented under the previous one.
    pub fn sub(&mut self, key: &str, value: impl Into<String>) {
        self.at(2, key, value);
    }

    /// A line with its key indented by `indent` spaces.
    pub fn at(&mut self, indent: usize, key: &str, value: impl Into<String>) {
        self.rows.push((indent, key.to_string(), value.into()));
    }

    pub fn render(&self) -> String {
        let w = self
            .rows
            .iter()
            .map(|(i, k, _)| i + width(k))
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for (indent, k, v) in &self.rows {
            let mut line = " ".repeat(*indent);
            line.push_str(k);
            line.push_str(&" ".repeat(w - indent - width(k)));
            line.push_str(GAP);
            line.push_str(v);
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

pub fn width(s: &str) -> usize {
    s.chars().count()
}

/// `then` relative to `now`, both Unix ms: "just now", "4s ago", "3m ago", "2h ago",
/// "5d ago"; the future (deadlines, where the exact wait matters) with two units:
/// "in 12s", "in 1m57s" ("in <1s" under a second).
pub fn relative(then_ms: u64, now_ms: u64) -> String {
    if then_ms <= now_ms {
        let d = now_ms - then_ms;
        if d < 1000 {
            "just now".to_string()
        } else {
            format!("{} ago", coarse(d))
        }
    } else {
        let d = then_ms - now_ms;
        if d < 1000 {
            "in <1s".to_string()
        } else {
            format!("in {}", duration(d - d % 1000))
        }
    }
}

/// A span in its largest whole unit: "4s", "3m", "2h", "5d".
fn coarse(ms: u64) -> String {
    let s = ms / 1000;
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m", s / 60)
    } else if s < 86_400 {
        format!("{}h", s / 3600)
    } else {
        format!("{}d", s / 86_400)
    }
}

/// A duration with two units where it matters: "850ms", "4.5s", "42s", "3m12s",
/// "2h05m", "3d4h".
pub fn duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let frac = ms % 1000;
    if ms < 10_000 && frac != 0 {
        return format!("{}.{}s", ms / 1000, frac / 100);
    }
    let s = ms / 1000;
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        match s % 60 {
            0 => format!("{}m", s / 60),
            r => format!("{}m{r:02}s", s / 60),
        }
    } else if s < 86_400 {
        match (s % 3600) / 60 {
            0 => format!("{}h", s / 3600),
            r => format!("{}h{r:02}m", s / 3600),
        }
    } else {
        match (s % 86_400) / 3600 {
            0 => format!("{}d", s / 86_400),
            r => format!("{}d{r}h", s / 86_400),
        }
    }
}

/// The UTC date and time of Unix ms `ms` (None past the year 9999).
fn civil(ms: u64) -> Option<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()
}

/// "2025-11-30 04:12:03 UTC".
pub fn utc(ms: u64) -> String {
    match civil(ms) {
        Some(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        None => format!("{ms} ms after the Unix epoch"),
    }
}

/// An event time for a log line: "04:12:03.123Z" when it is from the same UTC day
/// as `now`, otherwise "2025-11-29 04:12:03Z".
pub fn log_time(ms: u64, now_ms: u64) -> String {
    let Some(t) = civil(ms) else {
        return utc(ms);
    };
    let (h, m, s) = (t.hour(), t.minute(), t.second());
    if ms / 86_400_000 == now_ms / 86_400_000 {
        format!("{h:02}:{m:02}:{s:02}.{:03}Z", t.millisecond())
    } else {
        format!(
            "{:04}-{:02}-{:02} {h:02}:{m:02}:{s:02}Z",
            t.year(),
            u8::from(t.month()),
            t.day()
        )
    }
}

/// "12m ago (2025-11-30 04:12:03 UTC)".
pub fn when(ms: u64, now_ms: u64) -> String {
    format!("{} ({})", relative(ms, now_ms), utc(ms))
}

/// One-line JSON.
pub fn compact(v: &Value) -> String {
    // Serializing a `Value` cannot fail: its map keys are strings.
    serde_json::to_string(v).unwrap_or_else(|e| format!("<unprintable JSON: {e}>"))
}

/// `s` cut to at most `max` characters, with "…" marking a cut.
pub fn truncate(s: &str, max: usize) -> String {
    if width(s) <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn relative_times() {
        let now = 1_000_000_000;
        assert_eq!(relative(now, now), "just now");
        assert_eq!(relative(now - 999, now), "just now");
        assert_eq!(relative(now - 4_000, now), "4s ago");
        assert_eq!(relative(now - 59_999, now), "59s ago");
        assert_eq!(relative(now - 3 * 60_000 - 10, now), "3m ago");
        assert_eq!(relative(now - 2 * 3_600_000, now), "2h ago");
        assert_eq!(relative(now - 3 * 86_400_000, now), "3d ago");
        assert_eq!(relative(now + 12_000, now), "in 12s");
        assert_eq!(relative(now + 400, now), "in <1s");
        assert_eq!(relative(now + 5 * 60_000, now), "in 5m");
        assert_eq!(relative(now + 117_400, now), "in 1m57s");
        assert_eq!(relative(now + 4_500, now), "in 4s");
    }

    #[test]
    fn durations() {
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(4_500), "4.5s");
        assert_eq!(duration(5_000), "5s");
        assert_eq!(duration(42_000), "42s");
        assert_eq!(duration(192_000), "3m12s");
        assert_eq!(duration(180_000), "3m");
        assert_eq!(duration(2 * 3_600_000 + 5 * 60_000), "2h05m");
        assert_eq!(duration(3 * 86_400_000 + 4 * 3_600_000), "3d4h");
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        // 2000-02-29 (leap day) 12:34:56.789
        assert_eq!(utc(951_827_696_789), "2000-02-29 12:34:56 UTC");
        assert_eq!(utc(1_764_480_000_000), "2025-11-30 05:20:00 UTC");
        assert_eq!(
            log_time(1_764_480_000_123, 1_764_480_100_000),
            "05:20:00.123Z"
        );
        assert_eq!(
            log_time(1_764_480_000_123, 1_764_480_000_000 + 86_400_000),
            "2025-11-30 05:20:00Z"
        );
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&["SEQ", "KIND", "DETAIL"]).right(0);
        t.row(vec!["1".into(), "admitted".into(), "{}".into()]);
        t.row(vec!["10".into(), "completed".into(), String::new()]);
        assert_eq!(
            t.render(),
            "SEQ  KIND       DETAIL\n  1  admitted   {}\n 10  completed\n"
        );
    }

    #[test]
    fn fields_align_values() {
        let mut f = Fields::new();
        f.add("status", "running");
        f.sub("deadline", "in 4s");
        assert_eq!(f.render(), "status      running\n  deadline  in 4s\n");
    }

    #[test]
    fn compact_and_truncate() {
        assert_eq!(compact(&json!({"a": [1, 2]})), r#"{"a":[1,2]}"#);
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("abc", 4), "abc");
    }
}
