//! `invocation.progress`: a live invocation's partial output, taken in the progress
//! table (no session lock, no write) and pushed to the watches that asked for it.

use serde_json::value::RawValue;
use turnd_proto::{ProgressArgs, ProgressOk, Role};
use turnd_store::RawJson;

use super::{check_id, ApiResult, Caller, Engine};
use crate::error::EngineError;
use crate::metrics::Counters;
use crate::progress::Refused;

impl Engine {
    /// `invocation.progress`: `not_found` unless the invocation is its session's
    /// live one and its turn has no stop request; `forbidden` for a worker's frame of
    /// another worker's invocation; `too_large` over `turns.max_progress_bytes`. The
    /// data is the JSON text the frame carried, taken as it is when compact
    /// ([`RawJson::compacted`]).
    pub fn progress(&self, caller: &Caller, args: ProgressArgs<RawJson>) -> ApiResult<ProgressOk> {
        let c = &self.inner.counters;
        let refused = |e: EngineError| {
            Counters::inc(&c.progress_refused);
            Err(e)
        };
        check_id("invocation_id", &args.invocation_id)?;
        let max = self.inner.cfg.turns.max_progress_bytes;
        let data = args.data.compacted();
        if data.len() as u64 > max {
            return refused(EngineError::ProgressTooLarge { max });
        }
        let worker = match caller.role {
            Role::Worker => caller.worker_id.as_deref(),
            _ => None,
        };
        let watches = &self.inner.watches;
        let taken = self.inner.progress.take(
            &args.invocation_id,
            worker,
            data,
            self.now_ms(),
            |p, data: &RawValue| (p.seq, watches.publish_progress(p, data)),
        );
        match taken {
            Ok((seq, fanout)) => {
                Counters::inc(&c.progress_accepted);
                Counters::add(&c.progress_pushed, fanout.pushed);
                Counters::add(&c.progress_dropped, fanout.dropped);
                Ok(ProgressOk { seq })
            }
            Err(Refused::NotCurrent) => refused(EngineError::NotCurrent {
                invocation_id: args.invocation_id.clone(),
            }),
            Err(Refused::OtherWorker) => refused(EngineError::NotYourInvocation {
                invocation_id: args.invocation_id.clone(),
                worker_id: caller.worker_id.clone().unwrap_or_default(),
            }),
        }
    }
}
