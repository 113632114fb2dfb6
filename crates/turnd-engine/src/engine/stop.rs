//! Stop: `turn.stop` and `session.stop`.

use super::{check_id, read_failed, unavailable, ApiResult, Engine};
use crate::error::EngineError;
use crate::machine;
use crate::view::to_turn;
use crate::TurnView;

impl Engine {
    /// `turn.stop`.
    pub async fn stop_turn(&self, turn_id: &str, reason: Option<String>) -> ApiResult<TurnView> {
        let rec = self.stored_turn(turn_id)?;
        let cell = self.sessions().cell(&rec.session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        let Some(t) = st.find(turn_id).cloned() else {
            // Terminal already: nothing changes.
            let t = self
                .inner
                .store
                .turn(turn_id)
                .map_err(read_failed)?
                .unwrap_or(rec);
            return Ok(to_turn(&t, None));
        };
        if t.stop.is_some() {
            return Ok(self.turn_view(&st, &t));
        }
        let reason = reason.unwrap_or_default();
        let (stopped, ()) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::stop_turn(cx, tx, t.seq, reason)
        });
        self.commit(&cell, &mut st, stopped)
            .await
            .map_err(unavailable)?;
        let t = self
            .turn_record_locked(&st, turn_id)
            .map_err(read_failed)?
            .ok_or_else(|| EngineError::invariant("stopped turn vanished"))?;
        Ok(self.turn_view(&st, &t))
    }

    /// `session.stop`.
    pub async fn stop_session(
        &self,
        session_id: &str,
        reason: Option<String>,
    ) -> ApiResult<Vec<TurnView>> {
        check_id("session_id", session_id)?;
        let cell = self.sessions().cell(session_id);
        let mut st = self.sessions().lock(&cell).await.map_err(read_failed)?;
        if st.meta.last_turn_seq == 0 {
            return Err(EngineError::NoSession(session_id.to_string()));
        }
        let reason = reason.unwrap_or_default();
        let (stopped, ()) = self.transition(&st, self.now_ms(), |cx, tx| {
            machine::stop_session(cx, tx, &reason)
        });
        let ids: Vec<String> = st.active.iter().map(|t| t.turn_id.clone()).collect();
        self.commit(&cell, &mut st, stopped)
            .await
            .map_err(unavailable)?;
        let mut out = Vec::new();
        for id in ids {
            if let Some(t) = self.turn_record_locked(&st, &id).map_err(read_failed)? {
                out.push(self.turn_view(&st, &t));
            }
        }
        Ok(out)
    }
}
