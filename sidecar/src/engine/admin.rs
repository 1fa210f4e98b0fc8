//! Operator actions (§6 admin, §9, §12): force_open, force_close and reset of a
//! source on the backend, and their effect on this host's memo and waiters, also
//! when another host did them.

use std::time::Duration;

use super::error::EngineError;
use super::Engine;
use crate::backend::{BResult, Backend};
use crate::gate::breaker::Applied;

impl<B: Backend> Engine<B> {
    /// Admin: open `source` for `duration`.
    pub async fn force_open(
        &self,
        source: &str,
        duration: Duration,
    ) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        if duration.is_zero() {
            return Err(EngineError::InvalidArgument("seconds must be > 0".into()));
        }
        let r = self.backend.force_open(source, duration).await;
        let a = self.admin_result(idx, r)?;
        self.note_state(idx, &a);
        Ok(a)
    }

    /// Admin: close `source` now and clear its memo entry.
    pub async fn force_close(&self, source: &str) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        let r = self.backend.force_close(source).await;
        let a = self.admin_result(idx, r)?;
        self.sources[idx].memo.clear(); // only once the close really happened
        Ok(a)
    }

    /// Admin: forget `source`'s breaker and quota state and clear its memo entry.
    pub async fn reset(&self, source: &str) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        let r = self.backend.reset(source).await;
        let a = self.admin_result(idx, r)?;
        self.sources[idx].memo.clear(); // only once the reset really happened
        Ok(a)
    }

    /// Forget `source`'s memo entry (an admin op broadcast from another host).
    pub fn clear_memo(&self, source: &str) {
        if let Some(&idx) = self.source_index.get(source) {
            self.sources[idx].memo.clear();
            self.wake_all(idx);
        }
    }

    /// An admin op's backend answer: an error is the backend's unavailability (an
    /// operator must know the change did not happen); success wakes every waiter.
    fn admin_result(&self, source: usize, r: BResult<Applied>) -> Result<Applied, EngineError> {
        let a = r.map_err(|e| EngineError::BackendUnavailable {
            scope: String::new(),
            message: e.to_string(),
            reasons: Vec::new(),
        })?;
        self.wake_all(source);
        Ok(a)
    }
}
