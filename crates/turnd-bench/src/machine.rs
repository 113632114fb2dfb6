//! What the machine itself did during a soak, to set beside its longest intervals with
//! no completion: the late wake-ups of a thread that only sleeps, the CPU time the
//! hypervisor took from this machine (`steal` in `/proc/stat`), and the time each
//! thread of the daemon and of the bench was runnable but waited for a core
//! (`run_delay` in `/proc/PID/task/TID/schedstat`), the time each ran on a core
//! (`run_time`, the same file's first number), and the samples in which one was in
//! uninterruptible sleep (state `D` in `/proc/PID/task/TID/stat`: waiting in the
//! kernel, for a disk or a kernel lock) with where it waited (`wchan`); and, with
//! steal, the machine's file pages not yet on the disk (`Dirty` and `Writeback` in
//! `/proc/meminfo`).
//!
//! A thread that asks to sleep 1 ms and wakes 20 ms later was runnable for 19 ms and
//! ran nothing: on a machine whose cores were free to take it, no lock, queue or disk
//! of the daemon's can cause that; a host that did not run this machine, or a kernel
//! busy elsewhere, can. Steal is counted by the kernel in ticks of `1 / _SC_CLK_TCK`
//! (10 ms here), summed over the cores, so it says "some time in this sample", never
//! where in it. A thread's `run_delay` is read every [`WAITS_EVERY`], so a wait is
//! placed in the sample it grew in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

/// A stretch of Unix time (seconds) in which something held up, and for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub start: f64,
    pub end: f64,
    /// How long it held up, in milliseconds (for steal: over all cores, so it may
    /// exceed the span).
    pub ms: f64,
}

/// How late a 1 ms sleep must wake to be kept.
const LATE: Duration = Duration::from_millis(5);
/// How often `/proc/stat` is read for steal.
const STEAL_EVERY: Duration = Duration::from_millis(20);

/// How often the threads' `run_delay` is read.
const WAITS_EVERY: Duration = Duration::from_millis(10);
/// How much a thread's `run_delay` must grow in one sample to be kept.
const WAITED: Duration = Duration::from_millis(3);
/// How much a thread's `run_time` must grow in one sample to be kept.
const RAN: Duration = Duration::from_millis(3);

/// A sample in which a thread waited for a core, or ran on one (`span.ms`: how long).
#[derive(Debug, Clone, PartialEq)]
pub struct ThreadSpan {
    pub span: Span,
    /// `process/thread` (the process as named to [`MachineWatch::start`], the
    /// thread's `comm`).
    pub who: String,
}

/// A sample in which a thread was in uninterruptible sleep (`span.ms`: the sample's
/// length, as the state was seen once in it).
#[derive(Debug, Clone, PartialEq)]
pub struct Blocked {
    pub at: ThreadSpan,
    /// The kernel function it waited in (`wchan`; `?` when not readable).
    pub wchan: String,
}

/// What the threads did in one sample of [`waits`].
#[derive(Default)]
struct Threads {
    waits: Vec<ThreadSpan>,
    ran: Vec<ThreadSpan>,
    blocked: Vec<Blocked>,
}

/// The watchers, each on a thread of its own, until [`MachineWatch::stop`].
pub struct MachineWatch {
    stop: Arc<AtomicBool>,
    late: JoinHandle<Vec<Span>>,
    steal: JoinHandle<(Vec<Span>, Vec<u64>)>,
    threads: JoinHandle<Threads>,
}

/// What [`MachineWatch`] saw.
pub struct Seen {
    /// Wake-ups of the sleeping thread [`LATE`] or more after they were due.
    pub late_wakeups: Vec<Span>,
    /// Samples of `/proc/stat` in which steal grew (empty where it cannot be read).
    pub steal: Vec<Span>,
    /// The machine's file pages written but not yet on the disk (`Dirty` plus
    /// `Writeback` of `/proc/meminfo`, kB), read with steal: what the kernel's
    /// write-back, or the next `fdatasync` of their files, has yet to send.
    pub dirty_kb: Vec<u64>,
    /// Samples in which a thread of a watched process waited [`WAITED`] or more for a
    /// core.
    pub waits: Vec<ThreadSpan>,
    /// Samples in which a thread of a watched process ran [`RAN`] or more.
    pub ran: Vec<ThreadSpan>,
    /// Samples in which a thread of a watched process was in uninterruptible sleep.
    pub blocked: Vec<Blocked>,
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The `steal` ticks of the first line of `/proc/stat` (all cores).
fn steal_ticks(stat: &str) -> Option<u64> {
    let cpu = stat.lines().next()?;
    let mut fields = cpu.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    // user nice system idle iowait irq softirq steal
    fields.nth(7)?.parse().ok()
}

/// The `run_time` and `run_delay` of a `schedstat` file's text, in nanoseconds.
fn schedstat_ns(schedstat: &str) -> Option<(u64, u64)> {
    let mut f = schedstat.split_whitespace();
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// The state letter of a `/proc/PID/task/TID/stat` line: the first field after the
/// `comm`, which is in parentheses and may hold any byte, `)` included.
fn stat_state(stat: &str) -> Option<char> {
    stat.get(stat.rfind(')')? + 1..)?
        .trim_start()
        .chars()
        .next()
}

/// A thread of a watched process at one sample.
struct ThreadNow {
    tid: u32,
    comm: String,
    run_ns: u64,
    delay_ns: u64,
    /// Where it waits, when in uninterruptible sleep.
    blocked_in: Option<String>,
}

/// Each thread of `pid`; none once the process is gone.
fn threads_of(pid: u32) -> Vec<ThreadNow> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| {
            let t = t.ok()?;
            let tid: u32 = t.file_name().to_str()?.parse().ok()?;
            let path = t.path();
            let (run_ns, delay_ns) =
                schedstat_ns(&std::fs::read_to_string(path.join("schedstat")).ok()?)?;
            let comm = std::fs::read_to_string(path.join("comm")).ok()?;
            let state = std::fs::read_to_string(path.join("stat"))
                .ok()
                .and_then(|s| stat_state(&s));
            let blocked_in = (state == Some('D')).then(|| {
                std::fs::read_to_string(path.join("wchan"))
                    .ok()
                    .filter(|w| !w.is_empty() && w != "0")
                    .unwrap_or_else(|| "?".into())
            });
            Some(ThreadNow {
                tid,
                comm: comm.trim().to_string(),
                run_ns,
                delay_ns,
                blocked_in,
            })
        })
        .collect()
}

/// Sleep 1 ms at a time until `stop`; the wake-ups [`LATE`] or more after they were due.
fn late_wakeups(stop: &AtomicBool) -> Vec<Span> {
    let mut seen = Vec::new();
    let ask = Duration::from_millis(1);
    while !stop.load(Ordering::Relaxed) {
        let wall = SystemTime::now();
        let t0 = Instant::now();
        std::thread::sleep(ask);
        let slept = t0.elapsed();
        if slept >= ask + LATE {
            seen.push(Span {
                start: unix(wall) + ask.as_secs_f64(),
                end: unix(wall) + slept.as_secs_f64(),
                ms: (slept - ask).as_secs_f64() * 1000.0,
            });
        }
    }
    seen
}

/// `Dirty` plus `Writeback` of `/proc/meminfo`, in kB.
fn dirty_kb(meminfo: &str) -> Option<u64> {
    let field = |name: &str| {
        meminfo.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(':')?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
    };
    Some(field("Dirty")? + field("Writeback")?)
}

/// Read steal and the dirty pages every [`STEAL_EVERY`] until `stop`: the samples in
/// which steal grew, and every reading of [`dirty_kb`].
fn steal(stop: &AtomicBool) -> (Vec<Span>, Vec<u64>) {
    let mut seen = Vec::new();
    let mut dirty = Vec::new();
    // SAFETY: sysconf reads a constant of the system and has no preconditions.
    let tick_ms = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        t if t > 0 => 1000.0 / t as f64,
        _ => return (seen, dirty),
    };
    let read = || {
        std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| steal_ticks(&s))
    };
    let Some(mut prev) = read() else {
        return (seen, dirty);
    };
    let mut prev_at = unix(SystemTime::now());
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(STEAL_EVERY);
        if let Some(kb) = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| dirty_kb(&s))
        {
            dirty.push(kb);
        }
        let Some(now) = read() else { break };
        let at = unix(SystemTime::now());
        if now > prev {
            seen.push(Span {
                start: prev_at,
                end: at,
                ms: (now - prev) as f64 * tick_ms,
            });
        }
        prev = now;
        prev_at = at;
    }
    (seen, dirty)
}

/// Read every thread of `processes` every [`WAITS_EVERY`] until `stop`: the samples
/// in which one's `run_delay` grew [`WAITED`] or more, its `run_time` [`RAN`] or
/// more, or it was in uninterruptible sleep.
fn waits(stop: &AtomicBool, processes: &[(String, u32)]) -> Threads {
    let mut seen = Threads::default();
    let mut last: std::collections::HashMap<(u32, u32), (u64, u64)> = Default::default();
    let mut prev_at = unix(SystemTime::now());
    while !stop.load(Ordering::Relaxed) {
        let at = unix(SystemTime::now());
        for (name, pid) in processes {
            for t in threads_of(*pid) {
                let before = last.insert((*pid, t.tid), (t.run_ns, t.delay_ns));
                let who = format!("{name}/{}", t.comm);
                let at_ms = |ms: f64| Span {
                    start: prev_at,
                    end: at,
                    ms,
                };
                if let Some((run, delay)) = before {
                    let (ran, waited) = (
                        t.run_ns.saturating_sub(run),
                        t.delay_ns.saturating_sub(delay),
                    );
                    if waited >= WAITED.as_nanos() as u64 {
                        seen.waits.push(ThreadSpan {
                            span: at_ms(waited as f64 / 1e6),
                            who: who.clone(),
                        });
                    }
                    if ran >= RAN.as_nanos() as u64 {
                        seen.ran.push(ThreadSpan {
                            span: at_ms(ran as f64 / 1e6),
                            who: who.clone(),
                        });
                    }
                }
                if let Some(wchan) = t.blocked_in {
                    seen.blocked.push(Blocked {
                        at: ThreadSpan {
                            span: at_ms((at - prev_at) * 1000.0),
                            who,
                        },
                        wchan,
                    });
                }
            }
        }
        prev_at = at;
        std::thread::sleep(WAITS_EVERY);
    }
    seen
}

impl MachineWatch {
    /// Watch the machine, and the threads of each `(name, pid)` of `processes`.
    pub fn start(processes: Vec<(String, u32)>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (s1, s2, s3) = (stop.clone(), stop.clone(), stop.clone());
        Self {
            late: std::thread::spawn(move || late_wakeups(&s1)),
            steal: std::thread::spawn(move || steal(&s2)),
            threads: std::thread::spawn(move || waits(&s3, &processes)),
            stop,
        }
    }

    pub fn stop(self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        let threads = self.threads.join().unwrap_or_default();
        let (steal, dirty_kb) = self.steal.join().unwrap_or_default();
        Seen {
            late_wakeups: self.late.join().unwrap_or_default(),
            steal,
            dirty_kb,
            waits: threads.waits,
            ran: threads.ran,
            blocked: threads.blocked,
        }
    }
}

impl Span {
    /// Whether it overlaps `[start, end)`.
    pub fn overlaps(&self, start: f64, end: f64) -> bool {
        self.start < end && self.end > start
    }
}

/// The spans that overlap `[start, end)`, and the share of it they cover (overlaps
/// between the spans themselves are counted once per span).
pub fn overlapping(spans: &[Span], start: f64, end: f64) -> (Vec<Span>, f64) {
    let over: Vec<Span> = spans
        .iter()
        .filter(|s| s.overlaps(start, end))
        .copied()
        .collect();
    let covered: f64 = over
        .iter()
        .map(|s| s.end.min(end) - s.start.max(start))
        .sum();
    (over, covered / (end - start).max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_is_dirty_plus_writeback_of_meminfo() {
        let meminfo = "MemTotal:       24554948 kB\nDirty:             11428 kB\nWriteback:           512 kB\nWritebackTmp:        7 kB\n";
        assert_eq!(dirty_kb(meminfo), Some(11940));
        assert_eq!(dirty_kb("Dirty: 3 kB\n"), None);
    }

    #[test]
    fn steal_is_the_eighth_number_of_the_cpu_line() {
        let stat = "cpu  4416884 2338 1032592 4687099 192783 0 127529 26571 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(steal_ticks(stat), Some(26571));
        assert_eq!(steal_ticks("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(steal_ticks("cpu 1 2 3\n"), None);
    }

    #[test]
    fn run_time_and_run_delay_are_the_first_two_numbers_of_schedstat() {
        assert_eq!(
            schedstat_ns("86263600 13545011 237\n"),
            Some((86_263_600, 13_545_011))
        );
        assert_eq!(schedstat_ns("86263600"), None);
    }

    #[test]
    fn the_state_follows_the_last_parenthesis_of_stat() {
        assert_eq!(stat_state("4242 (turnd-log-write) D 1 4242 0"), Some('D'));
        // A comm may hold spaces and parentheses.
        assert_eq!(stat_state("7 (a) b (c)) S 1 7 0"), Some('S'));
        assert_eq!(stat_state("7 (cut"), None);
    }

    /// CPU time this thread has used.
    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec it is given.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "read this thread's CPU clock");
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[test]
    fn a_thread_kept_off_its_core_is_seen_waiting() {
        // Three threads that each need 100 ms of CPU on one core: on it, each
        // waits for the others about two thirds of the time.
        // The watch reads each thread every WAITS_EVERY and counts what grew
        // between two reads: the spinners start once it has seen them, and stay
        // until it has read them after they finished, however late a busy machine
        // runs the watch.
        let pid = std::process::id();
        let w = MachineWatch::start(vec![("self".into(), pid)]);
        let go = Arc::new(std::sync::Barrier::new(4));
        let done = Arc::new(std::sync::Barrier::new(4));
        let end = Arc::new(std::sync::Barrier::new(4));
        let spin: Vec<_> = (0..3)
            .map(|_| {
                let (go, done, end) = (go.clone(), done.clone(), end.clone());
                std::thread::Builder::new()
                    .name("spinner".into())
                    .spawn(move || {
                        go.wait();
                        // SAFETY: a zeroed cpu_set_t is an empty set, CPU_SET writes
                        // within it, and sched_setaffinity only reads it.
                        let pinned = unsafe {
                            let mut set: libc::cpu_set_t = std::mem::zeroed();
                            libc::CPU_SET(0, &mut set);
                            libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set)
                        };
                        assert_eq!(pinned, 0, "pin a spinner to core 0");
                        // Spin until this thread has had 100 ms of CPU, however
                        // busy the machine is (bounded at 10 s of wall time).
                        let t = Instant::now();
                        while thread_cpu() < Duration::from_millis(100)
                            && t.elapsed() < Duration::from_secs(10)
                        {
                            std::hint::spin_loop();
                        }
                        done.wait();
                        end.wait();
                    })
            })
            .collect();
        std::thread::sleep(WAITS_EVERY * 20);
        go.wait();
        done.wait();
        std::thread::sleep(WAITS_EVERY * 20);
        let seen = w.stop();
        end.wait();
        for t in spin {
            t.expect("spawn").join().expect("spinner");
        }
        let spinners = |spans: &[ThreadSpan]| -> f64 {
            spans
                .iter()
                .filter(|w| w.who == "self/spinner")
                .map(|w| w.span.ms)
                .sum()
        };
        let waited = spinners(&seen.waits);
        assert!(waited > 100.0, "the spinners waited {waited} ms in all");
        // They were seen running: each had 100 ms of CPU by its own clock, and the
        // reads of a watch that a loaded machine runs late still see most of one's
        // (97.8 ms was seen once; the bound is half of one spinner's).
        let ran = spinners(&seen.ran);
        assert!(ran > 50.0, "the spinners ran {ran} ms in all");
    }

    #[test]
    fn overlapping_spans_and_their_share() {
        let span = |start: f64, end: f64| Span {
            start,
            end,
            ms: (end - start) * 1000.0,
        };
        let spans = [span(10.0, 10.02), span(10.05, 10.2), span(11.0, 11.1)];
        let (over, share) = overlapping(&spans, 10.0, 10.1);
        assert_eq!(over.len(), 2);
        assert!((share - 0.7).abs() < 1e-9, "{share}");
        let (none, share) = overlapping(&spans, 10.3, 10.4);
        assert!(none.is_empty());
        assert!(share.abs() < 1e-12);
    }
}
