//! Tenants' ledgers held in process (§19): the memory backend's, which a Redis
//! host's local fallback also serves while Redis cannot be read (§10).
//!
//! One map per scope, tenant id → [`Ledger`], under one lock that an admission holds
//! across the tenant's check, the source's gates and the tenant's take, so the two
//! ledgers change together or not at all. Ledgers are created on first sight and
//! forgotten once [`Ledger::idle`] (buckets full, nothing in flight, no spend in a
//! budget's current window): a sweep runs when a scope's map has doubled since the
//! last one, so memory stays proportional to the tenants that still matter. Past
//! `max_tenants` live ledgers in a scope, a new tenant is refused
//! ([`Admit::TenantsFull`]) rather than grown into.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::clock::Clock;
use crate::gate::tenant::{Ledger, LedgerView, TenantParams};
use crate::gate::{Admit, TenantAdmit, TenantKey, TenantSettle};

/// One scope's ledgers.
#[derive(Debug, Default)]
struct Scope {
    /// Tenant id → its limits when last used (an idle check needs the capacities) and
    /// its ledger.
    map: HashMap<Box<str>, (TenantParams, Ledger)>,
    /// Sweep for idle ledgers when the map reaches this size.
    sweep_at: usize,
}

/// The first sweep of a scope runs at this many ledgers.
const FIRST_SWEEP: usize = 1024;

/// Every scope's tenants' ledgers.
pub struct Ledgers {
    /// The backend's clock (buckets).
    clock: Arc<dyn Clock>,
    /// Unix seconds at the clock's zero: `wall = origin + now` dates the calendar
    /// windows of dollar budgets (UTC days and months). Settable for tests.
    wall_origin: AtomicU64,
    /// Scope name → its ledgers.
    scopes: Mutex<HashMap<Box<str>, Scope>>,
}

/// The ledgers' lock, with the clock readings of the step that holds it.
pub(super) struct Held<'a> {
    /// The locked maps.
    scopes: MutexGuard<'a, HashMap<Box<str>, Scope>>,
    /// The backend clock at the lock.
    now: Duration,
    /// Unix seconds at the lock.
    wall: u64,
}

impl Ledgers {
    /// Empty, with the wall clock read now.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let origin = unix.saturating_sub(clock.now().as_secs());
        Ledgers {
            clock,
            wall_origin: AtomicU64::new(origin),
            scopes: Mutex::new(HashMap::new()),
        }
    }

    /// Date the clock's zero at unix second `origin` (tests drive the calendar).
    pub fn set_wall_origin(&self, origin: u64) {
        self.wall_origin.store(origin, Ordering::Relaxed);
    }

    /// Lock the ledgers for one step.
    pub(super) fn lock(&self) -> Held<'_> {
        let scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        let wall = self.wall_origin.load(Ordering::Relaxed) + now.as_secs();
        Held { scopes, now, wall }
    }
}

impl Held<'_> {
    /// The ledger of `key`, created if new; `None` when the scope already tracks
    /// `max` tenants that are not idle.
    fn ledger(&mut self, key: TenantKey<'_>, p: &TenantParams, max: u32) -> Option<&mut Ledger> {
        let (now, wall) = (self.now, self.wall);
        if !self.scopes.contains_key(key.scope) {
            self.scopes.insert(key.scope.into(), Scope::default());
        }
        let scope = self.scopes.get_mut(key.scope).expect("inserted above");
        if !scope.map.contains_key(key.tenant) {
            let max = max.max(1) as usize;
            if scope.map.len() >= scope.sweep_at.max(FIRST_SWEEP).min(max) {
                scope.map.retain(|_, (p, l)| !l.idle(p, now, wall));
                scope.sweep_at = (2 * scope.map.len()).max(FIRST_SWEEP);
            }
            if scope.map.len() >= max {
                return None;
            }
        }
        let e = scope
            .map
            .entry(key.tenant.into())
            .or_insert_with(|| (*p, Ledger::default()));
        e.0 = *p;
        Some(&mut e.1)
    }

    /// Gate 3's tenant side around `admit_source` (the source's gates, run under this
    /// lock): the tenant's check first (a refusal takes nothing and asks no source),
    /// then the source; the tenant's take only when the source admitted.
    pub(super) fn admit(
        &mut self,
        t: TenantAdmit<'_>,
        admit_source: impl FnOnce() -> crate::backend::BResult<Admit>,
    ) -> crate::backend::BResult<Admit> {
        let (now, wall) = (self.now, self.wall);
        let Some(l) = self.ledger(t.key, t.params, t.max_tenants) else {
            return Ok(Admit::TenantsFull);
        };
        if let Some(r) = l.check(t.params, t.charge, now, wall) {
            return Ok(Admit::TenantLimited {
                limit: r.limit,
                retry_after: r.retry_after,
            });
        }
        let a = admit_source()?;
        Ok(match a {
            Admit::Admitted {
                epoch,
                is_probe,
                rate,
                ..
            } => {
                // The source's step ran under this lock: nothing changed the ledger.
                let l = self
                    .ledger(t.key, t.params, u32::MAX)
                    .expect("present: looked up above under the same lock");
                Admit::Admitted {
                    epoch,
                    is_probe,
                    tenant_day: l.take(t.params, t.charge, now, wall),
                    rate,
                }
            }
            other => other,
        })
    }

    /// The tenant's ledger alone: check and take (a Redis Cluster's first step).
    pub(super) fn reserve(&mut self, t: TenantAdmit<'_>) -> Admit {
        self.admit(t, || {
            Ok(Admit::Admitted {
                epoch: 0,
                is_probe: false,
                tenant_day: 0,
                rate: crate::gate::quota::AdmittedRate::WHOLE,
            })
        })
        .expect("the source step cannot fail")
    }

    /// Settle a reservation of `t.key` (§7's table for the tenant, the cost's
    /// difference on its windows). A ledger that was forgotten meanwhile (it could
    /// not have been: it had this call in flight) is not recreated.
    pub(super) fn settle(&mut self, t: TenantSettle<'_>) {
        let now = self.now;
        if let Some((p, l)) = self
            .scopes
            .get_mut(t.key.scope)
            .and_then(|s| s.map.get_mut(t.key.tenant))
        {
            *p = *t.params;
            l.settle(t.params, t.charge, t.how, t.cost, t.day, now);
        }
    }

    /// The ledger of `key` for status (`None`: not tracked here: fresh).
    pub(super) fn view(&self, key: TenantKey<'_>, p: &TenantParams) -> Option<LedgerView> {
        self.scopes
            .get(key.scope)
            .and_then(|s| s.map.get(key.tenant))
            .map(|(_, l)| l.view(p, self.now, self.wall))
    }

    /// Ledgers held now, over every scope (tests: idle ones are forgotten).
    pub(super) fn len(&self) -> usize {
        self.scopes.values().map(|s| s.map.len()).sum()
    }

    /// Forget every idle ledger now (tests; the daemon sweeps as maps grow).
    pub(super) fn sweep(&mut self) {
        let (now, wall) = (self.now, self.wall);
        for s in self.scopes.values_mut() {
            s.map.retain(|_, (p, l)| !l.idle(p, now, wall));
        }
        self.scopes.retain(|_, s| !s.map.is_empty());
    }
}
