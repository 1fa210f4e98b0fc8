//! The governance engine's public face: calls, permits, admission, reporting,
//! reclaim, admin and status. No socket code and no wire types live here; the server
//! maps [`ipc_protocol`] messages onto these calls.
//!
//! Ownership: every call and permit belongs to an `owner` (the server uses one owner id
//! per connection). Ids are only valid for their owner, and
//! [`Engine::release_owner`] releases everything an owner still holds (§12).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::admission::{nap, Granted, Pass};
use crate::backend::{
    Admit, Applied, BResult, Backend, BreakerParams, FailureKind, Outcome, QuotaParams, Settlement,
    SourceSnapshot, State,
};
use crate::clock::Clock;
use crate::config::{Config, Mode, ScopeConfig, SourceConfig};
use crate::gate::health::Health;
use crate::gate::memo::{Memo, QuotaHint};
use crate::gate::pacer::{Pacer, Signal};

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
    #[error("{}", scoped(scope, message))]
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

/// `scope "x": message`, or just the message for errors outside a call (admin).
fn scoped(scope: &str, message: &str) -> String {
    if scope.is_empty() {
        message.to_string()
    } else {
        format!("scope {scope:?}: {message}")
    }
}

/// Live state of one source, for status.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceStatus {
    /// Source name.
    pub name: String,
    /// The backend's view: breaker and quota (defaults when it could not be read,
    /// with `degraded` set).
    pub shared: SourceSnapshot,
    /// Remaining memo skip on this host.
    pub memo_remaining: Duration,
    /// Pacer ceiling on this host.
    pub pacer_ceiling: f64,
    /// Permits in flight on this host.
    pub in_flight: u32,
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

/// A scope's policy: everything SIGHUP may change about it. Swapped whole, so one
/// admission pass always sees one consistent policy.
pub(crate) struct Policy {
    /// Policy from the configuration.
    pub(crate) cfg: ScopeConfig,
    /// Breaker parameters derived from `cfg` (probe TTL included).
    pub(crate) bp: BreakerParams,
}

impl Policy {
    fn new(sc: &ScopeConfig) -> Self {
        let b = sc.breaker;
        Policy {
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
        }
    }
}

/// Per-source parameters SIGHUP may change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SourceParams {
    /// Quota parameters.
    pub(crate) qp: QuotaParams,
    /// §7 default estimate.
    pub(crate) est_tokens: u64,
    /// A permit never reported is reclaimed after this (2 × timeout).
    pub(crate) lease: Duration,
}

impl SourceParams {
    fn new(s: &SourceConfig) -> Self {
        SourceParams {
            qp: QuotaParams {
                tpm: s.tpm,
                rpm: s.rpm,
            },
            est_tokens: s.default_est_tokens(),
            lease: s.permit_lease(),
        }
    }
}

/// Monotonic counters of one scope, for `/metrics`.
#[derive(Debug, Default)]
pub struct ScopeCounters {
    /// Acquires that started waiting (one per Acquire, not per wake-up).
    pub waits: AtomicU64,
    /// Acquires that ended `CircuitOpen`.
    pub circuit_open: AtomicU64,
    /// Acquires that ended `stalled`.
    pub stalled: AtomicU64,
    /// Acquires that ended `quota_exhausted`.
    pub quota_exhausted: AtomicU64,
    /// Acquires that ended `retry_exhausted`.
    pub retry_exhausted: AtomicU64,
    /// Acquires refused because the shared backend is unreachable (`fail_closed`).
    pub backend_unavailable: AtomicU64,
}

/// Monotonic counters of one source, for `/metrics`.
#[derive(Debug, Default)]
pub struct SourceCounters {
    /// Permits granted.
    pub grants: AtomicU64,
    /// Of which probes.
    pub probes: AtomicU64,
    /// Reported successes.
    pub successes: AtomicU64,
    /// Reported failures.
    pub failures: AtomicU64,
    /// Reported 429s.
    pub rate_limited: AtomicU64,
    /// Reported cancellations.
    pub cancelled: AtomicU64,
    /// Permits abandoned (connection closed, EndCall, lease expired).
    pub abandoned: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Host-local runtime state of one scope.
pub(crate) struct ScopeRt {
    /// Scope name (fixed: renaming is a topology change).
    pub(crate) name: String,
    /// Current policy; replaced by `reload`.
    policy: RwLock<Arc<Policy>>,
    /// Engine-wide indices of the scope's sources, config order.
    pub(crate) sources: Vec<usize>,
    /// Woken whenever something that could let a waiter through frees up (a permit
    /// reported, reclaimed or released; an admin op; shutdown). The nap is only the
    /// longest gap between checks.
    notify: Notify,
    /// Acquires of this scope currently sleeping.
    waiters: AtomicU32,
    /// Counters for `/metrics`.
    pub(crate) counters: ScopeCounters,
}

/// Host-local runtime state of one source (shared by every scope naming it).
pub(crate) struct SourceRt {
    /// Name (global key of breaker and quota).
    pub(crate) name: Arc<str>,
    /// Quota, estimate and lease; replaced by `reload`.
    params: RwLock<SourceParams>,
    /// §8 AIMD pacer (parameters of the first scope naming the source).
    pub(crate) pacer: Pacer,
    /// §9 cooldown memo.
    pub(crate) memo: Memo,
    /// Recent quota refusal, shared by this host's waiters (one backend check per tick).
    pub(crate) quota_hint: QuotaHint,
    /// Recent outcomes for the health selector.
    pub(crate) health: Health,
    /// Scopes naming this source (to wake their waiters).
    scopes: Vec<usize>,
    /// Counters for `/metrics`.
    pub(crate) counters: SourceCounters,
    /// When a rejected backend operation was last logged (nanos on the engine clock
    /// + 1; 0 = never), to log at most every 10 s per source.
    error_logged: AtomicU64,
}

impl ScopeRt {
    /// The current policy (cheap: one `Arc` clone under a read lock).
    pub(crate) fn policy(&self) -> Arc<Policy> {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl SourceRt {
    /// The current parameters.
    pub(crate) fn params(&self) -> SourceParams {
        *self.params.read().unwrap_or_else(|e| e.into_inner())
    }
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

/// Most live calls one owner (connection) may hold: a client that begins calls and
/// never ends them must not grow the daemon without bound.
pub const MAX_CALLS_PER_OWNER: u32 = 10_000;

/// Calls and permits, under one short-held lock.
#[derive(Debug, Default)]
struct Tables {
    /// Live calls by id.
    calls: HashMap<u64, CallRec>,
    /// Live calls per owner (for the cap).
    owner_calls: HashMap<OwnerId, u32>,
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

/// A remote admission's answer in transit from its task to the Acquire. If it is
/// dropped unread (the Acquire was cancelled during the round trip, before or after
/// the send), a grant in it is given back to the backend. The pacer slot is not
/// touched here: the pass's slot guard released it when the Acquire was dropped.
struct AdmitResult<B: Backend> {
    engine: Arc<Engine<B>>,
    scope: usize,
    source: usize,
    tokens: u64,
    result: Option<BResult<Admit>>,
}

impl<B: Backend> Drop for AdmitResult<B> {
    fn drop(&mut self) {
        if let Some(Ok(Admit::Granted { epoch, is_probe })) = self.result.take() {
            let undo = self.engine.settle_detached(
                self.scope,
                self.source,
                epoch,
                is_probe,
                self.tokens,
                Outcome::Cancelled,
            );
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(undo);
            }
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
                        params: RwLock::new(SourceParams::new(s)),
                        pacer: Pacer::new(sc.pacer),
                        memo: Memo::default(),
                        quota_hint: QuotaHint::default(),
                        health: Health::default(),
                        scopes: Vec::new(),
                        counters: SourceCounters::default(),
                        error_logged: AtomicU64::new(0),
                    });
                    sources.len() - 1
                });
                if !sources[idx].scopes.contains(&si) {
                    sources[idx].scopes.push(si);
                }
                idxs.push(idx);
            }
            scopes.push(ScopeRt {
                name: sc.name.clone(),
                policy: RwLock::new(Arc::new(Policy::new(sc))),
                sources: idxs,
                notify: Notify::new(),
                waiters: AtomicU32::new(0),
                counters: ScopeCounters::default(),
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

    /// Log a backend error that is not an outage (the store rejected the operation),
    /// at most once every 10 s per source so a persistent one cannot flood the log.
    pub(crate) fn log_backend_error(&self, source: usize, e: &crate::backend::BackendError) {
        const EVERY: u64 = 10_000_000_000;
        let now = self.clock.now().as_nanos() as u64 + 1;
        let src = &self.sources[source];
        let last = src.error_logged.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= EVERY)
            && src
                .error_logged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(source = %src.name, error = %e, "backend rejected an admission; source skipped");
        }
    }

    /// One resource of `source` freed (a pacer slot, a reservation, a probe lease):
    /// wake one waiter per scope naming it. Only one can use it, and waking them all
    /// would cost a pass per waiter for every freed slot; if the woken one cannot use
    /// it, the others' next nap (at most `poll_interval` away) picks it up.
    fn wake_one(&self, source: usize) {
        // Whatever was freed may be quota: let the next admission ask the backend.
        self.sources[source].quota_hint.clear();
        for &s in &self.sources[source].scopes {
            self.scopes[s].notify.notify_one();
        }
    }

    /// The source's state changed so that many may proceed (closed, reset, memo
    /// cleared): wake every waiter of every scope naming it.
    fn wake_all(&self, source: usize) {
        self.sources[source].quota_hint.clear();
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
        let n = t.owner_calls.entry(owner).or_insert(0);
        if *n >= MAX_CALLS_PER_OWNER {
            return Err(EngineError::InvalidArgument(format!(
                "this connection already holds {MAX_CALLS_PER_OWNER} live calls (the limit); \
                 end calls (EndCall) before beginning more"
            )));
        }
        *n += 1;
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
        let r = self.acquire_inner(owner, call).await;
        if let Err(e) = &r {
            self.count_error(e);
        }
        r
    }

    /// Count an Acquire that ended in a gateway error (grants are counted in
    /// `record_grant`, which knows the source's index).
    fn count_error(&self, e: &EngineError) {
        let scope = match e {
            EngineError::CircuitOpen { scope, .. }
            | EngineError::Exhausted { scope, .. }
            | EngineError::BackendUnavailable { scope, .. } => scope,
            _ => return,
        };
        let Some(&si) = self.scope_index.get(scope) else {
            return;
        };
        let c = &self.scopes[si].counters;
        bump(match e {
            EngineError::CircuitOpen { .. } => &c.circuit_open,
            EngineError::Exhausted {
                reason: Exhaustion::Stalled,
                ..
            } => &c.stalled,
            EngineError::Exhausted {
                reason: Exhaustion::QuotaExhausted,
                ..
            } => &c.quota_exhausted,
            EngineError::Exhausted { .. } => &c.retry_exhausted,
            _ => &c.backend_unavailable,
        });
    }

    async fn acquire_inner(&self, owner: OwnerId, call: u64) -> Result<Grant, EngineError> {
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
        let scope_name = || sc.name.clone();
        let mut reasons: Vec<Option<SkipReason>> = vec![None; sc.sources.len()];
        let mut waiting: Option<WaiterGuard<'_>> = None;
        let mut failed = Vec::new();
        let mut first = true;
        loop {
            // Register for early wake-ups before looking, so none is missed.
            let notified = sc.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Read per pass: a SIGHUP reload applies to calls already waiting.
            let policy = sc.policy();
            let cfg = &policy.cfg;

            let (attempts, stall, est) = {
                let t = self.lock();
                let c = t.calls.get(&call).ok_or(EngineError::UnknownCall(call))?;
                failed.clone_from(&c.failed);
                (c.attempts, c.stall(self.clock.now()), c.est_tokens)
            };
            // §5: the budgets are checked once, before the first pass; after a nap the
            // pass the nap was timed for always runs (the post-pass stall check below
            // ends the call if that pass grants nothing).
            let check_budgets = std::mem::take(&mut first);
            if check_budgets && attempts >= cfg.max_attempts {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::RetryExhausted,
                    retry_after: Duration::ZERO,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            if check_budgets && stall > cfg.stall_window {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::Stalled,
                    retry_after: Duration::ZERO,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            let refused = match self.pass(si, &policy, &failed, est, &mut reasons).await {
                Pass::Granted(g) => {
                    let ticket = Ticket {
                        engine: self,
                        scope: si,
                        grant: Some(g),
                    };
                    let (grant, stale) = self.record_grant(owner, call, ticket)?;
                    // No await before returning: a Cancel now cannot strand the grant.
                    for p in stale {
                        self.sources[p.source].pacer.release(Signal::Hold);
                        bump(&self.sources[p.source].counters.abandoned);
                        self.run_detached(self.abandon_backend(p));
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
                bump(&sc.counters.waits);
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
                expires: now + src.params().lease,
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
        bump(&src.counters.grants);
        if g.is_probe {
            bump(&src.counters.probes);
        }
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
        self.run_detached(self.settle_detached(
            scope,
            g.source,
            g.epoch,
            g.is_probe,
            g.tokens,
            Outcome::Cancelled,
        ));
        self.wake_one(g.source);
    }

    /// Run backend work that must not depend on the caller staying alive: in its own
    /// task for a remote backend; for the memory backend to completion right here (its
    /// futures finish in their first poll), so its effects are visible on return.
    fn run_detached(&self, work: impl Future<Output = ()> + Send + 'static) {
        if self.backend.is_remote() {
            tokio::spawn(work);
        } else {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let done = std::pin::pin!(work).poll(&mut cx).is_ready();
            debug_assert!(done, "memory backend futures complete in one poll");
        }
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

    /// Gates 3–4 for one source; a remote backend's round trip runs in its own task so
    /// a dropped Acquire cannot strand a half-made grant.
    pub(crate) async fn backend_admit(
        &self,
        scope: usize,
        source: usize,
        bp: &BreakerParams,
        qp: &QuotaParams,
        tokens: u64,
    ) -> BResult<Admit> {
        let src = &self.sources[source];
        let (bp, qp) = (*bp, *qp);
        if !self.backend.is_remote() {
            return self.backend.admit(&src.name, &bp, &qp, tokens).await;
        }
        let me = self.arc();
        let (tx, rx) = tokio::sync::oneshot::channel::<AdmitResult<B>>();
        tokio::spawn(async move {
            let src = &me.sources[source];
            let r = me.backend.admit(&src.name, &bp, &qp, tokens).await;
            // If the Acquire is gone (send fails, or the value is never received),
            // dropping the AdmitResult gives a grant back.
            let _ = tx.send(AdmitResult {
                engine: me.clone(),
                scope,
                source,
                tokens,
                result: Some(r),
            });
        });
        match rx.await {
            Ok(mut r) => r.result.take().expect("filled once"),
            Err(_) => Err(crate::backend::BackendError::Unavailable(
                "admission task failed".into(),
            )),
        }
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
            .unwrap_or_else(|_| {
                Err(crate::backend::BackendError::Unavailable(
                    "report task failed".into(),
                ))
            })
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

    /// Settle abandoned permits (never reported: connection closed, call ended,
    /// lease expired): the quota keeps the estimate as if the upstream used it, a
    /// probe lease is released, the pacer slot freed; no verdict reaches the breaker.
    /// Every pacer slot is freed at once, then the backend work runs concurrently (two round trips each on Redis, none serialised behind
    /// another permit's), in tasks that finish even if the caller is dropped.
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
    fn abandon_backend(&self, p: PermitRec) -> impl Future<Output = ()> + Send + 'static {
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

    /// Forget the call; an unreported permit is abandoned (settled as if the upstream
    /// used the estimate, probe lease released).
    pub async fn end_call(&self, owner: OwnerId, call: u64) -> Result<(), EngineError> {
        let permit = {
            let mut t = self.lock();
            if t.calls.get(&call).is_none_or(|c| c.owner != owner) {
                return Err(EngineError::UnknownCall(call));
            }
            let c = t.calls.remove(&call).expect("checked");
            if let Some(n) = t.owner_calls.get_mut(&owner) {
                *n = n.saturating_sub(1);
            }
            c.permit.and_then(|id| t.permits.remove(&id))
        };
        if let Some(p) = permit {
            self.abandon_all(vec![p]).await;
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
            t.owner_calls.remove(&owner);
            let ids: Vec<u64> = t
                .permits
                .iter()
                .filter(|(_, p)| p.owner == owner)
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| t.permits.remove(id)).collect()
        };
        self.abandon_all(permits).await;
    }

    /// Take permits out of the tables as reclaimed: their calls go on (the attempt
    /// counted, stall clock running again); the caller must `abandon_all` them.
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
        for p in &expired {
            tracing::warn!(source = %self.sources[p.source].name, "reclaimed a permit never reported within its lease");
        }
        self.abandon_all(expired).await;
        n
    }

    fn admin_result(&self, source: usize, r: BResult<Applied>) -> Result<Applied, EngineError> {
        let a = r.map_err(|e| EngineError::BackendUnavailable {
            scope: String::new(),
            message: e.to_string(),
            reasons: Vec::new(),
        })?;
        self.wake_all(source);
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
            let policy = sc.policy();
            let mut sources = Vec::with_capacity(sc.sources.len());
            for &idx in &sc.sources {
                let src = &self.sources[idx];
                let now = self.clock.now();
                let (pacer_ceiling, in_flight) = src.pacer.view();
                let snap = self
                    .backend
                    .snapshot(&src.name, &policy.bp, &src.params().qp)
                    .await;
                let mut degraded = self.backend.degraded(&src.name);
                let shared = snap.unwrap_or_else(|e| {
                    tracing::debug!(source = %src.name, error = %e, "status: backend snapshot failed");
                    degraded = true;
                    SourceSnapshot::default()
                });
                sources.push(SourceStatus {
                    name: src.name.to_string(),
                    shared,
                    memo_remaining: src.memo.remaining(now),
                    pacer_ceiling,
                    in_flight,
                    degraded,
                });
            }
            out.push(ScopeStatus {
                name: sc.name.clone(),
                circuit_open: policy.cfg.circuit_open.as_str(),
                quota_full: policy.cfg.quota_full.as_str(),
                waiters: sc.waiters.load(Ordering::Relaxed),
                calls: calls_per_scope[si],
                sources,
            });
        }
        out
    }

    /// Apply a new configuration (SIGHUP) without dropping a call: scope policies
    /// (modes, budgets, poll interval, selector, breaker parameters), source quotas,
    /// estimates and timeouts, and pacer bounds take effect at the next admission pass,
    /// also for calls already waiting. Scopes and sources must stay the same (adding,
    /// removing, renaming or reordering them needs a restart): such a config is refused
    /// whole and nothing changes. Returns what changed, one line each.
    pub fn reload(&self, config: &Config) -> Result<Vec<String>, EngineError> {
        let names = |c: &Config| -> Vec<(String, Vec<String>)> {
            c.scopes
                .iter()
                .map(|s| {
                    (
                        s.name.clone(),
                        s.sources.iter().map(|x| x.name.clone()).collect(),
                    )
                })
                .collect()
        };
        let now: Vec<(String, Vec<String>)> = self
            .scopes
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    s.sources
                        .iter()
                        .map(|&i| self.sources[i].name.to_string())
                        .collect(),
                )
            })
            .collect();
        if names(config) != now {
            return Err(EngineError::InvalidArgument(
                "scopes or sources were added, removed, renamed or reordered: that needs a restart; \
                 the running configuration is kept"
                    .into(),
            ));
        }
        let mut changes = Vec::new();
        // Per-source settings follow the first scope naming the source, as at start-up
        // (scopes may disagree on est_tokens/timeout/pacer; tpm/rpm must agree).
        let mut seen = vec![false; self.sources.len()];
        for (sc, new) in self.scopes.iter().zip(&config.scopes) {
            if sc.policy().cfg != *new {
                changes.push(format!("scope {}: policy updated", sc.name));
            }
            *sc.policy.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(Policy::new(new));
            for (&idx, s) in sc.sources.iter().zip(&new.sources) {
                if std::mem::replace(&mut seen[idx], true) {
                    continue;
                }
                let src = &self.sources[idx];
                let p = SourceParams::new(s);
                if src.params() != p {
                    changes.push(format!(
                        "source {}: quota/estimate/timeout updated",
                        src.name
                    ));
                    *src.params.write().unwrap_or_else(|e| e.into_inner()) = p;
                }
                src.pacer.reconfigure(new.pacer);
            }
            sc.notify.notify_waiters();
        }
        Ok(changes)
    }

    /// End every wait with [`EngineError::ShuttingDown`] and refuse new acquires.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
        for sc in &self.scopes {
            sc.notify.notify_waiters();
        }
    }

    /// `true` once [`Engine::shutdown`] ran.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_cancelled()
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
