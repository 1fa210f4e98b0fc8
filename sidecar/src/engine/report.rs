//! The end of an attempt and of a call (§3, §6–§9, §12): a Report settles the quota
//! and feeds the breaker, pacer and health; a permit never reported (call ended,
//! connection closed, lease expired) is abandoned: charged its estimate, its probe
//! lease released, its pacer slot freed, and no verdict reaches the breaker.

use std::future::Future;
use std::time::Duration;

use super::error::EngineError;
use super::runtime::bump;
use super::tables::{OwnerId, PermitRec};
use super::Engine;
use crate::backend::{Backend, BackendError};
use crate::gate::breaker::{Applied, State};
use crate::gate::pacer::Signal;
use crate::gate::quota::Settlement;
use crate::gate::{FailureKind, Outcome};

impl<B: Backend> Engine<B> {
    /// Report the outcome of the attempt made under `permit`.
    pub async fn report(
        &self,
        owner: OwnerId,
        permit: u64,
        outcome: Outcome,
    ) -> Result<Applied, EngineError> {
        if let Outcome::RateLimited {
            retry_after: Some(d),
        } = outcome
        {
            if d > Duration::from_secs(86_400) {
                return Err(EngineError::InvalidArgument(format!(
                    "retry_after_s {} is more than a day",
                    d.as_secs_f64()
                )));
            }
        }
        let now = self.clock.now();
        let p = self.lock().take_reported(owner, permit, &outcome, now)?;
        let src = &self.sources[p.source];
        bump(match outcome {
            Outcome::Success { .. } => &src.counters.successes,
            Outcome::Failure(_) => &src.counters.failures,
            Outcome::RateLimited { .. } => &src.counters.rate_limited,
            Outcome::Cancelled => &src.counters.cancelled,
        });
        let signal = match outcome {
            Outcome::Success { .. } => Signal::Increase,
            Outcome::RateLimited { .. } | Outcome::Failure(FailureKind::Timeout) => {
                Signal::Decrease
            }
            _ => Signal::Hold,
        };
        src.pacer.release(signal);
        match outcome {
            Outcome::Success { .. } => src.health.record(true, now.saturating_sub(p.granted_at)),
            Outcome::Failure(_) => src.health.record(false, now.saturating_sub(p.granted_at)),
            _ => {}
        }
        let bp = self.scopes[p.scope].policy().bp;
        let qp = src.params().qp;
        let r = if self.backend.is_remote() {
            let me = self.arc();
            tokio::spawn(async move {
                let src = &me.sources[p.source];
                me.backend
                    .report(&src.name, &bp, &qp, p.epoch, p.is_probe, p.tokens, outcome)
                    .await
            })
            .await
            .unwrap_or_else(|_| Err(BackendError::Unavailable("report task failed".into())))
        } else {
            self.backend
                .report(&src.name, &bp, &qp, p.epoch, p.is_probe, p.tokens, outcome)
                .await
        };
        let applied = match r {
            Ok(a) => a,
            Err(e) => {
                self.wake_one(p.source);
                return Err(EngineError::BackendUnavailable {
                    scope: self.scopes[p.scope].name.clone(),
                    message: e.to_string(),
                    reasons: Vec::new(),
                });
            }
        };
        self.note_state(p.source, &applied);
        if p.is_probe && applied.applied && applied.state == State::Closed {
            self.wake_all(p.source); // the probe closed the breaker: everyone may go
        } else {
            self.wake_one(p.source);
        }
        Ok(applied)
    }

    /// Forget the call; an unreported permit is abandoned (settled as if the upstream
    /// used the estimate, probe lease released).
    pub async fn end_call(&self, owner: OwnerId, call: u64) -> Result<(), EngineError> {
        let permit = self.lock().end_call(owner, call)?;
        if let Some(p) = permit {
            self.abandon_all(vec![p]).await;
        }
        Ok(())
    }

    /// Release everything `owner` holds (connection closed): permits settled as if the
    /// upstream used the estimate, probe leases released, pacer slots freed, calls
    /// forgotten. Waits of the owner end when their futures are dropped.
    pub async fn release_owner(&self, owner: OwnerId) {
        let permits = self.lock().release_owner(owner);
        self.abandon_all(permits).await;
    }

    /// Reclaim permits whose lease (2 × source timeout) expired; returns how many.
    /// The daemon calls this periodically.
    pub async fn reclaim_expired(&self) -> usize {
        let now = self.clock.now();
        let expired: Vec<PermitRec> = {
            let mut t = self.lock();
            let ids = t.expired(now);
            t.detach(&ids, now)
        };
        let n = expired.len();
        for p in &expired {
            tracing::warn!(source = %self.sources[p.source].name, "reclaimed a permit never reported within its lease");
        }
        self.abandon_all(expired).await;
        n
    }

    /// Settle abandoned permits (never reported: connection closed, call ended,
    /// lease expired): the quota keeps the estimate as if the upstream used it, a
    /// probe lease is released, the pacer slot freed; no verdict reaches the breaker.
    /// Every pacer slot is freed at once, then the backend work runs concurrently (two
    /// round trips each on Redis, none serialised behind another permit's), in tasks
    /// that finish even if the caller is dropped.
    async fn abandon_all(&self, permits: Vec<PermitRec>) {
        for p in &permits {
            self.sources[p.source].pacer.release(Signal::Hold);
            bump(&self.sources[p.source].counters.abandoned);
        }
        if self.backend.is_remote() {
            let tasks: Vec<_> = permits
                .into_iter()
                .map(|p| tokio::spawn(self.abandon_backend(p)))
                .collect();
            for t in tasks {
                let _ = t.await;
            }
        } else {
            for p in permits {
                self.abandon_backend(p).await;
            }
        }
    }

    /// The backend half of abandoning a permit: keep the estimate, release a probe.
    pub(super) fn abandon_backend(
        &self,
        p: PermitRec,
    ) -> impl Future<Output = ()> + Send + 'static {
        let me = self.arc();
        async move {
            let src = &me.sources[p.source];
            let how = Settlement::Charge { tokens: p.tokens };
            if let Err(e) = me
                .backend
                .settle(&src.name, &src.params().qp, p.tokens, how)
                .await
            {
                tracing::warn!(source = %src.name, error = %e, "could not settle an abandoned permit");
            }
            if let Err(e) = me.backend.neutral(&src.name, p.epoch, p.is_probe).await {
                tracing::warn!(source = %src.name, error = %e, "could not release an abandoned probe");
            }
            me.wake_one(p.source);
        }
    }

    /// A backend report that owns everything it needs, so it can run in its own task.
    pub(super) fn settle_detached(
        &self,
        scope: usize,
        source: usize,
        epoch: u64,
        is_probe: bool,
        tokens: u64,
        outcome: Outcome,
    ) -> impl Future<Output = ()> + Send + 'static {
        let me = self.arc();
        async move {
            let src = &me.sources[source];
            let bp = me.scopes[scope].policy().bp;
            let r = me
                .backend
                .report(
                    &src.name,
                    &bp,
                    &src.params().qp,
                    epoch,
                    is_probe,
                    tokens,
                    outcome,
                )
                .await;
            if let Err(e) = r {
                tracing::warn!(source = %src.name, error = %e, "could not release a grant");
            }
            me.wake_one(source);
        }
    }
}
