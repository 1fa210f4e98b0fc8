//! A scope's tenants on this host (§19): their limits as the policy resolves them
//! ([`TenantPolicy`], swapped whole on SIGHUP) and the book of the tenants this host
//! has seen ([`Book`]: interned ids, calls and permits now, grants, refusals, tokens
//! and dollars settled here), which status, metrics and the `max_tenants` bound read.
//! Nothing here touches a backend: the ledgers that hold limits across hosts are the
//! backend's (`gate/tenant.rs`, `backend/ledgers.rs`, `gate.lua`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::config::{TenantLimits, TenantsConfig};
use crate::gate::quota::QuotaParams;
use crate::gate::tenant::TenantParams;

/// One tenant's limits and weight as the gate applies them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Resolved {
    /// Its ledger's limits.
    pub(crate) params: TenantParams,
    /// Its share of the fair turns (> 0).
    pub(crate) weight: f64,
}

impl Resolved {
    fn of(l: &TenantLimits, max_debt: Duration) -> Self {
        Resolved {
            params: TenantParams {
                q: QuotaParams {
                    tpm: l.tpm,
                    rpm: l.rpm,
                    tpd: l.tpd,
                    rpd: l.rpd,
                    max_debt,
                    ..QuotaParams::default()
                },
                usd_per_day: l.usd_per_day,
                usd_per_month: l.usd_per_month,
            },
            weight: l.weight.unwrap_or(1.0),
        }
    }
}

/// A scope's `[tenants]` as the engine reads it per pass.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TenantPolicy {
    /// Fair turns by VTC (`false`: arrival order).
    pub(crate) fair: bool,
    /// A tenant no override names.
    default: Resolved,
    /// The calls that name no tenant.
    anonymous: Resolved,
    /// Named tenants.
    overrides: HashMap<Box<str>, Resolved>,
    /// Most tenants tracked at once.
    pub(crate) max_tenants: u32,
}

impl TenantPolicy {
    /// From the scope's validated table; `max_debt` as the sources'.
    pub(crate) fn new(t: &TenantsConfig, max_debt: Duration) -> Self {
        TenantPolicy {
            fair: t.fairness == crate::config::Fairness::Vtc,
            default: Resolved::of(&t.default, max_debt),
            anonymous: Resolved::of(&t.anonymous, max_debt),
            overrides: t
                .overrides
                .iter()
                .map(|o| (o.name.as_str().into(), Resolved::of(&o.limits, max_debt)))
                .collect(),
            max_tenants: t.max_tenants,
        }
    }

    /// The limits of tenant `id` (`None`: anonymous).
    pub(crate) fn of(&self, id: Option<&str>) -> &Resolved {
        match id {
            None => &self.anonymous,
            Some(id) => self.overrides.get(id).unwrap_or(&self.default),
        }
    }
}

/// What this host knows of one tenant of a scope.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TenantStats {
    /// Live calls of it on this host.
    pub calls: u32,
    /// Permits of it in flight on this host.
    pub in_flight: u32,
    /// Permits granted to it here.
    pub grants: u64,
    /// Its calls that ended refused by its limits here.
    pub refused: u64,
    /// Tokens settled for it here.
    pub tokens: u64,
    /// Dollars settled for it here, n$.
    pub spend: u64,
    /// When it was last seen (engine clock): the least recent idle one is forgotten
    /// first when the book is full.
    last: Duration,
}

/// The tenants of one scope this host has seen, under one short lock. Bounded by
/// `max_tenants`: a full book forgets its least recently seen tenant with no call and
/// no permit; when every tenant has one, a new tenant is refused. The scope's totals
/// are kept apart, so forgetting a tenant never lowers them.
#[derive(Debug, Default)]
pub(crate) struct Book {
    /// The tenants and the totals.
    inner: Mutex<Inner>,
}

/// [`Book`]'s locked part.
#[derive(Debug, Default)]
struct Inner {
    /// Tenant id (interned: every call of a tenant shares one `Arc`) → its figures.
    map: HashMap<Arc<str>, TenantStats>,
    /// Grants, refusals, tokens and n$ over every tenant ever seen here.
    sum: TenantStats,
}

/// A change to one tenant's figures.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Event {
    /// A permit granted.
    Granted,
    /// A call ended refused by the tenant's limits.
    Refused,
    /// A permit settled (reported or abandoned): its tokens and cost, n$.
    Settled {
        /// Tokens charged.
        tokens: u64,
        /// Dollars charged, n$.
        cost: u64,
    },
}

impl Book {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call of `id` begins: its interned id, or `None` when the book holds `max`
    /// tenants that all have calls or permits.
    pub(crate) fn enter(&self, id: &str, max: u32, now: Duration) -> Option<Arc<str>> {
        let mut g = self.lock();
        if let Some(s) = g.map.get_mut(id) {
            s.calls += 1;
            s.last = now;
        } else {
            if g.map.len() >= max.max(1) as usize {
                let victim = g
                    .map
                    .iter()
                    .filter(|(_, s)| s.calls == 0 && s.in_flight == 0)
                    .min_by_key(|(_, s)| s.last)
                    .map(|(k, _)| k.clone())?;
                g.map.remove(&victim);
            }
            g.map.insert(
                Arc::from(id),
                TenantStats {
                    calls: 1,
                    last: now,
                    ..TenantStats::default()
                },
            );
        }
        g.map.get_key_value(id).map(|(k, _)| k.clone())
    }

    /// A call of `id` ended.
    pub(crate) fn leave(&self, id: &str) {
        if let Some(s) = self.lock().map.get_mut(id) {
            s.calls = s.calls.saturating_sub(1);
        }
    }

    /// Count `e` for `id` (and in the scope's totals).
    pub(crate) fn note(&self, id: &str, e: Event) {
        let mut g = self.lock();
        let Inner { map, sum } = &mut *g;
        let apply = |s: &mut TenantStats| match e {
            Event::Granted => {
                s.grants += 1;
                s.in_flight += 1;
            }
            Event::Refused => s.refused += 1,
            Event::Settled { tokens, cost } => {
                s.in_flight = s.in_flight.saturating_sub(1);
                s.tokens = s.tokens.saturating_add(tokens);
                s.spend = s.spend.saturating_add(cost);
            }
        };
        apply(sum);
        if let Some(s) = map.get_mut(id) {
            apply(s);
        }
    }

    /// `id`'s figures.
    pub(crate) fn get(&self, id: &str) -> Option<TenantStats> {
        self.lock().map.get(id).copied()
    }

    /// The `n` tenants with the most dollars settled here (then tokens, then id).
    pub(crate) fn top(&self, n: usize) -> Vec<(Arc<str>, TenantStats)> {
        let g = self.lock();
        let mut v: Vec<(Arc<str>, TenantStats)> =
            g.map.iter().map(|(k, s)| (k.clone(), *s)).collect();
        v.sort_by(|a, b| {
            b.1.spend
                .cmp(&a.1.spend)
                .then(b.1.tokens.cmp(&a.1.tokens))
                .then(a.0.cmp(&b.0))
        });
        v.truncate(n);
        v
    }

    /// Tenants in the book now, and the scope's totals (grants, refusals, tokens, n$
    /// ever; calls and permits now).
    pub(crate) fn totals(&self) -> (usize, TenantStats) {
        let g = self.lock();
        let mut t = g.sum;
        t.calls = g.map.values().map(|s| s.calls).sum();
        (g.map.len(), t)
    }
}
