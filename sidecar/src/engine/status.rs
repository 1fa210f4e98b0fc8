//! What the engine shows (§12): the live state of every scope and source for
//! `Status`, `status --json` and `/metrics`, and the invariant counts the tests check.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::error::EngineError;
use super::tables::{LiveCounts, OwnerId};
use super::{
    ClassStatus, Engine, ScopeStatus, SourceStatus, TenantScopeStatus, TenantStatus, TenantsStatus,
};
use crate::backend::{Backend, SourceSnapshot, TenantKey};
use crate::gate::quota::QuotaView;

impl<B: Backend> Engine<B> {
    /// Live state of every scope and source: [`Engine::status_local`] plus the
    /// backend's view of each source (one snapshot per source of each scope).
    pub async fn status(&self) -> Vec<ScopeStatus> {
        let mut out = self.status_local();
        for (sc, st) in self.scopes.iter().zip(&mut out) {
            let bp = sc.policy().bp;
            for (&idx, s) in sc.sources.iter().zip(&mut st.sources) {
                let src = &self.sources[idx];
                let params = src.params();
                match self.backend.snapshot(&src.name, &bp, &params.qp).await {
                    Ok(snap) => {
                        let quota = QuotaView {
                            levels: snap.levels,
                            blocked: snap.quota_blocked,
                        };
                        let est = params.estimate(super::CallEst::default());
                        s.quota_retry_after = quota.wait(&params.qp, est);
                        s.shared = snap;
                    }
                    Err(e) => {
                        tracing::debug!(source = %src.name, error = %e, "status: backend snapshot failed");
                        s.degraded = true;
                    }
                }
            }
        }
        out
    }

    /// The host-local part of [`Engine::status`], without touching the backend:
    /// every `shared` is [`SourceSnapshot::default`] (what `/metrics` overlays with
    /// its periodically refreshed view).
    pub fn status_local(&self) -> Vec<ScopeStatus> {
        let calls_per_scope = self.lock().calls_per_scope(self.scopes.len());
        let mut out = Vec::with_capacity(self.scopes.len());
        for (si, sc) in self.scopes.iter().enumerate() {
            let policy = sc.policy();
            let mut sources = Vec::with_capacity(sc.sources.len());
            for &idx in &sc.sources {
                let src = &self.sources[idx];
                let now = self.clock.now();
                let (pacer_ceiling, in_flight) = src.pacer.view();
                sources.push(SourceStatus {
                    name: src.name.to_string(),
                    shared: SourceSnapshot::default(),
                    memo_remaining: src.memo.remaining(now),
                    quota_retry_after: Duration::ZERO, // filled from the snapshot
                    pacer_ceiling,
                    quota: src.params().qp,
                    in_flight,
                    degraded: self.backend.degraded(&src.name),
                });
            }
            out.push(ScopeStatus {
                name: sc.name.clone(),
                circuit_open: policy.cfg.circuit_open.as_str(),
                quota_full: policy.cfg.quota_full.as_str(),
                waiters: sc.waiters.load(Ordering::Relaxed),
                calls: calls_per_scope[si],
                sources,
                classes: self.class_status(si),
                tenants: self.tenants_status(si, &policy),
            });
        }
        out
    }

    /// §19: the scope's tenants on this host: how many the book tracks, the totals, the
    /// top by dollars settled here (`sidecar.tenant_metrics_top` of them, at least 10
    /// for status).
    fn tenants_status(&self, si: usize, policy: &super::runtime::Policy) -> Option<TenantsStatus> {
        let sc = &self.scopes[si];
        let (book, t) = (sc.book.as_ref()?, policy.tenants.as_ref()?);
        let (tracked, totals) = book.totals();
        Some(TenantsStatus {
            fairness: if t.fair { "vtc" } else { "fifo" },
            tracked,
            max_tenants: t.max_tenants,
            totals,
            top: book
                .top(self.tenant_top.max(10) as usize)
                .into_iter()
                .map(|(id, s)| (id.to_string(), s))
                .collect(),
        })
    }

    /// §19: one tenant (`""`: the anonymous one) in `scope`, or in every scope with
    /// tenants: its limits, its shared ledger (buckets, spend in its budgets' windows,
    /// in flight, read from the backend), and this host's figures (calls, permits,
    /// waiters, fair-turn counter, tokens and dollars settled here).
    pub async fn tenant_status(
        &self,
        tenant: &str,
        scope: Option<&str>,
    ) -> Result<TenantStatus, EngineError> {
        let scopes: Vec<usize> = match scope {
            Some(name) => {
                let si = *self
                    .scope_index
                    .get(name)
                    .ok_or_else(|| EngineError::UnknownScope {
                        scope: crate::limits::echo(name).into_owned(),
                        known: self.scopes.iter().map(|s| s.name.clone()).collect(),
                    })?;
                if self.scopes[si].book.is_none() {
                    return Err(EngineError::InvalidArgument(format!(
                        "scope {name:?} has no tenants (no [scopes.{name}.tenants] table)"
                    )));
                }
                vec![si]
            }
            None => (0..self.scopes.len())
                .filter(|&i| self.scopes[i].book.is_some())
                .collect(),
        };
        let id = (!tenant.is_empty()).then_some(tenant);
        let mut out = Vec::with_capacity(scopes.len());
        for si in scopes {
            let sc = &self.scopes[si];
            let Some(r) = sc.with_policy(|p| p.tenants.as_ref().map(|t| *t.of(id))) else {
                continue;
            };
            let (ledger, ledger_error) = if r.params.unlimited() {
                (None, None)
            } else {
                let key = TenantKey {
                    scope: &sc.name,
                    tenant,
                };
                match self.backend.tenant_snapshot(key, &r.params).await {
                    Ok(l) => (l, None),
                    Err(e) => (None, Some(e.to_string())),
                }
            };
            let lane: super::lanes::LaneId = id.map(std::sync::Arc::from);
            let (waiting, counter) = sc.queue.as_ref().map_or((0, 0.0), |q| q.tenant(&lane));
            out.push(TenantScopeStatus {
                scope: sc.name.clone(),
                params: r.params,
                weight: r.weight,
                ledger,
                ledger_error,
                host: sc.book.as_ref().and_then(|b| b.get(tenant)),
                waiting,
                counter,
            });
        }
        Ok(TenantStatus {
            tenant: tenant.to_string(),
            scopes: out,
        })
    }

    /// `true` when `owner` holds no unreported permit (a draining connection may
    /// close once this holds and it has no request in progress).
    pub fn owner_is_idle(&self, owner: OwnerId) -> bool {
        !self.lock().holds_permit(owner)
    }

    /// §15: the scope's classes on this host.
    fn class_status(&self, si: usize) -> Vec<ClassStatus> {
        let sc = &self.scopes[si];
        let Some(queue) = &sc.queue else {
            return Vec::new();
        };
        let policy = sc.policy();
        let view = queue.view();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let total: u64 = sc.class_counters.iter().map(|c| load(&c.grants)).sum();
        policy
            .cfg
            .priorities
            .iter()
            .zip(&sc.class_counters)
            .zip(view)
            .zip(&sc.class_names)
            .map(|(((p, c), v), name)| {
                let grants = load(&c.grants);
                ClassStatus {
                    name: p.name.clone(),
                    weight: p.weight,
                    reserve: p.reserve,
                    limit: p.limit,
                    waiters: v.waiting,
                    grants,
                    grant_share: if total == 0 {
                        0.0
                    } else {
                        grants as f64 / total as f64
                    },
                    in_flight: sc
                        .sources
                        .iter()
                        .map(|&i| self.sources[i].pacer.class_in_flight(name))
                        .sum(),
                    waits: load(&c.waits),
                    refusals: c
                        .errors
                        .by_kind()
                        .into_iter()
                        .chain([
                            ("held_limit", &c.held_limit),
                            ("held_reserve", &c.held_reserve),
                        ])
                        .map(|(reason, v)| (reason, load(v)))
                        .collect(),
                }
            })
            .collect()
    }

    /// `true` when `owner` holds no call and no permit: its connection may be closed
    /// by `sidecar.idle_timeout` (§12 "Bounded under abuse").
    pub fn owner_holds_nothing(&self, owner: OwnerId) -> bool {
        let t = self.lock();
        !t.holds_call(owner) && !t.holds_permit(owner)
    }

    /// Counts for invariant checks (tests, debugging).
    #[doc(hidden)]
    pub fn live_counts(&self) -> LiveCounts {
        let t = self.lock();
        LiveCounts {
            pacer_in_flight: self.sources.iter().map(|s| s.pacer.view().1).sum(),
            ..t.live_counts(self.sources.len())
        }
    }

    /// The earliest lease expiry among live permits (tests: no permit outlives it).
    #[doc(hidden)]
    pub fn oldest_permit_expiry(&self) -> Option<Duration> {
        self.lock().oldest_expiry()
    }
}
