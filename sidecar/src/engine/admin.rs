//! Operator actions (§6 admin, §9, §12): force_open, force_close and reset of a
//! source on the backend, and their effect on this host's memo and waiters, also
//! when another host did them.

use std::time::Duration;

use super::error::EngineError;
use super::transitions::{Observation, Reason};
use super::Engine;
use crate::backend::{AdminEvent, AdminOp, BResult, Backend};
use crate::gate::breaker::Applied;
use crate::limits::MAX_FORCE_OPEN;

impl<B: Backend> Engine<B> {
    /// Admin: open `source` for `duration`.
    pub async fn force_open(
        &self,
        source: &str,
        duration: Duration,
    ) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        // Checked before any arithmetic: a deadline near 2^64 s overflows (§12).
        if duration.is_zero() || duration > MAX_FORCE_OPEN {
            return Err(EngineError::InvalidArgument(format!(
                "seconds must be > 0 and at most {} (365 days), got {}",
                MAX_FORCE_OPEN.as_secs(),
                duration.as_secs_f64()
            )));
        }
        let r = self.backend.force_open(source, duration).await;
        let a = self.admin_result(idx, r, Reason::Force)?;
        self.note_state(idx, &a);
        Ok(a)
    }

    /// Admin: close `source` now and clear its memo entry.
    pub async fn force_close(&self, source: &str) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        let r = self.backend.force_close(source).await;
        // Only once the close really happened, and before the waiters are woken: one
        // woken first would still see the memo, and nap until the old open ended.
        if r.is_ok() {
            self.sources[idx].memo.clear();
        }
        self.admin_result(idx, r, Reason::Force)
    }

    /// Admin: forget `source`'s breaker and quota state and clear its memo entry.
    pub async fn reset(&self, source: &str) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        let r = self.backend.reset(source).await;
        if r.is_ok() {
            self.sources[idx].memo.clear(); // as in force_close: before the wake-up
        }
        self.admin_result(idx, r, Reason::Reset)
    }

    /// An operator's action on any host, as the shared backend broadcast it (§9): a
    /// `force_close` or `reset` clears this host's memo entry for the source and wakes
    /// its waiters (a `force_open` needs nothing: the next admission sees it). Events
    /// about sources this host does not know are ignored.
    pub fn apply_admin_event(&self, ev: &AdminEvent) {
        tracing::info!(source = %ev.source, op = ?ev.op, "admin event from the shared backend");
        if !matches!(ev.op, AdminOp::ForceClose | AdminOp::Reset) {
            return;
        }
        if let Some(&idx) = self.source_index.get(ev.source.as_str()) {
            self.sources[idx].memo.clear();
            self.wake_all(idx);
        }
    }

    /// An admin op's backend answer: an error is the backend's unavailability (an
    /// operator must know the change did not happen); success wakes every waiter.
    /// The new state is logged and counted as a transition for `reason` (§12).
    fn admin_result(
        &self,
        source: usize,
        r: BResult<Applied>,
        reason: Reason,
    ) -> Result<Applied, EngineError> {
        let a = r.map_err(|e| EngineError::BackendUnavailable {
            scope: None,
            message: e.to_string(),
            reasons: Vec::new(),
        })?;
        self.observe(
            self.first_scope(source),
            source,
            Observation {
                cooldown: a.retry_after,
                level: Some(a.level),
                ..Observation::of(a.state, a.epoch, reason)
            },
        );
        self.wake_all(source);
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::memory::MemoryBackend;
    use crate::clock::{Clock, ManualClock};
    use crate::config::parse_str;

    fn event(op: AdminOp, source: &str) -> AdminEvent {
        AdminEvent {
            source: source.into(),
            op,
        }
    }

    #[tokio::test]
    async fn a_broadcast_close_or_reset_clears_the_memo_and_open_does_not() {
        let cfg = parse_str(
            "[[scopes.chat.sources]]\nname = \"a\"\n[[scopes.chat.sources]]\nname = \"b\"\n",
            [],
        )
        .expect("valid config");
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new());
        let e = Engine::new(&cfg, MemoryBackend::new(clock.clone(), ["a", "b"]), clock);
        let memo = |e: &Engine<MemoryBackend>, i: usize| e.sources[i].memo.remaining(e.clock.now());
        for op in [AdminOp::ForceClose, AdminOp::Reset] {
            e.force_open("a", Duration::from_secs(60)).await.unwrap();
            e.force_open("b", Duration::from_secs(60)).await.unwrap();
            e.apply_admin_event(&event(AdminOp::ForceOpen, "a"));
            assert_eq!(
                memo(&e, 0),
                Duration::from_secs(60),
                "force_open: nothing to do"
            );
            e.apply_admin_event(&event(op, "nope"));
            e.apply_admin_event(&event(op, "a"));
            assert_eq!(memo(&e, 0), Duration::ZERO, "{op:?} clears the memo");
            assert_eq!(
                memo(&e, 1),
                Duration::from_secs(60),
                "{op:?} of a touches only a"
            );
        }
    }
}
