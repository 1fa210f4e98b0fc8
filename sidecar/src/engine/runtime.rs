//! Host-local runtime state of scopes and sources: the policy SIGHUP may swap, the
//! host-local gates (pacer §8, memo §9, quota hint, health §4), the wake-up channel of
//! a scope's waiters, and the `/metrics` counters (§12). Built once from the
//! configuration ([`Topology::build`]) and updated in place by [`reload`]; nothing
//! here knows about calls, permits or the backend.

// foldhash: these maps are keyed by our own ids and config names (nothing a peer
// inserts), and SipHash was ~1.5 % of the per-frame CPU (§16).
use foldhash::{HashMap, HashMapExt};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::Notify;

use super::error::{EngineError, Exhaustion, ReloadError};
use super::queue::WaitQueue;
use super::tenants::{Book, TenantPolicy};
use super::transitions::Transitions;
use super::CallEst;
use crate::config::{Config, ScopeConfig, SourceConfig};
use crate::config::{LearnRate, ObserveLimits, TokensCharged};
use crate::gate::breaker::BreakerParams;
use crate::gate::classes::{ClassShares, Share, PPM};
use crate::gate::health::Health;
use crate::gate::memo::{Memo, QuotaHint};
use crate::gate::pacer::Pacer;
use crate::gate::quota::{QuotaParams, Tokens};
use crate::gate::tenant::Prices;
use crate::histogram::{Histogram, WAIT_BUCKETS};

/// A scope's policy: everything SIGHUP may change about it. Swapped whole, so one
/// admission pass always sees one consistent policy.
pub(crate) struct Policy {
    /// Policy from the configuration.
    pub(crate) cfg: ScopeConfig,
    /// Breaker parameters derived from `cfg` (probe TTL included).
    pub(crate) bp: BreakerParams,
    /// §15: the classes' shares as the quota gate reads them (`None`: no classes).
    pub(crate) shares: Option<Arc<ClassShares>>,
    /// §19: the scope's tenants' limits (`None`: the scope has no tenants).
    pub(crate) tenants: Option<TenantPolicy>,
}

impl Policy {
    fn new(sc: &ScopeConfig, max_debt: Duration) -> Self {
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
            shares: shares(sc),
            tenants: sc.tenants.as_ref().map(|t| TenantPolicy::new(t, max_debt)),
            cfg: sc.clone(),
        }
    }
}

/// A fraction as parts per million (validated into [0, 1]).
fn ppm(f: f64) -> u64 {
    (f.clamp(0.0, 1.0) * PPM as f64).round() as u64
}

/// §15: a scope's classes for the quota gate.
fn shares(sc: &ScopeConfig) -> Option<Arc<ClassShares>> {
    if sc.priorities.is_empty() {
        return None;
    }
    Some(Arc::new(ClassShares {
        saturation_ppm: ppm(sc.saturation),
        classes: sc
            .priorities
            .iter()
            .map(|p| Share {
                name: Arc::from(p.name.as_str()),
                reserve_ppm: ppm(p.reserve),
                limit_ppm: ppm(p.limit),
            })
            .collect(),
    }))
}

/// Per-source parameters SIGHUP may change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SourceParams {
    /// Quota parameters.
    pub(crate) qp: QuotaParams,
    /// §7 default estimate.
    pub(crate) est_tokens: u64,
    /// §7a default input estimate.
    pub(crate) est_input_tokens: u64,
    /// §7a default output estimate.
    pub(crate) est_output_tokens: u64,
    /// A permit never reported is reclaimed after this (2 × timeout).
    pub(crate) lease: Duration,
    /// §19: what a tenant pays per token here.
    pub(crate) prices: Prices,
}

impl SourceParams {
    /// `max_debt`: `sidecar.max_rate_limit_block` (§12, one report's debt).
    fn new(s: &SourceConfig, max_debt: Duration) -> Self {
        SourceParams {
            qp: QuotaParams {
                tpm: s.tpm,
                rpm: s.rpm,
                itpm: s.itpm,
                otpm: s.otpm,
                tpd: s.tpd,
                rpd: s.rpd,
                burst: s.burst,
                charge_estimate: s.tokens_charged == TokensCharged::Estimate,
                max_debt,
                observe: s.observe_limits == ObserveLimits::On || s.auto != 0,
                auto: s.auto,
                auto_share_ppm: crate::gate::quota::PPM_WHOLE,
                learn: match s.learn_rate {
                    LearnRate::Aimd => crate::gate::quota::learn::RECOVER_PPM_PER_S,
                    LearnRate::Off => 0,
                },
            },
            est_tokens: s.default_est_tokens(),
            est_input_tokens: s.default_est_input_tokens(),
            est_output_tokens: s.default_est_output_tokens(),
            lease: s.permit_lease(),
            prices: Prices::per_million(
                s.usd_per_1m_input,
                s.usd_per_1m_output,
                s.usd_per_1m_cached_input,
            ),
        }
    }
}

impl SourceParams {
    /// §7/§7a: a call's reservation at this source. What the call names is taken
    /// as given; a missing part is what the call's total leaves beside the other
    /// part, else the source's default for it (the output default never above the
    /// call's total); a missing total is the sum of the parts when the call names
    /// one, else the source's default.
    pub(crate) fn estimate(&self, c: CallEst) -> Tokens {
        let output = match (c.output, c.input, c.total) {
            (Some(o), _, _) => o,
            (None, Some(i), Some(t)) => t.saturating_sub(i),
            (None, _, t) => self.est_output_tokens.min(t.unwrap_or(u64::MAX)),
        };
        let input = match (c.input, c.total) {
            (Some(i), _) => i,
            (None, Some(t)) => t.saturating_sub(output),
            (None, None) => self.est_input_tokens,
        };
        let total = match c.total {
            Some(t) => t,
            None if c.input.is_some() || c.output.is_some() => input + output,
            None => self.est_tokens,
        };
        Tokens {
            total,
            input,
            output,
        }
    }
}

/// Monotonic counters of one scope, for `/metrics`.
#[derive(Debug)]
pub struct ScopeCounters {
    /// Time each Acquire of the scope took, from entering the engine to its answer,
    /// waiting included (§12), however it ended.
    pub wait: Histogram,
    /// Acquires that started waiting (one per Acquire, not per wake-up).
    pub waits: AtomicU64,
    /// Acquires that ended in a gateway error, by kind.
    pub errors: ErrorCounts,
}

impl Default for ScopeCounters {
    fn default() -> Self {
        ScopeCounters {
            wait: Histogram::new(WAIT_BUCKETS),
            waits: AtomicU64::default(),
            errors: ErrorCounts::default(),
        }
    }
}

/// Acquires that ended in a gateway error, by kind: one set per scope
/// (`polygate_acquire_errors`) and one per priority class (§15 refusals), so both
/// are counted by the same match.
#[derive(Debug, Default)]
pub struct ErrorCounts {
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
    /// §19: Acquires that ended refused by the call's tenant's limits.
    pub tenant_limited: AtomicU64,
}

impl ErrorCounts {
    /// The counter of `e`, one of the call-ending errors (`CircuitOpen`,
    /// `Exhausted`, `BackendUnavailable`); any other error falls to
    /// `backend_unavailable`, so callers pass only those three.
    pub fn of(&self, e: &EngineError) -> &AtomicU64 {
        match e {
            EngineError::CircuitOpen { .. } => &self.circuit_open,
            EngineError::Exhausted {
                reason: Exhaustion::Stalled,
                ..
            } => &self.stalled,
            EngineError::Exhausted {
                reason: Exhaustion::QuotaExhausted,
                ..
            } => &self.quota_exhausted,
            EngineError::Exhausted { .. } => &self.retry_exhausted,
            EngineError::TenantLimited { .. } => &self.tenant_limited,
            _ => &self.backend_unavailable,
        }
    }

    /// Every counter with its kind label, in exposition order (`/metrics`, status).
    pub fn by_kind(&self) -> [(&'static str, &AtomicU64); 6] {
        [
            ("circuit_open", &self.circuit_open),
            ("stalled", &self.stalled),
            ("quota_exhausted", &self.quota_exhausted),
            ("retry_exhausted", &self.retry_exhausted),
            ("backend_unavailable", &self.backend_unavailable),
            ("tenant_limited", &self.tenant_limited),
        ]
    }
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

/// Monotonic counters of one priority class of a scope (§15), for status and
/// `/metrics`.
#[derive(Debug, Default)]
pub struct ClassCounters {
    /// Permits granted to calls of the class.
    pub grants: AtomicU64,
    /// Acquires of the class that started waiting.
    pub waits: AtomicU64,
    /// Acquires of the class that ended in a gateway error, by kind.
    pub errors: ErrorCounts,
    /// Sources skipped because the class reached its `limit`.
    pub held_limit: AtomicU64,
    /// Sources skipped because the rest is another class's unused reserve.
    pub held_reserve: AtomicU64,
}

/// Count one event.
pub(crate) fn bump(c: &AtomicU64) {
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
    pub(crate) notify: Notify,
    /// Acquires of this scope currently sleeping.
    pub(crate) waiters: AtomicU32,
    /// Counters for `/metrics`.
    pub(crate) counters: ScopeCounters,
    /// §15: the waiters in fair order across classes — and §19, among tenants within
    /// a class; `None` for a scope with neither classes nor tenants, whose waiters
    /// share `notify` (first come, first served) and the §5 quota line.
    pub(crate) queue: Option<WaitQueue>,
    /// §19: the tenants this host has seen (`None`: the scope has none).
    pub(crate) book: Option<Book>,
    /// §15: class names, config order (fixed: changing them needs a restart).
    pub(crate) class_names: Vec<Arc<str>>,
    /// §15: counters per class, config order.
    pub(crate) class_counters: Vec<ClassCounters>,
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
    pub(crate) scopes: Vec<usize>,
    /// Counters for `/metrics`.
    pub(crate) counters: SourceCounters,
    /// When a rejected backend operation was last logged (nanos on the engine clock
    /// + 1; 0 = never), to log at most every 10 s per source.
    pub(crate) error_logged: AtomicU64,
    /// Breaker transitions this host observed: the §12 log lines and the
    /// `polygate_breaker_transitions` counters.
    pub(crate) transitions: Transitions,
}

impl ScopeRt {
    /// The current policy (cheap: one `Arc` clone under a read lock).
    pub(crate) fn policy(&self) -> Arc<Policy> {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Read one thing of the policy without cloning its `Arc` (the hot path reads a
    /// field or two per call: no refcount traffic for that).
    pub(crate) fn with_policy<R>(&self, f: impl FnOnce(&Policy) -> R) -> R {
        f(&self.policy.read().unwrap_or_else(|e| e.into_inner()))
    }
}

impl SourceRt {
    /// The current parameters.
    pub(crate) fn params(&self) -> SourceParams {
        *self.params.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// Every scope and every distinct source of a configuration, with name indices.
pub(crate) struct Topology {
    /// Scopes, config order.
    pub(crate) scopes: Vec<ScopeRt>,
    /// Scope name → index.
    pub(crate) scope_index: HashMap<String, usize>,
    /// Every distinct source, in order of first mention.
    pub(crate) sources: Vec<SourceRt>,
    /// Source name → index.
    pub(crate) source_index: HashMap<String, usize>,
}

impl Topology {
    /// The runtime state of a validated configuration. A source named by several
    /// scopes is one [`SourceRt`] (one pacer, one memo), configured by the first.
    pub(crate) fn build(config: &Config) -> Self {
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
                        params: RwLock::new(SourceParams::new(
                            s,
                            config.sidecar.max_rate_limit_block,
                        )),
                        pacer: Pacer::new(sc.pacer),
                        memo: Memo::default(),
                        quota_hint: QuotaHint::default(),
                        health: Health::default(),
                        scopes: Vec::new(),
                        counters: SourceCounters::default(),
                        error_logged: AtomicU64::new(0),
                        transitions: Transitions::default(),
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
                policy: RwLock::new(Arc::new(Policy::new(
                    sc,
                    config.sidecar.max_rate_limit_block,
                ))),
                sources: idxs,
                notify: Notify::new(),
                waiters: AtomicU32::new(0),
                counters: ScopeCounters::default(),
                queue: (!sc.priorities.is_empty() || sc.tenants.is_some())
                    .then(|| WaitQueue::new(&weights(sc), sc.tenants.as_ref().is_some_and(fair))),
                book: sc.tenants.as_ref().map(|_| Book::default()),
                class_names: sc
                    .priorities
                    .iter()
                    .map(|p| Arc::from(p.name.as_str()))
                    .collect(),
                class_counters: sc
                    .priorities
                    .iter()
                    .map(|_| ClassCounters::default())
                    .collect(),
            });
            scope_index.insert(sc.name.clone(), si);
        }
        Topology {
            scopes,
            scope_index,
            sources,
            source_index,
        }
    }
}

/// The class weights of a scope, config order; one class of weight 1 for a scope
/// with tenants and no classes (its queue orders tenants only).
fn weights(sc: &ScopeConfig) -> Vec<f64> {
    if sc.priorities.is_empty() {
        return vec![1.0];
    }
    sc.priorities.iter().map(|p| p.weight).collect()
}

/// §19: fair turns among a scope's tenants.
fn fair(t: &crate::config::TenantsConfig) -> bool {
    t.fairness == crate::config::Fairness::Vtc
}

/// Apply a new configuration to running scopes and sources (SIGHUP); see
/// [`super::Engine::reload`] for what may change. Refused whole, changing nothing,
/// when scopes or sources were added, removed, renamed or reordered.
pub(crate) fn reload(
    scopes: &[ScopeRt],
    sources: &[SourceRt],
    config: &Config,
) -> Result<Vec<String>, ReloadError> {
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
    let now: Vec<(String, Vec<String>)> = scopes
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                s.sources
                    .iter()
                    .map(|&i| sources[i].name.to_string())
                    .collect(),
            )
        })
        .collect();
    if names(config) != now {
        return Err(ReloadError::TopologyChanged);
    }
    for (sc, new) in scopes.iter().zip(&config.scopes) {
        let classes: Vec<&str> = new.priorities.iter().map(|p| p.name.as_str()).collect();
        let running: Vec<&str> = sc.class_names.iter().map(|c| &**c).collect();
        if classes != running {
            return Err(ReloadError::ClassesChanged {
                scope: sc.name.clone(),
            });
        }
        // §19: limits, budgets and weights reload; whether the scope has tenants, and
        // how its queue orders them, is its waiters' structure.
        let was = sc.with_policy(|p| p.tenants.as_ref().map(|t| t.fair));
        if was != new.tenants.as_ref().map(fair) {
            return Err(ReloadError::TenantsChanged {
                scope: sc.name.clone(),
            });
        }
    }
    let mut changes = Vec::new();
    // Per-source settings follow the first scope naming the source, as at start-up
    // (scopes may disagree on est_tokens/timeout/pacer; tpm/rpm must agree).
    let mut seen = vec![false; sources.len()];
    for (sc, new) in scopes.iter().zip(&config.scopes) {
        if sc.policy().cfg != *new {
            changes.push(format!("scope {}: policy updated", sc.name));
        }
        *sc.policy.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Policy::new(new, config.sidecar.max_rate_limit_block));
        for (&idx, s) in sc.sources.iter().zip(&new.sources) {
            if std::mem::replace(&mut seen[idx], true) {
                continue;
            }
            let src = &sources[idx];
            let p = SourceParams::new(s, config.sidecar.max_rate_limit_block);
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
        if let Some(q) = &sc.queue {
            q.reweigh(&weights(new));
            q.wake_all();
        }
    }
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SourceParams {
        SourceParams {
            qp: QuotaParams::default(),
            est_tokens: 1_000,
            est_input_tokens: 800,
            est_output_tokens: 200,
            lease: Duration::from_secs(1),
            prices: Prices::default(),
        }
    }

    fn t(total: u64, input: u64, output: u64) -> Tokens {
        Tokens {
            total,
            input,
            output,
        }
    }

    #[test]
    fn a_call_estimate_fills_what_it_leaves_out_from_the_source() {
        let p = params();
        let c = |total, input, output| CallEst {
            total,
            input,
            output,
        };
        assert_eq!(p.estimate(c(None, None, None)), t(1_000, 800, 200));
        assert_eq!(p.estimate(c(Some(500), None, None)), t(500, 300, 200));
        assert_eq!(
            p.estimate(c(Some(50), None, None)),
            t(50, 0, 50),
            "output ≤ total"
        );
        assert_eq!(p.estimate(c(Some(500), Some(100), None)), t(500, 100, 400));
        assert_eq!(p.estimate(c(Some(500), None, Some(450))), t(500, 50, 450));
        assert_eq!(p.estimate(c(None, Some(300), Some(64))), t(364, 300, 64));
        assert_eq!(p.estimate(c(None, Some(300), None)), t(500, 300, 200));
        assert_eq!(p.estimate(c(None, None, Some(64))), t(864, 800, 64));
        assert_eq!(
            p.estimate(c(Some(9), Some(5), Some(7))),
            t(9, 5, 7),
            "as given"
        );
    }
}
