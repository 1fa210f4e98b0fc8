//! The governance engine's public face: calls, permits, admission, reporting,
//! reclaim, admin and status. No socket code and no wire types live here; the server
//! maps [`ipc_protocol`] messages onto these calls.
//!
//! Ownership: every call and permit belongs to an `owner` (the server uses one owner id
//! per connection). Ids are only valid for their owner, and
//! [`Engine::release_owner`] releases everything an owner still holds (§12).
//!
//! One Acquire reads top-down through the files: `acquire/` (budgets, the §5
//! dispatch; `acquire/wait.rs` the wait) → `pass.rs` (one §4 pass: memo, pacer, then quota + breaker in
//! one backend operation) → [`crate::gate`] / [`crate::backend`]. A Report goes
//! through `report.rs` (tables, pacer, health, then the backend's settle + verdict).
//! `detach.rs` runs every backend operation inline on a local backend and in its own
//! task on a remote one; `tables.rs` is the synchronous call/permit bookkeeping,
//! `runtime.rs` the host-local scope/source state and reload, `status.rs` and
//! `admin.rs` the operator's side, `error.rs` what can go wrong. The leaf modules
//! (`error`, `runtime`, `tables`) never name the [`Engine`].

mod acquire;
mod admin;
mod detach;
mod error;
mod pass;
mod queue;
mod report;
mod runtime;
mod status;
mod tables;
mod transitions;

pub use error::{EngineError, Exhaustion, ReloadError, SkipReason};
pub use runtime::{ClassCounters, ErrorCounts, ScopeCounters, SourceCounters};
pub use tables::{LiveCounts, OwnerId, MAX_CALLS_PER_OWNER};

use crate::gate::quota::{Bucket, QuotaParams, BUCKETS};
// foldhash: these maps are keyed by our own ids and config names (nothing a peer
// inserts), and SipHash was ~1.5 % of the per-frame CPU (§16).
use foldhash::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, BackendError, SourceSnapshot};
use crate::clock::Clock;
use crate::config::Config;
use crate::gate::breaker::{Applied, State};
use runtime::{ScopeRt, SourceRt, Topology};
use tables::Tables;

/// A call's own token estimates (§7, §7a), each optional: the source's defaults
/// fill what is missing ([`runtime::SourceParams::estimate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallEst {
    /// `est_tokens`: the total.
    pub total: Option<u64>,
    /// `est_input_tokens`.
    pub input: Option<u64>,
    /// `est_output_tokens` (normally the request's `max_tokens`).
    pub output: Option<u64>,
}

impl From<Option<u64>> for CallEst {
    fn from(total: Option<u64>) -> Self {
        CallEst {
            total,
            ..CallEst::default()
        }
    }
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
    /// §6: how long until the source's quota holds its default estimate and any 429
    /// block is over (0 = now; always 0 from `status_local`, which reads no backend).
    pub quota_retry_after: Duration,
    /// Pacer ceiling on this host.
    pub pacer_ceiling: f64,
    /// Permits in flight on this host.
    pub in_flight: u32,
    /// Served from local state because the shared backend is down.
    pub degraded: bool,
    /// The source's quota parameters, so every bucket's capacity and refill can be
    /// shown beside the level `shared` holds ([`SourceStatus::buckets`]).
    pub quota: QuotaParams,
}

/// One configured bucket of a source, for status and metrics (§7a).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketView {
    /// Which bucket (its config key).
    pub bucket: Bucket,
    /// The level (negative: debt); `None` when the backend could not be read.
    pub level: Option<f64>,
    /// What a full bucket holds.
    pub capacity: u64,
    /// Refill per second.
    pub refill_per_s: f64,
    /// How far below zero the level is (0 without debt).
    pub debt: Option<f64>,
    /// §18: the capacity is the provider's (`"auto"`), learned from its headers.
    pub auto: bool,
    /// §18: the provider's last word on this bucket (and what corrections removed).
    pub observed: Option<crate::gate::observed::LastSeen>,
}

impl SourceStatus {
    /// Every configured bucket, in [`crate::gate::quota::BUCKETS`] order.
    pub fn buckets(&self) -> Vec<BucketView> {
        BUCKETS
            .iter()
            .enumerate()
            .filter_map(|(i, (b, _, _))| {
                let observed = self.shared.seen.get(i).copied().flatten();
                let auto = self.quota.is_auto(i);
                let mut q = self.quota;
                if auto {
                    // §18: an "auto" bucket shows the limit last learned (none yet:
                    // not listed).
                    q.set_limit(*b, observed.and_then(|o| o.limit));
                }
                let s = q.shape(*b)?;
                let level = self.shared.levels[i];
                Some(BucketView {
                    bucket: *b,
                    level,
                    capacity: s.capacity,
                    refill_per_s: s.refill_per_s(),
                    debt: level.map(|l| (-l).max(0.0)),
                    auto,
                    observed,
                })
            })
            .collect()
    }
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
    /// §15: the scope's priority classes, config order (empty: none).
    pub classes: Vec<ClassStatus>,
}

/// Live state of one priority class of a scope on this host (§15), for status.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassStatus {
    /// Class name.
    pub name: String,
    /// Its weight among waiting classes.
    pub weight: f64,
    /// Its reserve (share of each source, when saturated).
    pub reserve: f64,
    /// Its limit (share of each source, always).
    pub limit: f64,
    /// Calls of the class waiting in Acquire now.
    pub waiters: u32,
    /// Permits granted to the class.
    pub grants: u64,
    /// The class's share of the scope's grants on this host (0 before any).
    pub grant_share: f64,
    /// Pacer slots the class holds on this host, over the scope's sources.
    pub in_flight: u32,
    /// Acquires of the class that started waiting.
    pub waits: u64,
    /// Refusals by reason: call-ending errors (`circuit_open`, `stalled`,
    /// `quota_exhausted`, `retry_exhausted`, `backend_unavailable`) and sources held
    /// back for the class (`held_limit`, `held_reserve`).
    pub refusals: Vec<(&'static str, u64)>,
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
    /// §7: the longest quota block a 429's `retry_after` may set
    /// (`sidecar.max_rate_limit_block`; longer ones are cut to it).
    max_rate_limit_block: Duration,
    /// Cancelled on shutdown: ends every wait.
    shutdown: CancellationToken,
    /// §5 quota lines, one per scope (config order): who of a scope's quota
    /// waiters polls, so their cost is per scope and size, not per waiter.
    quota_lines: Vec<queue::QuotaLine>,
    /// Admission passes run (§4), for tests and debugging: a waiter's cost is its
    /// passes, which the backend's counters do not see (the quota hint answers most).
    passes: std::sync::atomic::AtomicU64,
    /// §12: requests sleeping in a wait now, over every scope (counted only when a
    /// wait starts, never on the no-wait path).
    waiting: std::sync::atomic::AtomicUsize,
    /// §12 `sidecar.max_waiters`: past it a request that would wait is refused
    /// `Overloaded` (reloadable).
    max_waiters: std::sync::atomic::AtomicUsize,
}

impl<B: Backend> Engine<B> {
    /// Build an engine over a validated configuration and a backend.
    pub fn new(config: &Config, backend: B, clock: Arc<dyn Clock>) -> Arc<Self> {
        let Topology {
            scopes,
            scope_index,
            sources,
            source_index,
        } = Topology::build(config);
        let quota_lines = scopes.iter().map(|_| queue::QuotaLine::default()).collect();
        Arc::new_cyclic(|me| Engine {
            me: me.clone(),
            backend,
            clock,
            scopes,
            scope_index,
            sources,
            source_index,
            tables: Mutex::new(Tables::default()),
            max_rate_limit_block: config.sidecar.max_rate_limit_block,
            shutdown: CancellationToken::new(),
            quota_lines,
            passes: std::sync::atomic::AtomicU64::new(0),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            max_waiters: std::sync::atomic::AtomicUsize::new(max_waiters(config)),
        })
    }

    /// Apply a new configuration (SIGHUP) without dropping a call: scope policies
    /// (modes, budgets, poll interval, selector, breaker parameters), source quotas,
    /// estimates and timeouts, and pacer bounds take effect at the next admission pass,
    /// also for calls already waiting. Scopes and sources must stay the same (adding,
    /// removing, renaming or reordering them needs a restart): such a config is refused
    /// whole and nothing changes. Returns what changed, one line each.
    pub fn reload(&self, config: &Config) -> Result<Vec<String>, ReloadError> {
        let mut changes = runtime::reload(&self.scopes, &self.sources, config)?;
        let waiters = max_waiters(config);
        let was = self.max_waiters.swap(waiters, Ordering::Relaxed);
        if was != waiters {
            changes.push(format!("sidecar.max_waiters: {was} -> {waiters}"));
        }
        // Quota waiters re-read the policy too (a new quota, poll interval or
        // stall window): each runs one pass now.
        for line in &self.quota_lines {
            line.wake_all();
        }
        Ok(changes)
    }

    /// Admission passes run since start (every Acquire's, granted or not). Tests
    /// use it to check that waiting costs passes per scope, not per waiter.
    pub fn passes_run(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }

    /// End every wait with [`EngineError::ShuttingDown`] and refuse new acquires.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
        for sc in &self.scopes {
            sc.notify.notify_waiters();
        }
        for line in &self.quota_lines {
            line.wake_all();
        }
    }

    /// Requests waiting now over every scope (§12 `max_waiters` counts these).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// `true` once [`Engine::shutdown`] ran.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// The backend (for tests and status).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend's name (`memory` / `redis`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// §10: the share of every shared quota this host uses while degraded (`None`:
    /// not a shared backend).
    pub fn degraded_share(&self) -> Option<crate::backend::ShareView> {
        self.backend.degraded_share()
    }

    fn lock(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn arc(&self) -> Arc<Self> {
        self.me.upgrade().expect("engine used after drop")
    }

    fn source_idx(&self, source: &str) -> Result<usize, EngineError> {
        self.source_index
            .get(source)
            .copied()
            .ok_or_else(|| EngineError::UnknownSource(crate::limits::echo(source).into_owned()))
    }

    /// Log a backend error that is not an outage (the store rejected the operation),
    /// at most once every 10 s per source so a persistent one cannot flood the log.
    fn log_backend_error(&self, source: usize, e: &BackendError) {
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
    /// wake one waiter per scope naming it, and the pollers of its quota line (§5).
    /// Only one can use it, and waking them all would cost a pass per waiter for
    /// every freed slot; if the woken one cannot use it, the pollers' next nap (at
    /// most `poll_interval` away) picks it up.
    fn wake_one(&self, source: usize) {
        // Whatever was freed may be quota: let the next admission ask the backend.
        self.sources[source].quota_hint.clear();
        for &s in &self.sources[source].scopes {
            match &self.scopes[s].queue {
                Some(q) => q.wake_next(),
                None => {
                    self.scopes[s].notify.notify_one();
                    self.quota_lines[s].wake_pollers();
                }
            }
        }
    }

    /// The source's state changed so that many may proceed (closed, reset, memo
    /// cleared): wake every waiter of every scope naming it.
    fn wake_all(&self, source: usize) {
        self.sources[source].quota_hint.clear();
        for &s in &self.sources[source].scopes {
            self.scopes[s].notify.notify_waiters();
            self.quota_lines[s].wake_all();
            if let Some(q) = &self.scopes[s].queue {
                q.wake_all();
            }
        }
    }

    /// §15: the name of class `class` of scope `scope` (`None`: no classes).
    fn class_name(&self, scope: usize, class: usize) -> Option<Arc<str>> {
        self.scopes[scope].class_names.get(class).cloned()
    }

    /// Record a breaker state the backend answered for `source` through `scope`
    /// (§12: a change is logged once and counted).
    fn observe(&self, scope: usize, source: usize, o: transitions::Observation) {
        let names = transitions::Names {
            scope_idx: scope,
            scope: &self.scopes[scope].name,
            source: &self.sources[source].name,
        };
        self.sources[source]
            .transitions
            .observe(|| self.clock.now(), names, o);
    }

    /// The first scope naming `source` (admin actions name only the source).
    fn first_scope(&self, source: usize) -> usize {
        self.sources[source].scopes.first().copied().unwrap_or(0)
    }

    /// Every breaker transition counter: (scope, source, from, to, reason, count).
    pub fn breaker_transitions(
        &self,
    ) -> Vec<(&str, &str, &'static str, &'static str, &'static str, u64)> {
        let mut out = Vec::new();
        for src in &self.sources {
            for (scope, from, to, reason, n) in src.transitions.counts() {
                out.push((
                    self.scopes[scope].name.as_str(),
                    &*src.name,
                    from,
                    to,
                    reason,
                    n,
                ));
            }
        }
        out
    }

    /// Keep the memo in step with a state the backend just told us.
    fn note_state(&self, source: usize, a: &Applied) {
        let memo = &self.sources[source].memo;
        match a.state {
            State::Open if !a.retry_after.is_zero() => {
                let now = self.clock.now();
                memo.set_until(now + a.retry_after, a.epoch, now)
            }
            State::Closed => memo.clear(),
            _ => {}
        }
    }
}

/// §12: the configured `sidecar.max_waiters`, or the default derived from memory.
fn max_waiters(config: &Config) -> usize {
    config
        .sidecar
        .max_waiters
        .unwrap_or_else(crate::limits::default_max_waiters) as usize
}
