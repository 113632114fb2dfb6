//! Lost results, dispatches and workers, reconciled in bounded time (semantics: Loss, Late results).
