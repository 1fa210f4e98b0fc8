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
//! ([`Admit::TenantsFull`]) rather than grown into; a full scope whose sweep freed
//! under a sixteenth of it sweeps again only a second later ([`FULL_RETRY`]): new ids
//! finding it full meanwhile are refused at once.

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
    /// A sweep that left the map full, or freed under a sixteenth of it, refuses new
    /// tenants at a full map without sweeping again until this instant: a flood of
    /// new tenant ids at a full scope must not scan `max_tenants` ledgers under the
    /// one lock on every call.
    full_until: Duration,
    /// Sweeps run (tests).
    #[cfg(test)]
    sweeps: u32,
}

/// The first sweep of a scope runs at this many ledgers.
const FIRST_SWEEP: usize = 1024;

/// How long a full scope refuses new tenants before it sweeps for idle ledgers again.
const FULL_RETRY: Duration = Duration::from_secs(1);

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
            let full = scope.map.len() >= max;
            if full && now < scope.full_until {
                return None;
            }
            if scope.map.len() >= scope.sweep_at.max(FIRST_SWEEP).min(max) {
                let before = scope.map.len();
                scope.map.retain(|_, (p, l)| !l.idle(p, now, wall));
                scope.sweep_at = (2 * scope.map.len()).max(FIRST_SWEEP);
                // A sweep that freed little (under a sixteenth of the scope) is not
                // run again for a second once the scope is full: else a stream of new
                // ids at a scope where tenants go idle one by one scans it each time.
                if before - scope.map.len() < (max / 16).max(1) {
                    scope.full_until = now + FULL_RETRY;
                }
                #[cfg(test)]
                {
                    scope.sweeps += 1;
                }
            }
            if scope.map.len() >= max {
                scope.full_until = now + FULL_RETRY;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::gate::quota::{AdmittedRate, QuotaParams, Settlement, Tokens};
    use crate::gate::tenant::Charge;

    const CHARGE: Charge = Charge {
        tokens: Tokens {
            total: 10,
            input: 0,
            output: 0,
        },
        cost: 0,
    };

    fn key(tenant: &str) -> TenantKey<'_> {
        TenantKey {
            scope: "chat",
            tenant,
        }
    }

    /// An admission of `tenant` in a scope of at most `max` tenants, the source's
    /// gates granting.
    fn admit(l: &Ledgers, tenant: &str, p: &TenantParams, max: u32) -> Admit {
        let t = TenantAdmit {
            key: key(tenant),
            params: p,
            charge: CHARGE,
            max_tenants: max,
        };
        l.lock()
            .admit(t, || {
                Ok(Admit::Admitted {
                    epoch: 0,
                    is_probe: false,
                    tenant_day: 0,
                    rate: AdmittedRate::WHOLE,
                })
            })
            .unwrap()
    }

    /// One of `tenant`'s reservations given back whole.
    fn settle(l: &Ledgers, tenant: &str, p: &TenantParams) {
        l.lock().settle(TenantSettle {
            key: key(tenant),
            params: p,
            charge: CHARGE,
            how: Settlement::RefundAll,
            cost: 0,
            day: 0,
        });
    }

    fn admitted(a: Admit) -> bool {
        matches!(a, Admit::Admitted { .. })
    }

    fn sweeps(l: &Ledgers) -> u32 {
        l.lock().scopes.get("chat").map_or(0, |s| s.sweeps)
    }

    /// A full scope (every ledger live) refuses a flood of new tenants without a sweep
    /// per call: one sweep, then none for a second, then it sweeps again and admits
    /// into the room that idle ledgers left.
    #[test]
    fn a_full_scope_refuses_new_tenants_without_sweeping_on_every_call() {
        let clock = Arc::new(ManualClock::new());
        let l = Ledgers::new(clock.clone());
        let p = TenantParams {
            q: QuotaParams {
                tpm: Some(600),
                ..QuotaParams::default()
            },
            ..TenantParams::default()
        };
        for t in ["a", "b"] {
            assert!(admitted(admit(&l, t, &p, 2)));
        }
        for i in 0..100 {
            let a = admit(&l, &format!("new{i}"), &p, 2);
            assert_eq!(a, Admit::TenantsFull, "{i}");
        }
        assert_eq!(sweeps(&l), 1, "one sweep for the whole flood");
        // Known tenants are still served.
        assert!(admitted(admit(&l, "a", &p, 2)));
        // Their buckets refill in 2 s (20 tokens at 600/min) once nothing is in flight.
        for t in ["a", "a", "b"] {
            settle(&l, t, &p);
        }
        clock.advance(Duration::from_millis(500));
        assert_eq!(
            admit(&l, "late", &p, 2),
            Admit::TenantsFull,
            "within the second"
        );
        assert_eq!(sweeps(&l), 1);
        clock.advance(FULL_RETRY);
        assert!(admitted(admit(&l, "late", &p, 2)));
        assert_eq!(sweeps(&l), 2, "a second later it swept and found room");
        // That sweep freed both (a and b were idle): room for one more at once.
        assert!(admitted(admit(&l, "later", &p, 2)));
        assert_eq!(admit(&l, "c", &p, 2), Admit::TenantsFull);
        assert_eq!(
            sweeps(&l),
            3,
            "full again: one sweep, which found nothing idle"
        );
        assert_eq!(admit(&l, "d", &p, 2), Admit::TenantsFull);
        assert_eq!(sweeps(&l), 3, "and none more within the second");
    }

    /// Ledgers going idle one at a time at a full scope of 32 (a sixteenth: 2): a
    /// sweep that frees only one is not repeated within the second.
    #[test]
    fn a_sweep_that_frees_little_is_not_repeated_within_the_second() {
        let clock = Arc::new(ManualClock::new());
        let l = Ledgers::new(clock.clone());
        let p = TenantParams::default(); // no limits: idle once nothing is in flight
        for i in 0..32 {
            assert!(admitted(admit(&l, &format!("t{i}"), &p, 32)));
        }
        settle(&l, "t0", &p);
        assert!(admitted(admit(&l, "a", &p, 32)), "t0 swept");
        settle(&l, "t1", &p);
        clock.advance(Duration::from_millis(300));
        assert_eq!(admit(&l, "b", &p, 32), Admit::TenantsFull);
        assert_eq!(sweeps(&l), 1, "within the second: no sweep");
        clock.advance(FULL_RETRY);
        assert!(admitted(admit(&l, "b", &p, 32)));
        assert_eq!(sweeps(&l), 2);
    }
}
