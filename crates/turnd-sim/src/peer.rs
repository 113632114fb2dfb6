//! What the simulated peers share: the [`Env`] a peer acts through at each step (the
//! time, the seed's generator, the ledger, the frames it sends and the connections it
//! opens or cuts), the connection state of a peer, and the trace.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use turnd_proto::frame::encode_request_typed;

use crate::ledger::Ledger;

/// The run's trace: every line when replaying one seed, nothing when exploring.
#[derive(Default)]
pub struct Trace {
    lines: Option<Vec<String>>,
}

impl Trace {
    pub fn new(on: bool) -> Trace {
        Trace {
            lines: on.then(Vec::new),
        }
    }

    pub fn on(&self) -> bool {
        self.lines.is_some()
    }

    pub fn push(&mut self, now: u64, line: impl FnOnce() -> String) {
        if let Some(l) = self.lines.as_mut() {
            l.push(format!("{now:>9} {}", line()));
        }
    }

    pub fn lines(&self) -> &[String] {
        self.lines.as_deref().unwrap_or(&[])
    }
}

/// What a peer acts through in one step.
pub struct Env<'a> {
    pub now: u64,
    pub rng: &'a mut ChaCha8Rng,
    pub ledger: &'a mut Ledger,
    pub trace: &'a mut Trace,
    /// Frames sent, by connection.
    pub sends: Vec<(u64, String)>,
    /// Connections opened (the peer's `hello` is among `sends`).
    pub opened: Vec<u64>,
    /// Connections the peer cut.
    pub cut: Vec<u64>,
    pub next_conn: &'a mut u64,
}

impl Env<'_> {
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.random_bool(p.min(1.0))
    }

    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        self.rng.random_range(lo..hi)
    }

    pub fn open(&mut self) -> u64 {
        *self.next_conn += 1;
        let c = *self.next_conn;
        self.opened.push(c);
        c
    }
}

/// A peer's connection to the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Not connected; connects again at this time.
    Down(u64),
    /// `hello` sent (request id, when).
    Hello {
        conn: u64,
        id: u64,
        at: u64,
    },
    Ready(u64),
}

impl Link {
    pub fn conn(self) -> Option<u64> {
        match self {
            Link::Down(_) => None,
            Link::Hello { conn, .. } | Link::Ready(conn) => Some(conn),
        }
    }

    pub fn ready(self) -> Option<u64> {
        match self {
            Link::Ready(c) => Some(c),
            _ => None,
        }
    }
}

/// A request frame; its arguments are our own types, which always serialize.
pub fn request<A: Serialize + ?Sized>(id: u64, op: &str, args: &A) -> String {
    encode_request_typed(id, op, args).unwrap_or_default()
}
