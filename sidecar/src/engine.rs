//! The governance engine's public face: calls, permits, admission, reporting,
//! reclaim, admin and status. No socket code and no wire types live here; the server
//! maps [`ipc_protocol`] messages onto these calls.
//!
//! Ownership: every call and permit belongs to an `owner` (the server uses one owner id
//! per connection). Ids are only valid for their owner, and
//! [`Engine::release_owner`] releases everything an owner still holds (§12).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::admission::{nap, Granted, Pass};
use crate::backend::{
    Admit, Applied, BResult, Backend, BreakerParams, FailureKind, Outcome, QuotaParams, Settlement,
    State,
};
use crate::clock::Clock;
use crate::config::{Config, Mode, ScopeConfig};
use crate::health::Health;
use crate::memo::Memo;
use crate::pacer::{Pacer, Signal};

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

/// Host-local runtime state of one scope.
pub(crate) struct ScopeRt {
    /// Policy from the configuration.
    pub(crate) cfg: ScopeConfig,
    /// Breaker parameters derived from `cfg` (probe TTL included).
    pub(crate) bp: BreakerParams,
    /// Engine-wide indices of the scope's sources, config order.
    pub(crate) sources: Vec<usize>,
    /// Woken whenever something that could let a waiter through frees up (a permit
    /// reported, reclaimed or released; an admin op; shutdown). The nap is only the
    /// longest gap between checks.
    notify: Notify,
    /// Acquires of this scope currently sleeping.
    waiters: AtomicU32,
}

/// Host-local runtime state of one source (shared by every scope naming it).
pub(crate) struct SourceRt {
    /// Name (global key of breaker and quota).
    pub(crate) name: Arc<str>,
    /// Quota parameters.
    pub(crate) qp: QuotaParams,
    /// §7 default estimate.
    pub(crate) est_tokens: u64,
    /// A permit never reported is reclaimed after this (2 × timeout).
    lease: Duration,
    /// §8 AIMD pacer (parameters of the first scope naming the source).
    pub(crate) pacer: Pacer,
    /// §9 cooldown memo.
    pub(crate) memo: Memo,
    /// Recent outcomes for the health selector.
    pub(crate) health: Health,
    /// Scopes naming this source (to wake their waiters).
    scopes: Vec<usize>,
}

/// A live call.
#[derive(Debug)]
struct CallRec {
    /// Who may use it.
    owner: OwnerId,
    /// Scope index.
    scope: usize,
    /// The Acquire's own estimate.
    est_tokens: Option<u64>,
    /// Attempts granted so far (a cancelled attempt gives its attempt back).
    attempts: u32,
    /// Sources that failed in this call (call-local demotion), in failure order.
    failed: Vec<usize>,
    /// Stalled time accumulated before `stalled_since`.
    stalled: Duration,
    /// Since when the call is stalled; `None` while an attempt runs.
    stalled_since: Option<Duration>,
    /// An Acquire of this call is running.
    acquiring: bool,
    /// The call's unreported permit.
    permit: Option<u64>,
}

impl CallRec {
    fn stall(&self, now: Duration) -> Duration {
        self.stalled
            + self
                .stalled_since
                .map_or(Duration::ZERO, |s| now.saturating_sub(s))
    }
}

/// A live permit.
#[derive(Debug, Clone, Copy)]
struct PermitRec {
    /// Who may report it.
    owner: OwnerId,
    /// Its call.
    call: u64,
    /// Scope index of the call.
    scope: usize,
    /// Source index.
    source: usize,
    /// Breaker epoch of the grant.
    epoch: u64,
    /// Holds the probe lease.
    is_probe: bool,
    /// Tokens reserved.
    tokens: u64,
    /// When granted (latency for health).
    granted_at: Duration,
    /// When it is reclaimed if never reported.
    expires: Duration,
}

/// Calls and permits, under one short-held lock.
#[derive(Debug, Default)]
struct Tables {
    /// Live calls by id.
    calls: HashMap<u64, CallRec>,
    /// Live permits by id.
    permits: HashMap<u64, PermitRec>,
}

/// Counts for invariant checks in tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveCounts {
    /// Live calls.
    pub calls: usize,
    /// Live permits.
    pub permits: usize,
    /// Live permits holding a probe lease.
    pub probes: usize,
    /// Sum of pacer in-flight over all sources.
    pub pacer_in_flight: u32,
    /// Tokens reserved by live permits.
    pub reserved_tokens: u64,
    /// The most live probe permits any one source has (must never exceed 1).
    pub max_probes_per_source: usize,
}

/// The engine. Cheap to share behind an `Arc`.
pub struct Engine<B: Backend> {
    /// Self-reference, for tasks that must outlive a cancelled caller.
    me: Weak<Engine<B>>,
    /// Where breaker and quota state lives.
    backend: B,
    /// Host clock (stall clock, memo, leases).
    pub(crate) clock: Arc<dyn Clock>,
    /// Scopes, config order.
    pub(crate) scopes: Vec<ScopeRt>,
    /// Scope name → index.
    scope_index: HashMap<String, usize>,
    /// Every distinct source.
    pub(crate) sources: Vec<SourceRt>,
    /// Source name → index.
    source_index: HashMap<String, usize>,
    /// Calls and permits.
    tables: Mutex<Tables>,
    /// Cancelled on shutdown: ends every wait.
    shutdown: CancellationToken,
}

/// Clears a call's `acquiring` flag when the Acquire ends, however it ends.
struct AcquireGuard<'a, B: Backend> {
    engine: &'a Engine<B>,
    call: u64,
}

impl<B: Backend> Drop for AcquireGuard<'_, B> {
    fn drop(&mut self) {
        if let Some(c) = self.engine.lock().calls.get_mut(&self.call) {
            c.acquiring = false;
        }
    }
}

/// Counts a sleeping Acquire in its scope's `waiters`.
struct WaiterGuard<'a>(&'a AtomicU32);

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A grant not yet turned into a permit. Dropping it unrecorded (cancelled Acquire,
/// call ended meanwhile) gives everything back: nothing was sent upstream.
struct Ticket<'a, B: Backend> {
    engine: &'a Engine<B>,
    scope: usize,
    grant: Option<Granted>,
}

impl<B: Backend> Drop for Ticket<'_, B> {
    fn drop(&mut self) {
        if let Some(g) = self.grant.take() {
            self.engine.undo_grant(self.scope, g);
        }
    }
}

fn mode_str(m: Mode) -> &'static str {
    m.as_str()
}

impl<B: Backend> Engine<B> {
    /// Build an engine over a validated configuration and a backend.
    pub fn new(config: &Config, backend: B, clock: Arc<dyn Clock>) -> Arc<Self> {
        let mut sources: Vec<SourceRt> = Vec::new();
        let mut source_index: HashMap<String, usize> = HashMap::new();
        let mut scopes = Vec::new();
        let mut scope_index = HashMap::new();
        for (si, sc) in config.scopes.iter().enumerate() {
            let mut idxs = Vec::new();
            for s in &sc.sources {
                let idx = *source_index.entry(s.name.clone()).or_insert_with(|| {
                    sources.push(SourceRt {
                        name: Arc::from(s.name.as_str()),
                        qp: QuotaParams {
                            tpm: s.tpm,
                            rpm: s.rpm,
                        },
                        est_tokens: s.default_est_tokens(),
                        lease: s.permit_lease(),
                        pacer: Pacer::new(sc.pacer),
                        memo: Memo::default(),
                        health: Health::default(),
                        scopes: Vec::new(),
                    });
                    sources.len() - 1
                });
                if !sources[idx].scopes.contains(&si) {
                    sources[idx].scopes.push(si);
                }
                idxs.push(idx);
            }
            let b = sc.breaker;
            scopes.push(ScopeRt {
                bp: BreakerParams {
                    failure_threshold: b.failure_threshold,
                    failure_rate: b.failure_rate,
                    min_calls: b.min_calls,
                    window: b.window,
                    cooldown: b.cooldown,
                    max_cooldown: b.max_cooldown,
                    probe_ttl: sc.probe_ttl(),
                },
                cfg: sc.clone(),
                sources: idxs,
                notify: Notify::new(),
                waiters: AtomicU32::new(0),
            });
            scope_index.insert(sc.name.clone(), si);
        }
        Arc::new_cyclic(|me| Engine {
            me: me.clone(),
            backend,
            clock,
            scopes,
            scope_index,
            sources,
            source_index,
            tables: Mutex::new(Tables::default()),
            shutdown: CancellationToken::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn arc(&self) -> Arc<Self> {
        self.me.upgrade().expect("engine used after drop")
    }

    /// The backend (for tests and status).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn wake(&self, source: usize) {
        for &s in &self.sources[source].scopes {
            self.scopes[s].notify.notify_waiters();
        }
    }

    /// A fresh id, nonzero and not live in `taken`.
    fn fresh_id<V>(taken: &HashMap<u64, V>) -> u64 {
        loop {
            let id: u64 = rand::random();
            if id != 0 && !taken.contains_key(&id) {
                return id;
            }
        }
    }

    fn source_idx(&self, source: &str) -> Result<usize, EngineError> {
        self.source_index
            .get(source)
            .copied()
            .ok_or_else(|| EngineError::UnknownSource(source.to_string()))
    }

    /// Start a call in `scope`; the stall clock starts now.
    pub fn begin_call(
        &self,
        owner: OwnerId,
        scope: &str,
        est_tokens: Option<u64>,
    ) -> Result<u64, EngineError> {
        let si = *self
            .scope_index
            .get(scope)
            .ok_or_else(|| EngineError::UnknownScope(scope.to_string()))?;
        let now = self.clock.now();
        let mut t = self.lock();
        let id = Self::fresh_id(&t.calls);
        t.calls.insert(
            id,
            CallRec {
                owner,
                scope: si,
                est_tokens,
                attempts: 0,
                failed: Vec::new(),
                stalled: Duration::ZERO,
                stalled_since: Some(now),
                acquiring: false,
                permit: None,
            },
        );
        Ok(id)
    }

    fn reasons_of(
        &self,
        scope: usize,
        reasons: &[Option<SkipReason>],
    ) -> Vec<(String, SkipReason)> {
        self.scopes[scope]
            .sources
            .iter()
            .zip(reasons)
            .filter_map(|(&idx, r)| r.map(|r| (self.sources[idx].name.to_string(), r)))
            .collect()
    }

    /// Run admission for the call (§4–§5); may wait. Cancel-safe: dropping the future
    /// ends the wait and leaves nothing reserved.
    pub async fn acquire(&self, owner: OwnerId, call: u64) -> Result<Grant, EngineError> {
        if self.shutdown.is_cancelled() {
            return Err(EngineError::ShuttingDown);
        }
        let si = {
            let mut t = self.lock();
            let c = t
                .calls
                .get_mut(&call)
                .filter(|c| c.owner == owner)
                .ok_or(EngineError::UnknownCall(call))?;
            if c.acquiring || c.permit.is_some() {
                return Err(EngineError::Busy(call));
            }
            c.acquiring = true;
            c.scope
        };
        let _acquiring = AcquireGuard { engine: self, call };
        let sc = &self.scopes[si];
        let cfg = &sc.cfg;
        let scope_name = || cfg.name.clone();
        let mut reasons: Vec<Option<SkipReason>> = vec![None; sc.sources.len()];
        let mut waiting: Option<WaiterGuard<'_>> = None;
        let mut failed = Vec::new();
        loop {
            // Register for early wake-ups before looking, so none is missed.
            let notified = sc.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            let (attempts, stall, est) = {
                let t = self.lock();
                let c = t.calls.get(&call).ok_or(EngineError::UnknownCall(call))?;
                failed.clone_from(&c.failed);
                (c.attempts, c.stall(self.clock.now()), c.est_tokens)
            };
            if attempts >= cfg.max_attempts {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::RetryExhausted,
                    retry_after: Duration::ZERO,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            if stall > cfg.stall_window {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::Stalled,
                    retry_after: Duration::ZERO,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            let refused = match self.pass(si, &failed, est, &mut reasons).await {
                Pass::Granted(g) => {
                    let ticket = Ticket {
                        engine: self,
                        scope: si,
                        grant: Some(g),
                    };
                    let (grant, stale) = self.record_grant(owner, call, ticket)?;
                    for p in stale {
                        self.abandon(p).await;
                    }
                    return Ok(grant);
                }
                Pass::Refused(r) => r,
            };
            if let Some(message) = refused.unavailable {
                return Err(EngineError::BackendUnavailable {
                    scope: scope_name(),
                    message,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            // §5 dispatch.
            let hint = if refused.gate_rejections == sc.sources.len() {
                let hint = refused.circuit_retry_after.unwrap_or(Duration::ZERO);
                if cfg.circuit_open == Mode::FailFast {
                    return Err(EngineError::CircuitOpen {
                        scope: scope_name(),
                        retry_after: hint,
                        reasons: self.reasons_of(si, &reasons),
                    });
                }
                hint
            } else {
                if cfg.quota_full == Mode::FailFast {
                    return Err(EngineError::Exhausted {
                        scope: scope_name(),
                        reason: Exhaustion::QuotaExhausted,
                        retry_after: Duration::ZERO,
                        reasons: self.reasons_of(si, &reasons),
                    });
                }
                Duration::ZERO
            };
            let stall = {
                let t = self.lock();
                t.calls
                    .get(&call)
                    .ok_or(EngineError::UnknownCall(call))?
                    .stall(self.clock.now())
            };
            if stall > cfg.stall_window {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::Stalled,
                    retry_after: hint,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            let sleep = nap(
                hint,
                cfg.poll_interval,
                cfg.stall_window,
                stall,
                rand::random::<f64>(),
            );
            if waiting.is_none() {
                sc.waiters.fetch_add(1, Ordering::Relaxed);
                waiting = Some(WaiterGuard(&sc.waiters));
                tracing::info!(
                    scope = %cfg.name,
                    reasons = ?self.reasons_of(si, &reasons),
                    sleep_s = sleep.as_secs_f64(),
                    "wait started"
                );
            }
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                _ = notified => {}
                _ = self.shutdown.cancelled() => return Err(EngineError::ShuttingDown),
            }
        }
    }

    /// Turn a pass's grant into a permit of the call (or give it back if the call
    /// ended meanwhile). A new probe means the breaker saw the previous probe's lease
    /// expire: any older probe permit of the source still held here is returned for
    /// reclaiming at once, so this host never holds two probes of one source (the
    /// periodic reclaim could otherwise lag the lease by up to its period).
    fn record_grant(
        &self,
        owner: OwnerId,
        call: u64,
        mut ticket: Ticket<'_, B>,
    ) -> Result<(Grant, Vec<PermitRec>), EngineError> {
        let g = ticket.grant.expect("ticket armed");
        let src = &self.sources[g.source];
        let now = self.clock.now();
        let mut t = self.lock();
        let permit = Self::fresh_id(&t.permits);
        let Some(c) = t.calls.get_mut(&call) else {
            drop(t);
            return Err(EngineError::UnknownCall(call)); // ticket drop gives it back
        };
        c.attempts += 1;
        c.permit = Some(permit);
        c.stalled = c.stall(now);
        c.stalled_since = None;
        let attempt = c.attempts;
        let scope = c.scope;
        t.permits.insert(
            permit,
            PermitRec {
                owner,
                call,
                scope,
                source: g.source,
                epoch: g.epoch,
                is_probe: g.is_probe,
                tokens: g.tokens,
                granted_at: now,
                expires: now + src.lease,
            },
        );
        let stale = if g.is_probe {
            let ids: Vec<u64> = t
                .permits
                .iter()
                .filter(|(&id, p)| id != permit && p.is_probe && p.source == g.source)
                .map(|(&id, _)| id)
                .collect();
            self.detach_permits(&mut t, &ids, now)
        } else {
            Vec::new()
        };
        drop(t);
        ticket.grant = None;
        let grant = Grant {
            permit,
            source: src.name.clone(),
            is_probe: g.is_probe,
            attempt,
            est_tokens: g.tokens,
        };
        Ok((grant, stale))
    }

    /// Give back a grant that never became a permit: nothing was sent.
    fn undo_grant(&self, scope: usize, g: Granted) {
        self.sources[g.source].pacer.release(Signal::Hold);
        let settle = self.settle_detached(
            scope,
            g.source,
            g.epoch,
            g.is_probe,
            g.tokens,
            Outcome::Cancelled,
        );
        if self.backend.is_remote() {
            tokio::spawn(settle);
        } else {
            // The memory backend completes in one poll; run it to the end here.
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            let mut settle = std::pin::pin!(settle);
            let _ = settle.as_mut().poll(&mut cx);
        }
        self.wake(g.source);
    }

    /// A backend report that owns everything it needs, so it can run in its own task.
    fn settle_detached(
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
            let r = me
                .backend
                .report(
                    &src.name,
                    &me.scopes[scope].bp,
                    &src.qp,
                    epoch,
                    is_probe,
                    tokens,
                    outcome,
                )
                .await;
            if let Err(e) = r {
                tracing::warn!(source = %src.name, error = %e, "could not release a grant");
            }
            me.wake(source);
        }
    }

    /// Gates 3–4 for one source; a remote backend's round trip runs in its own task so
    /// a dropped Acquire cannot strand a half-made grant.
    pub(crate) async fn backend_admit(
        &self,
        scope: usize,
        source: usize,
        tokens: u64,
    ) -> BResult<Admit> {
        let src = &self.sources[source];
        let bp = self.scopes[scope].bp;
        if !self.backend.is_remote() {
            return self.backend.admit(&src.name, &bp, &src.qp, tokens).await;
        }
        let me = self.arc();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let src = &me.sources[source];
            let r = me.backend.admit(&src.name, &bp, &src.qp, tokens).await;
            if let Err(Ok(Admit::Granted { epoch, is_probe })) = tx.send(r) {
                // The Acquire was cancelled while we were away: give the grant back.
                src.pacer.release(Signal::Hold);
                me.settle_detached(scope, source, epoch, is_probe, tokens, Outcome::Cancelled)
                    .await;
            }
        });
        rx.await.unwrap_or_else(|_| {
            Err(crate::backend::BackendError::Unavailable(
                "admission task failed".into(),
            ))
        })
    }

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
        let p = {
            let mut t = self.lock();
            let p = *t
                .permits
                .get(&permit)
                .filter(|p| p.owner == owner)
                .ok_or(EngineError::UnknownPermit(permit))?;
            t.permits.remove(&permit);
            if let Some(c) = t.calls.get_mut(&p.call) {
                c.permit = None;
                c.stalled_since = Some(now);
                match outcome {
                    Outcome::Failure(_) | Outcome::RateLimited { .. } => {
                        if !c.failed.contains(&p.source) {
                            c.failed.push(p.source);
                        }
                    }
                    // Nothing was sent: the attempt is given back.
                    Outcome::Cancelled => c.attempts = c.attempts.saturating_sub(1),
                    Outcome::Success { .. } => {}
                }
            }
            p
        };
        let src = &self.sources[p.source];
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
        let bp = &self.scopes[p.scope].bp;
        let r = if self.backend.is_remote() {
            let me = self.arc();
            let bp = *bp;
            tokio::spawn(async move {
                let src = &me.sources[p.source];
                me.backend
                    .report(
                        &src.name, &bp, &src.qp, p.epoch, p.is_probe, p.tokens, outcome,
                    )
                    .await
            })
            .await
            .unwrap_or_else(|_| {
                Err(crate::backend::BackendError::Unavailable(
                    "report task failed".into(),
                ))
            })
        } else {
            self.backend
                .report(
                    &src.name, bp, &src.qp, p.epoch, p.is_probe, p.tokens, outcome,
                )
                .await
        };
        self.wake(p.source);
        let applied = r.map_err(|e| EngineError::BackendUnavailable {
            scope: self.scopes[p.scope].cfg.name.clone(),
            message: e.to_string(),
            reasons: Vec::new(),
        })?;
        self.note_state(p.source, &applied);
        Ok(applied)
    }

    /// Keep the memo in step with a state the backend just told us.
    fn note_state(&self, source: usize, a: &Applied) {
        let memo = &self.sources[source].memo;
        match a.state {
            State::Open if !a.retry_after.is_zero() => {
                memo.set_until(self.clock.now() + a.retry_after)
            }
            State::Closed => memo.clear(),
            _ => {}
        }
    }

    /// Settle an abandoned permit (never reported: connection closed, call ended,
    /// lease expired): the quota keeps the estimate as if the upstream used it, a
    /// probe lease is released, the pacer slot freed. No verdict reaches the breaker.
    async fn abandon(&self, p: PermitRec) {
        let src = &self.sources[p.source];
        src.pacer.release(Signal::Hold);
        let work = {
            let me = self.arc();
            async move {
                let src = &me.sources[p.source];
                let how = Settlement::Charge { tokens: p.tokens };
                if let Err(e) = me.backend.settle(&src.name, &src.qp, p.tokens, how).await {
                    tracing::warn!(source = %src.name, error = %e, "could not settle an abandoned permit");
                }
                if let Err(e) = me.backend.neutral(&src.name, p.epoch, p.is_probe).await {
                    tracing::warn!(source = %src.name, error = %e, "could not release an abandoned probe");
                }
                me.wake(p.source);
            }
        };
        if self.backend.is_remote() {
            let _ = tokio::spawn(work).await;
        } else {
            work.await;
        }
    }

    /// Forget the call; an unreported permit is abandoned (settled as if the upstream
    /// used the estimate, probe lease released).
    pub async fn end_call(&self, owner: OwnerId, call: u64) -> Result<(), EngineError> {
        let permit = {
            let mut t = self.lock();
            if t.calls.get(&call).is_none_or(|c| c.owner != owner) {
                return Err(EngineError::UnknownCall(call));
            }
            let c = t.calls.remove(&call).expect("checked");
            c.permit.and_then(|id| t.permits.remove(&id))
        };
        if let Some(p) = permit {
            self.abandon(p).await;
        }
        Ok(())
    }

    /// Release everything `owner` holds (connection closed): permits settled as if the
    /// upstream used the estimate, probe leases released, pacer slots freed, calls
    /// forgotten. Waits of the owner end when their futures are dropped.
    pub async fn release_owner(&self, owner: OwnerId) {
        let permits: Vec<PermitRec> = {
            let mut t = self.lock();
            t.calls.retain(|_, c| c.owner != owner);
            let ids: Vec<u64> = t
                .permits
                .iter()
                .filter(|(_, p)| p.owner == owner)
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| t.permits.remove(id)).collect()
        };
        for p in permits {
            self.abandon(p).await;
        }
    }

    /// Take permits out of the tables as reclaimed: their calls go on (the attempt
    /// counted, stall clock running again); the caller must `abandon` them.
    fn detach_permits(&self, t: &mut Tables, ids: &[u64], now: Duration) -> Vec<PermitRec> {
        let ps: Vec<PermitRec> = ids.iter().filter_map(|id| t.permits.remove(id)).collect();
        for p in &ps {
            if let Some(c) = t.calls.get_mut(&p.call) {
                c.permit = None;
                c.stalled_since = Some(now);
            }
        }
        ps
    }

    /// Reclaim permits whose lease (2 × source timeout) expired; returns how many.
    /// The daemon calls this periodically.
    pub async fn reclaim_expired(&self) -> usize {
        let now = self.clock.now();
        let expired: Vec<PermitRec> = {
            let mut t = self.lock();
            let ids: Vec<u64> = t
                .permits
                .iter()
                .filter(|(_, p)| p.expires <= now)
                .map(|(&id, _)| id)
                .collect();
            let ps: Vec<PermitRec> = ids.iter().filter_map(|id| t.permits.remove(id)).collect();
            for p in &ps {
                if let Some(c) = t.calls.get_mut(&p.call) {
                    c.permit = None;
                    c.stalled_since = Some(now);
                }
            }
            ps
        };
        let n = expired.len();
        for p in expired {
            tracing::warn!(source = %self.sources[p.source].name, "reclaimed a permit never reported within its lease");
            self.abandon(p).await;
        }
        n
    }

    fn admin_result(&self, source: usize, r: BResult<Applied>) -> Result<Applied, EngineError> {
        let a = r.map_err(|e| EngineError::BackendUnavailable {
            scope: String::new(),
            message: e.to_string(),
            reasons: Vec::new(),
        })?;
        self.wake(source);
        Ok(a)
    }

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
        self.sources[idx].memo.clear();
        self.admin_result(idx, r)
    }

    /// Admin: forget `source`'s breaker and quota state and clear its memo entry.
    pub async fn reset(&self, source: &str) -> Result<Applied, EngineError> {
        let idx = self.source_idx(source)?;
        let r = self.backend.reset(source).await;
        self.sources[idx].memo.clear();
        self.admin_result(idx, r)
    }

    /// Forget `source`'s memo entry (an admin op broadcast from another host).
    pub fn clear_memo(&self, source: &str) {
        if let Some(&idx) = self.source_index.get(source) {
            self.sources[idx].memo.clear();
            self.wake(idx);
        }
    }

    /// Live state of every scope and source.
    pub async fn status(&self) -> Vec<ScopeStatus> {
        let calls_per_scope: Vec<u32> = {
            let t = self.lock();
            let mut v = vec![0u32; self.scopes.len()];
            for c in t.calls.values() {
                v[c.scope] += 1;
            }
            v
        };
        let mut out = Vec::with_capacity(self.scopes.len());
        for (si, sc) in self.scopes.iter().enumerate() {
            let mut sources = Vec::with_capacity(sc.sources.len());
            for &idx in &sc.sources {
                let src = &self.sources[idx];
                let now = self.clock.now();
                let (pacer_ceiling, in_flight) = src.pacer.view();
                let snap = self.backend.snapshot(&src.name, &sc.bp, &src.qp).await;
                let mut st = SourceStatus {
                    name: src.name.to_string(),
                    state: State::Closed,
                    epoch: 0,
                    retry_after: Duration::ZERO,
                    cooldown_level: 0,
                    window_successes: 0,
                    window_failures: 0,
                    streak: 0,
                    memo_remaining: src.memo.remaining(now),
                    pacer_ceiling,
                    in_flight,
                    tokens_available: None,
                    requests_available: None,
                    quota_blocked: Duration::ZERO,
                    degraded: self.backend.degraded(&src.name),
                };
                match snap {
                    Ok(s) => {
                        st.state = s.state;
                        st.epoch = s.epoch;
                        st.retry_after = s.retry_after;
                        st.cooldown_level = s.cooldown_level;
                        st.window_successes = s.window_successes;
                        st.window_failures = s.window_failures;
                        st.streak = s.streak;
                        st.tokens_available = s.tokens_available;
                        st.requests_available = s.requests_available;
                        st.quota_blocked = s.quota_blocked;
                    }
                    Err(e) => {
                        tracing::debug!(source = %src.name, error = %e, "status: backend snapshot failed");
                        st.degraded = true;
                    }
                }
                sources.push(st);
            }
            out.push(ScopeStatus {
                name: sc.cfg.name.clone(),
                circuit_open: mode_str(sc.cfg.circuit_open),
                quota_full: mode_str(sc.cfg.quota_full),
                waiters: sc.waiters.load(Ordering::Relaxed),
                calls: calls_per_scope[si],
                sources,
            });
        }
        out
    }

    /// End every wait with [`EngineError::ShuttingDown`] and refuse new acquires.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
        for sc in &self.scopes {
            sc.notify.notify_waiters();
        }
    }

    /// The backend's name (`memory` / `redis`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Counts for invariant checks (tests, debugging).
    #[doc(hidden)]
    pub fn live_counts(&self) -> LiveCounts {
        let t = self.lock();
        LiveCounts {
            calls: t.calls.len(),
            permits: t.permits.len(),
            probes: t.permits.values().filter(|p| p.is_probe).count(),
            pacer_in_flight: self.sources.iter().map(|s| s.pacer.view().1).sum(),
            reserved_tokens: t.permits.values().map(|p| p.tokens).sum(),
            max_probes_per_source: (0..self.sources.len())
                .map(|s| {
                    t.permits
                        .values()
                        .filter(|p| p.is_probe && p.source == s)
                        .count()
                })
                .max()
                .unwrap_or(0),
        }
    }

    /// The earliest lease expiry among live permits (tests: no permit outlives it).
    #[doc(hidden)]
    pub fn oldest_permit_expiry(&self) -> Option<Duration> {
        self.lock().permits.values().map(|p| p.expires).min()
    }
}
