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
/// `max_tenants`: a full book forgets its least recently seen tenants with no call
/// and no permit (a sixteenth of the book at a time); when every tenant has one, a
/// new tenant is refused, and a scan that found fewer to forget is not repeated for a
/// second: a new tenant finding the book full meanwhile is refused. The scope's totals
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
    /// A full book that found no tenant to forget, or fewer than a sixteenth of it,
    /// refuses new ones when full again without looking until this instant
    /// ([`FULL_RETRY`]).
    full_until: Duration,
}

/// How long a full book whose every tenant has a call or a permit refuses new tenants
/// before it looks for one to forget again.
const FULL_RETRY: Duration = Duration::from_secs(1);

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
            let max = max.max(1) as usize;
            if g.map.len() >= max {
                if now < g.full_until {
                    return None;
                }
                // One scan forgets the least recently seen 1/16 of the book's idle
                // tenants (at least one), so a stream of new tenants at a full book
                // scans it once per max/16 of them, not once each.
                let mut idle: Vec<(Duration, Arc<str>)> = g
                    .map
                    .iter()
                    .filter(|(_, s)| s.calls == 0 && s.in_flight == 0)
                    .map(|(k, s)| (s.last, k.clone()))
                    .collect();
                if idle.is_empty() {
                    g.full_until = now + FULL_RETRY;
                    return None;
                }
                let n = (max / 16).clamp(1, idle.len());
                if n < max / 16 {
                    // Few to forget: the next ones finding the book full wait a
                    // second rather than scan it again each.
                    g.full_until = now + FULL_RETRY;
                }
                idle.select_nth_unstable_by_key(n - 1, |e| e.0);
                for (_, k) in &idle[..n] {
                    g.map.remove(k);
                }
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
        let Inner { map, sum, .. } = &mut *g;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// A full book forgets its least recently seen idle tenants, a sixteenth of it at
    /// a time, and keeps the recent and the busy ones.
    #[test]
    fn a_full_book_forgets_its_oldest_idle_sixteenth() {
        let b = Book::default();
        for i in 0..32u64 {
            b.enter(&format!("t{i}"), 32, s(i)).expect("room");
            if i != 0 {
                b.leave(&format!("t{i}"));
            }
        }
        // t0 still has its call: of the idle ones, t1 and t2 are the oldest.
        b.enter("new", 32, s(40)).expect("room made");
        assert_eq!(b.totals().0, 31);
        assert!(b.get("t0").is_some(), "a tenant with a call is kept");
        assert!(b.get("t1").is_none() && b.get("t2").is_none());
        assert!(b.get("t3").is_some() && b.get("new").is_some());
        b.enter("newer", 32, s(41))
            .expect("the room left by the same scan");
        assert_eq!(b.totals().0, 32);
    }

    /// When every tenant has a call, a new one is refused, and for a second the book
    /// does not look again (a flood of new ids would scan it on every call).
    #[test]
    fn a_book_of_busy_tenants_refuses_new_ones_and_looks_again_a_second_later() {
        let b = Book::default();
        for i in 0..4 {
            b.enter(&format!("t{i}"), 4, s(0)).expect("room");
        }
        assert!(b.enter("new", 4, s(1)).is_none());
        b.leave("t0");
        assert!(
            b.enter("new", 4, s(1) + Duration::from_millis(500))
                .is_none(),
            "within the second: not looked at again"
        );
        assert!(
            b.enter("new", 4, s(2)).is_some(),
            "a second later t0 is forgotten"
        );
        assert!(b.get("t0").is_none());
    }

    /// Tenants going idle one by one at a full book of 32 (a sixteenth: 2): a scan
    /// that finds only one to forget is not repeated within the second.
    #[test]
    fn a_scan_that_finds_little_to_forget_is_not_repeated_within_the_second() {
        let b = Book::default();
        for i in 0..32 {
            b.enter(&format!("t{i}"), 32, s(0)).expect("room");
        }
        b.leave("t0");
        assert!(b.enter("a", 32, s(5)).is_some(), "t0 forgotten");
        b.leave("t1");
        assert!(
            b.enter("b", 32, s(5) + Duration::from_millis(300))
                .is_none(),
            "within the second: refused without a scan"
        );
        assert!(b.get("t1").is_some());
        assert!(
            b.enter("b", 32, s(6)).is_some(),
            "a second later it scans again"
        );
        assert!(b.get("t1").is_none());
    }
}
