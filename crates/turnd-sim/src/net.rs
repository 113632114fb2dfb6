//! The simulated network between the daemon and its peers: protocol frames (JSON
//! text) on numbered connections, each delivered at a time the seed decides.
//!
//! A connection is ordered, as a WebSocket over TCP is: a frame is never delivered
//! before one sent earlier in the same direction, however long its latency. Faults
//! are those a connection really shows, plus those of a proxy between the two ends:
//! a frame dropped or duplicated (a proxy's loss or resend), delayed (and everything
//! behind it), and the connection cut, which each end notices at its own time. Frames
//! of a cut connection still in flight to the daemon arrive until the daemon notices
//! the cut (its reader had them), so a peer's requests can be handled after the same
//! peer said `hello` on a new connection: reordered across reconnects.

use std::collections::{BTreeMap, HashMap};

/// Which way a frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    ToDaemon,
    ToPeer,
}

/// What the network delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    Frame(Dir, String),
    /// The end in `Dir` learns that the connection is gone.
    Closed(Dir),
}

/// Fault rates of the network, per frame.
#[derive(Debug, Clone, Copy)]
pub struct NetFaults {
    pub drop: f64,
    pub dup: f64,
    /// Chance of a long delay (up to `long_ms`).
    pub delay: f64,
    pub long_ms: u64,
}

impl NetFaults {
    pub const NONE: NetFaults = NetFaults {
        drop: 0.0,
        dup: 0.0,
        delay: 0.0,
        long_ms: 0,
    };
}

/// Frames and closes in flight.
#[derive(Default)]
pub struct Net {
    /// By delivery time, then by order sent.
    queue: BTreeMap<(u64, u64), (u64, Delivery)>,
    sent: u64,
    /// The delivery time of the last frame sent each way of each connection.
    last: HashMap<(u64, Dir), u64>,
    pub dropped: u64,
    pub duplicated: u64,
}

impl Net {
    /// Send `frame` on `conn` at `now`, with `latency` and the faults the seed drew
    /// (`drop`, `dup`, `extra` delay).
    pub fn send(&mut self, now: u64, conn: u64, dir: Dir, frame: String, fate: Fate) {
        if fate.drop {
            self.dropped += 1;
            return;
        }
        let last = self.last.entry((conn, dir)).or_insert(0);
        let at = (now + fate.latency + fate.extra).max(*last);
        *last = at;
        if fate.dup {
            self.duplicated += 1;
            self.push(at, conn, Delivery::Frame(dir, frame.clone()));
        }
        self.push(at, conn, Delivery::Frame(dir, frame));
    }

    /// The end in `dir` learns at `at` that `conn` is gone (after whatever was sent
    /// to it before).
    pub fn close(&mut self, at: u64, conn: u64, dir: Dir) {
        let at = at.max(self.last.get(&(conn, dir)).copied().unwrap_or(0));
        self.push(at, conn, Delivery::Closed(dir));
    }

    fn push(&mut self, at: u64, conn: u64, d: Delivery) {
        self.sent += 1;
        self.queue.insert((at, self.sent), (conn, d));
    }

    /// The next delivery due at or before `now`.
    pub fn next_due(&mut self, now: u64) -> Option<(u64, Delivery)> {
        let (&(at, _), _) = self.queue.first_key_value()?;
        if at > now {
            return None;
        }
        self.queue.pop_first().map(|(_, v)| v)
    }

    /// Forget the order kept for a connection both ends closed.
    pub fn forget(&mut self, conn: u64) {
        self.last.remove(&(conn, Dir::ToDaemon));
        self.last.remove(&(conn, Dir::ToPeer));
    }

    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}

/// What the seed drew for one frame.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fate {
    pub latency: u64,
    pub extra: u64,
    pub drop: bool,
    pub dup: bool,
}
