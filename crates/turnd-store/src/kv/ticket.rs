//! A commit's way back: the [`CommitTicket`] a committer awaits and the
//! [`CommitReply`] its store answers through, once the batch is durable or failed.

use crate::error::StoreError;

/// What a store's committer sends back for one batch: its result and, from the
/// commit log, the buffers the batch came in. Those are allocated by the committing
/// task; freed there (when the ticket resolves) rather than on the one thread every
/// commit passes through, they cost that thread nothing (a thread that only frees
/// what others allocated returns every block to its owner's arena, a lock each time).
pub(crate) struct Answer {
    result: Result<(), StoreError>,
    /// Held only to be dropped by the ticket's task.
    _spent: Option<Box<dyn Send>>,
}

/// A pending group commit: resolves once the batch is durable (or failed); an error
/// when the store went away without answering.
pub struct CommitTicket(tokio::sync::oneshot::Receiver<Answer>);

/// Where a batch's result goes: the other end of its [`CommitTicket`].
pub struct CommitReply(tokio::sync::oneshot::Sender<Answer>);

impl CommitTicket {
    /// A ticket and where its result is to be sent (a store of its own, or one
    /// wrapping another).
    pub fn new() -> (CommitReply, CommitTicket) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (CommitReply(tx), CommitTicket(rx))
    }

    /// A ticket answered already (a commit refused before it was queued).
    pub(crate) fn answered(result: Result<(), StoreError>) -> CommitTicket {
        let (reply, ticket) = CommitTicket::new();
        if reply.send(result).is_err() {
            // The ticket is held right here; a send to it does not fail.
            tracing::debug!("a ticket answered at once was gone");
        }
        ticket
    }

    /// The answer, if it came (a store that went away without answering: `Closed`);
    /// None while the batch is still on its way.
    pub(crate) fn try_answer(&mut self) -> Option<Result<(), StoreError>> {
        use tokio::sync::oneshot::error::TryRecvError;
        match self.0.try_recv() {
            Ok(answer) => Some(answer.result),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Closed) => Some(Err(StoreError::Closed)),
        }
    }
}

impl std::future::Future for CommitTicket {
    type Output = Result<Result<(), StoreError>, tokio::sync::oneshot::error::RecvError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|answer| answer.map(|a| a.result))
    }
}

impl CommitReply {
    /// Send `result`; when the ticket was dropped, Err with the result undelivered.
    pub fn send(self, result: Result<(), StoreError>) -> Result<(), Result<(), StoreError>> {
        self.send_spent(result, None)
    }

    /// Send `result` with the buffers of its batch, to be freed by the ticket's task
    /// (allocated there too, box included, so that this costs the sender no
    /// allocation).
    pub(crate) fn send_spent(
        self,
        result: Result<(), StoreError>,
        spent: Option<Box<dyn Send>>,
    ) -> Result<(), Result<(), StoreError>> {
        self.0
            .send(Answer {
                result,
                _spent: spent,
            })
            .map_err(|a| a.result)
    }
}
