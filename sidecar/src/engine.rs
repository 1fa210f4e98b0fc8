//! The governance engine's public face: calls, permits, admission, reporting,
//! reclaim, admin and status. No socket code and no wire types live here; the server
//! maps [`ipc_protocol`] messages onto these calls.
//!
//! Ownership: every call and permit belongs to an `owner` (the server uses one owner id
//! per connection). Ids are only valid for their owner, and
//! [`Engine::release_owner`] releases everything an owner still holds (§12).

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Applied, Backend, Outcome, State};
use crate::clock::Clock;
use crate::config::Config;

/// Identifies who holds calls and permits (one per connection in the daemon).
pub type OwnerId = u64;

/// Why a source was skipped in an admission pass (§4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Memo or breaker refused.
    CircuitOpen,
    /// Pacer ceiling reached.
    Paced,
    /// Quota refused.
    RateLimited,
    /// Shared backend unreachable under `fail_closed`.
    BackendUnavailable,
}

/// Which budget of a call ran out (§5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exhaustion {
    /// Stall clock passed `stall_window`.
    Stalled,
    /// Quota/pacer refused under `quota_full = fail_fast`.
    QuotaExhausted,
    /// `max_attempts` used.
    RetryExhausted,
}

/// A granted permit.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    /// Permit id (unguessable-enough, never reused while live).
    pub permit: u64,
    /// Source to call.
    pub source: Arc<str>,
    /// This is the half-open probe.
    pub is_probe: bool,
    /// 1-based attempt number.
    pub attempt: u32,
    /// Tokens reserved.
    pub est_tokens: u64,
}

/// Engine errors; each maps to one wire error kind.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// Every source refused for circuit reasons under `circuit_open = fail_fast`.
    #[error("scope {scope:?}: every source's circuit is open (retry after {:.3}s)", retry_after.as_secs_f64())]
    CircuitOpen {
        /// Scope of the call.
        scope: String,
        /// §6 retry-after over all sources.
        retry_after: Duration,
        /// Per-source skip reasons of the last pass, config order.
        reasons: Vec<(String, SkipReason)>,
    },
    /// A call budget ran out.
    #[error("scope {scope:?}: all sources exhausted ({reason:?})")]
    Exhausted {
        /// Scope of the call.
        scope: String,
        /// Which budget.
        reason: Exhaustion,
        /// §6 retry-after over all sources (0 unless every source was open).
        retry_after: Duration,
        /// Per-source skip reasons of the last pass (empty for `retry_exhausted`
        /// decided before any pass).
        reasons: Vec<(String, SkipReason)>,
    },
    /// Shared backend unreachable and `on_backend_error = fail_closed`.
    #[error("scope {scope:?}: shared backend unreachable: {message}")]
    BackendUnavailable {
        /// Scope of the call.
        scope: String,
        /// What failed.
        message: String,
        /// Per-source skip reasons of the last pass.
        reasons: Vec<(String, SkipReason)>,
    },
    /// No such scope in the configuration.
    #[error("unknown scope {0:?}")]
    UnknownScope(String),
    /// No such live call for this owner.
    #[error("unknown call {0}")]
    UnknownCall(u64),
    /// No such live permit for this owner (already reported, reclaimed, or never
    /// granted).
    #[error("unknown permit {0}")]
    UnknownPermit(u64),
    /// No such source in the configuration.
    #[error("unknown source {0:?}")]
    UnknownSource(String),
    /// The call already waits in an Acquire or holds an unreported permit.
    #[error("call {0} already has an acquire in progress or an unreported permit")]
    Busy(u64),
    /// A bad argument; the message names it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The engine is shutting down.
    #[error("sidecar is shutting down")]
    ShuttingDown,
}

/// Live state of one source, for status.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceStatus {
    /// Source name.
    pub name: String,
    /// Breaker state.
    pub state: State,
    /// Breaker epoch.
    pub epoch: u64,
    /// §6 retry-after.
    pub retry_after: Duration,
    /// Cooldown level k.
    pub cooldown_level: u32,
    /// Window successes.
    pub window_successes: u64,
    /// Window failures.
    pub window_failures: u64,
    /// Failure streak.
    pub streak: u32,
    /// Remaining memo skip on this host.
    pub memo_remaining: Duration,
    /// Pacer ceiling on this host.
    pub pacer_ceiling: f64,
    /// Permits in flight on this host.
    pub in_flight: u32,
    /// tpm bucket level.
    pub tokens_available: Option<f64>,
    /// rpm bucket level.
    pub requests_available: Option<f64>,
    /// Remaining 429 block.
    pub quota_blocked: Duration,
    /// Served from local state because the shared backend is down.
    pub degraded: bool,
}

/// Live state of one scope, for status.
#[derive(Debug, Clone, PartialEq)]
pub struct ScopeStatus {
    /// Scope name.
    pub name: String,
    /// `wait` / `fail_fast`.
    pub circuit_open: &'static str,
    /// `wait` / `fail_fast`.
    pub quota_full: &'static str,
    /// Calls waiting in Acquire.
    pub waiters: u32,
    /// Live calls.
    pub calls: u32,
    /// Sources in config order.
    pub sources: Vec<SourceStatus>,
}

/// The engine. Cheap to share behind an `Arc`.
pub struct Engine<B: Backend> {
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend> Engine<B> {
    /// Build an engine over a validated configuration and a backend.
    pub fn new(_config: &Config, _backend: B, _clock: Arc<dyn Clock>) -> Arc<Self> {
        todo!()
    }

    /// Start a call in `scope`; the stall clock starts now.
    pub fn begin_call(
        &self,
        _owner: OwnerId,
        _scope: &str,
        _est_tokens: Option<u64>,
    ) -> Result<u64, EngineError> {
        todo!()
    }

    /// Run admission for the call (§4–§5); may wait. Cancel-safe: dropping the future
    /// ends the wait and leaves nothing reserved.
    pub async fn acquire(&self, _owner: OwnerId, _call: u64) -> Result<Grant, EngineError> {
        todo!()
    }

    /// Report the outcome of the attempt made under `permit`.
    pub async fn report(
        &self,
        _owner: OwnerId,
        _permit: u64,
        _outcome: Outcome,
    ) -> Result<Applied, EngineError> {
        todo!()
    }

    /// Forget the call; an unreported permit is settled as cancelled.
    pub async fn end_call(&self, _owner: OwnerId, _call: u64) -> Result<(), EngineError> {
        todo!()
    }

    /// Release everything `owner` holds (connection closed): permits settled as if the
    /// upstream used the estimate, probe leases released, pacer slots freed, calls
    /// forgotten. Waits of the owner end when their futures are dropped.
    pub async fn release_owner(&self, _owner: OwnerId) {
        todo!()
    }

    /// Reclaim permits whose lease (2 × source timeout) expired; returns how many.
    /// The daemon calls this periodically.
    pub async fn reclaim_expired(&self) -> usize {
        todo!()
    }

    /// Admin: open `source` for `duration`.
    pub async fn force_open(
        &self,
        _source: &str,
        _duration: Duration,
    ) -> Result<Applied, EngineError> {
        todo!()
    }

    /// Admin: close `source` now and clear its memo entry.
    pub async fn force_close(&self, _source: &str) -> Result<Applied, EngineError> {
        todo!()
    }

    /// Admin: forget `source`'s breaker and quota state and clear its memo entry.
    pub async fn reset(&self, _source: &str) -> Result<Applied, EngineError> {
        todo!()
    }

    /// Forget `source`'s memo entry (an admin op broadcast from another host).
    pub fn clear_memo(&self, _source: &str) {
        todo!()
    }

    /// Live state of every scope and source.
    pub async fn status(&self) -> Vec<ScopeStatus> {
        todo!()
    }

    /// End every wait with [`EngineError::ShuttingDown`] and refuse new acquires.
    pub fn shutdown(&self) {
        todo!()
    }

    /// The backend's name (`memory` / `redis`).
    pub fn backend_name(&self) -> &'static str {
        todo!()
    }
}
