//! In-process backend: breaker and quota state in this process, one host (§10).
//!
//! Each configured source has its own mutex-protected cell, created at start-up, so
//! operations on different sources never contend and the admission path allocates
//! nothing. The combined operations (`admit`, `report`) are the gates' own
//! compositions ([`Gates::admit`], [`Gates::report`]) run under one lock acquisition,
//! which makes them atomic like the Redis scripts. A call's tenant (§19) is charged
//! in the same step: the tenants' ledgers ([`super::ledgers`]) are locked first, then
//! the source's cell, on every path that takes both.

// foldhash: these maps are keyed by our own ids and config names (nothing a peer
// inserts), and SipHash was ~1.5 % of the per-frame CPU (§16).
use foldhash::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ledgers::Ledgers;
use super::{BResult, Backend, BackendError, SourceSnapshot};
use crate::clock::Clock;
use crate::gate::breaker::{Applied, BreakerParams, Entry, Peek, State};
use crate::gate::quota::{QuotaParams, Reserve, Settlement, Tokens};
use crate::gate::tenant::{LedgerView, TenantParams};
use crate::gate::{
    Admit, AdmitRequest, Gates, ReportRequest, TenantAdmit, TenantKey, TenantSettle,
};

/// The memory backend.
pub struct MemoryBackend {
    /// Time source (injected so tests drive it).
    clock: Arc<dyn Clock>,
    /// One cell per configured source; the map itself never changes after start-up.
    cells: HashMap<String, Mutex<Gates>>,
    /// §10: sources [`MemoryBackend::seed`]ed with a spent quota whose buckets are
    /// drained by the next admission (which carries the quota parameters), under the
    /// source's lock.
    drain: HashMap<String, AtomicBool>,
    /// §19: every scope's tenants' ledgers.
    tenants: Ledgers,
}

impl MemoryBackend {
    /// A backend knowing `sources` (operations on other names fail with
    /// [`BackendError::UnknownSource`]).
    pub fn new(
        clock: Arc<dyn Clock>,
        sources: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self::with_epoch_base(clock, sources, 0)
    }

    /// Like [`MemoryBackend::new`], with every breaker's epoch starting at `base`.
    /// A local fallback for a shared backend uses a large random base, so a permit
    /// granted by one can never match an epoch of the other (fencing across a
    /// degrade/restore).
    pub fn with_epoch_base(
        clock: Arc<dyn Clock>,
        sources: impl IntoIterator<Item = impl Into<String>>,
        base: u64,
    ) -> Self {
        let now = clock.now();
        let cells: HashMap<String, Mutex<Gates>> = sources
            .into_iter()
            .map(|s| (s.into(), Mutex::new(Gates::new(now, base))))
            .collect();
        let drain = cells
            .keys()
            .map(|k| (k.clone(), AtomicBool::new(false)))
            .collect();
        MemoryBackend {
            tenants: Ledgers::new(clock.clone()),
            clock,
            cells,
            drain,
        }
    }

    /// §19: date the clock's zero at unix second `origin`, so tests drive the
    /// calendar windows of dollar budgets (UTC days and months).
    #[doc(hidden)]
    pub fn set_wall_origin(&self, origin: u64) {
        self.tenants.set_wall_origin(origin);
    }

    /// §19: tenants' ledgers held now (idle ones are forgotten as the maps grow, and
    /// by [`MemoryBackend::sweep_tenants`]).
    #[doc(hidden)]
    pub fn tenant_ledgers(&self) -> usize {
        self.tenants.lock().len()
    }

    /// §19: forget every idle tenant ledger now.
    #[doc(hidden)]
    pub fn sweep_tenants(&self) {
        self.tenants.lock().sweep();
    }

    /// Gates 3 + 4 for `source`, with the call's tenant in the same step when it has
    /// one (`admit` runs the source's part).
    fn admit_with(
        &self,
        tenant: Option<TenantAdmit<'_>>,
        admit: impl FnOnce() -> BResult<Admit>,
    ) -> BResult<Admit> {
        match tenant {
            None => admit(),
            Some(t) => self.tenants.lock().admit(t, admit),
        }
    }

    /// Forget every source's state, as a restarted process (or a shared store that
    /// lost its data) would: each breaker fresh at epoch 0, buckets full. For tests
    /// of §10's state-loss handling; nothing in the daemon calls it.
    #[doc(hidden)]
    pub fn lose_state(&self) {
        let now = self.clock.now();
        for cell in self.cells.values() {
            *cell.lock().unwrap_or_else(|e| e.into_inner()) = Gates::new(now, 0);
        }
    }

    /// §10: start `source` afresh from what a shared backend's host last read of it
    /// (its local fallback's state when Redis cannot be read): OPEN until the known
    /// deadline, or with a probe due (which [`MemoryBackend::admit_no_probe`] never
    /// grants), the quota blocked as long as it was known to be, §18's learned factor
    /// as it was read; buckets full. The
    /// epoch moves on from the cell's (never back: a permit granted by an earlier
    /// fallback period stays fenced).
    pub fn seed(&self, source: &str, seed: Seed) -> BResult<()> {
        self.with(source, |c, now| {
            let epoch = c.breaker.peek(now).epoch;
            *c = Gates::new(now, epoch.saturating_add(1));
            match seed.open_for {
                Some(d) if !d.is_zero() => {
                    c.breaker.force_open(now, d);
                }
                _ if seed.probe_due => {
                    c.breaker.force_open(now, Duration::ZERO);
                }
                _ => {}
            }
            if !seed.blocked_for.is_zero() {
                c.quota.block(seed.blocked_for, now);
            }
            if let Some((ppm, age)) = seed.rate {
                c.quota.seed_rate(ppm, now.saturating_sub(age));
            }
            if let Some(d) = self.drain.get(source) {
                d.store(seed.quota_spent, Ordering::Relaxed);
            }
        })
    }

    /// Drain `source`'s buckets (under its lock) if its seed said the quota was spent.
    fn drain_if_seeded(&self, source: &str, c: &mut Gates, q: &QuotaParams, now: Duration) {
        if self
            .drain
            .get(source)
            .is_some_and(|d| d.swap(false, Ordering::Relaxed))
        {
            c.quota.drain(q, now);
        }
    }

    /// [`Backend::try_enter`], except that a probe is never granted (§10: not on a
    /// source whose shared state is unknown): where it would be, the answer is the
    /// HALF_OPEN refusal (retry_after 0).
    pub async fn try_enter_no_probe(&self, source: &str, p: &BreakerParams) -> BResult<Entry> {
        self.with(source, |c, now| match probe_due(c, now) {
            Some(epoch) => Entry {
                granted: false,
                is_probe: false,
                epoch,
                state: State::HalfOpen,
                retry_after: Duration::ZERO,
            },
            None => c.breaker.try_enter(now, p),
        })
    }

    /// [`Backend::admit`], except that a probe is never granted (as
    /// [`MemoryBackend::try_enter_no_probe`]); nothing is reserved then.
    pub async fn admit_no_probe(&self, source: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        self.admit_with(r.tenant, || {
            self.with(source, |c, now| match probe_due(c, now) {
                Some(epoch) => Admit::CircuitOpen {
                    state: State::HalfOpen,
                    epoch,
                    retry_after: Duration::ZERO,
                },
                None => {
                    self.drain_if_seeded(source, c, r.q, now);
                    c.admit(now, r)
                }
            })
        })
    }

    fn with<T>(&self, source: &str, f: impl FnOnce(&mut Gates, Duration) -> T) -> BResult<T> {
        let cell = self
            .cells
            .get(source)
            .ok_or_else(|| BackendError::UnknownSource(crate::limits::echo(source).into_owned()))?;
        let mut guard = cell.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        Ok(f(&mut guard, now))
    }
}

/// What a shared backend's host last knew of a source, for
/// [`MemoryBackend::seed`] (§10).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Seed {
    /// OPEN for this much longer.
    pub open_for: Option<Duration>,
    /// A probe is due (HALF_OPEN, or OPEN past its deadline): refused locally.
    pub probe_due: bool,
    /// The quota refuses this much longer (a 429 block, or the shared bucket's wait).
    pub blocked_for: Duration,
    /// The shared quota was seen refusing lately: the buckets start empty (drained
    /// by the next admission), not full.
    pub quota_spent: bool,
    /// §18 `learn_rate`: the learned factor (ppm of the limit, below the whole) as
    /// read this long ago: the local quota runs at it, recovering from then.
    pub rate: Option<(u32, Duration)>,
}

/// The epoch, when the next `try_enter` would grant a probe (HALF_OPEN, or OPEN past
/// its deadline).
fn probe_due(c: &Gates, now: Duration) -> Option<u64> {
    let p = c.breaker.peek(now);
    match p.state {
        State::HalfOpen => Some(p.epoch),
        State::Open if p.retry_after.is_zero() => Some(p.epoch),
        _ => None,
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        crate::config::BackendKind::Memory.as_str()
    }

    async fn try_enter(&self, source: &str, p: &BreakerParams) -> BResult<Entry> {
        self.with(source, |c, now| c.breaker.try_enter(now, p))
    }

    async fn record_success(
        &self,
        source: &str,
        epoch: u64,
        count_attempt: bool,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        self.with(source, |c, now| {
            c.breaker.record_success(now, epoch, count_attempt, p)
        })
    }

    async fn record_failure(
        &self,
        source: &str,
        epoch: u64,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.record_failure(now, epoch, p))
    }

    async fn release_probe(&self, source: &str, epoch: u64) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.release_probe(now, epoch))
    }

    async fn peek(&self, source: &str) -> BResult<Peek> {
        self.with(source, |c, now| c.breaker.peek(now))
    }

    async fn retry_after(&self, sources: &[&str]) -> BResult<Duration> {
        let mut min: Option<Duration> = None;
        for s in sources {
            let r = self.with(s, |c, now| c.breaker.retry_after(now))?;
            min = Some(min.map_or(r, |m| m.min(r)));
        }
        Ok(min.unwrap_or(Duration::ZERO))
    }

    async fn force_open(&self, source: &str, duration: Duration) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.force_open(now, duration))
    }

    async fn force_close(&self, source: &str) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.force_close(now))
    }

    async fn reset(&self, source: &str) -> BResult<Applied> {
        self.with(source, |c, now| c.reset(now))
    }

    async fn reserve(
        &self,
        source: &str,
        q: &QuotaParams,
        tokens: impl Into<Tokens> + Send,
    ) -> BResult<Reserve> {
        self.with(source, |c, now| {
            self.drain_if_seeded(source, c, q, now);
            c.quota.reserve(q, tokens, now)
        })
    }

    async fn settle(
        &self,
        source: &str,
        q: &QuotaParams,
        reserved_tokens: impl Into<Tokens> + Send,
        how: Settlement,
    ) -> BResult<()> {
        self.with(source, |c, now| {
            c.quota.settle(q, reserved_tokens, how, now)
        })
    }

    async fn block_quota(&self, source: &str, for_: Duration) -> BResult<()> {
        self.with(source, |c, now| c.quota.block(for_, now))
    }

    async fn snapshot(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> BResult<SourceSnapshot> {
        self.with(source, |c, now| {
            let b = c.breaker.view(now, p);
            let qv = c.quota.view(q, now);
            SourceSnapshot {
                state: b.state,
                epoch: b.epoch,
                retry_after: b.retry_after,
                cooldown_level: b.level,
                window_successes: b.successes,
                window_failures: b.failures,
                streak: b.streak,
                tokens_available: qv.tokens(),
                requests_available: qv.requests(),
                levels: qv.levels,
                quota_blocked: qv.blocked,
                seen: c.quota.seen(now),
            }
        })
    }

    async fn admit(&self, source: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        self.admit_with(r.tenant, || self.with(source, |c, now| c.admit(now, r)))
    }

    async fn report(&self, source: &str, r: ReportRequest<'_>) -> BResult<Applied> {
        match r.tenant {
            None => self.with(source, |c, now| c.report(now, r)),
            Some(t) => {
                let mut ledgers = self.tenants.lock();
                let a = self.with(source, |c, now| c.report(now, r))?;
                ledgers.settle(t);
                Ok(a)
            }
        }
    }

    async fn tenant_reserve(&self, t: TenantAdmit<'_>) -> BResult<Admit> {
        Ok(self.tenants.lock().reserve(t))
    }

    async fn tenant_settle(&self, t: TenantSettle<'_>) -> BResult<()> {
        self.tenants.lock().settle(t);
        Ok(())
    }

    async fn tenant_snapshot(
        &self,
        key: TenantKey<'_>,
        p: &TenantParams,
    ) -> BResult<Option<LedgerView>> {
        Ok(self.tenants.lock().view(key, p))
    }

    async fn neutral(&self, source: &str, epoch: u64, is_probe: bool) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.neutral(now, epoch, is_probe))
    }
}
