//! The normal path: FIFO per session, parallel sessions, multi-step turns, retries, idempotency, protocol errors, restart.
