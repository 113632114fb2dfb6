//! The sending side of a connection, why it is closed, and the text of a push.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use turnd_proto::Push;

/// The text of a push frame.
pub(crate) fn push_frame(p: &Push) -> String {
    frame_of(p)
}

/// The text of an `invoke` push, its input the JSON text the store holds.
pub(crate) fn invoke_frame(invoke: turnd_proto::Invoke<turnd_store::RawJson>) -> String {
    frame_of(&Push::Invoke(invoke))
}

/// The text of an `event` push of an event just committed, its detail the JSON text
/// the store holds.
pub(crate) fn event_frame(
    watch_id: String,
    event: turnd_proto::Event<turnd_store::RawJson>,
) -> String {
    frame_of(&Push::Event { watch_id, event })
}

fn frame_of<J: serde::Serialize>(p: &Push<J>) -> String {
    // Pushes are built from our own types, and stored JSON text is valid JSON:
    // serialization cannot fail.
    turnd_proto::frame::to_json_text(p, turnd_proto::frame::FRAME_CAPACITY)
        .expect("push frames serialize")
}

/// Why an outgoing frame is sent; the connection task closes with the right code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Superseded by a newer connection of the same worker_id (code 4001).
    Superseded,
    /// Its outgoing queue overflowed: the peer does not read fast enough.
    SlowReader,
    /// A watch's replay could not read the store (code 1011).
    Unavailable,
    /// The connection's reading side ended (the peer closed it or it failed): the
    /// writer stops without a close frame of its own.
    ReaderEnded,
    /// The daemon is shutting down (code 1001).
    ServerClosing,
    /// A request's write is in doubt (its partition's log stopped before it knew
    /// whether the write counts): no answer may be sent, so the connection ends
    /// (code 1011), and the peer reads the outcome back after it reconnects.
    InDoubt,
}

/// Connections opened so far in this process.
static OPENED: AtomicU64 = AtomicU64::new(0);

/// The sending side of one connection: a bounded queue of text frames. A peer that
/// cannot keep up is disconnected instead of making the daemon buffer without bound.
#[derive(Debug, Clone)]
pub struct Outbox {
    pub conn_id: String,
    /// Its place in the order connections were opened in this process.
    opened: u64,
    tx: mpsc::Sender<String>,
    close: CancellationToken,
    reason: std::sync::Arc<parking_lot::Mutex<Option<CloseReason>>>,
}

impl Outbox {
    /// A new outbox holding at most `capacity` frames, and its receiving side.
    pub fn new(conn_id: String, capacity: usize) -> (Outbox, mpsc::Receiver<String>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            Outbox {
                conn_id,
                opened: OPENED.fetch_add(1, Ordering::Relaxed) + 1,
                tx,
                close: CancellationToken::new(),
                reason: Default::default(),
            },
            rx,
        )
    }

    /// Queue a frame without waiting. Returns false (and closes the connection when the
    /// queue is full) if it could not be queued.
    pub fn push(&self, frame: String) -> bool {
        // Nothing more once closed: a frame queued after one that was refused would
        // reach the peer past a gap, and it resumes after the last event it saw.
        if self.close.is_cancelled() {
            return false;
        }
        match self.tx.try_send(frame) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.close_with(CloseReason::SlowReader);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Queue a frame, waiting for room (responses: the request task may wait).
    pub async fn send(&self, frame: String) -> bool {
        self.tx.send(frame).await.is_ok()
    }

    /// Its place in the order connections were opened: a later connection's is
    /// higher.
    pub fn opened(&self) -> u64 {
        self.opened
    }

    /// Frames queued and not yet written.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// Whether more than half of the queue is taken: frames that may be lost
    /// (progress) are dropped rather than queued.
    pub fn crowded(&self) -> bool {
        self.queued() * 2 > self.tx.max_capacity()
    }

    pub fn close_with(&self, reason: CloseReason) {
        {
            let mut r = self.reason.lock();
            r.get_or_insert(reason);
        }
        self.close.cancel();
    }

    /// Resolves when the connection must close.
    pub fn closed(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.close.cancelled()
    }

    pub fn close_reason(&self) -> Option<CloseReason> {
        *self.reason.lock()
    }

    pub fn is_closed(&self) -> bool {
        self.close.is_cancelled() || self.tx.is_closed()
    }
}
