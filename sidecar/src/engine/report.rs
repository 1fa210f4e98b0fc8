//! The end of an attempt and of a call (§3, §6–§9, §12): a Report settles the quota
//! and feeds the breaker, pacer and health; a permit never reported (call ended,
//! connection closed, lease expired) is abandoned: charged its estimate, its probe
//! lease released, its pacer slot freed, and no verdict reaches the breaker.

use std::future::Future;
use std::sync::Arc;

use futures_util::future::join_all;

use super::detach::Work;
use super::error::EngineError;
use super::runtime::bump;
use super::tables::{Ended, Hold, OwnerId, PermitRec};
use super::tenants::Event;
use super::transitions::{Names, Observation as Transition, Reason};
use super::Engine;
use crate::backend::{
    BResult, Backend, BackendError, Charge, Observation, ReportRequest, TenantKey, TenantParams,
    TenantSettle,
};
use crate::gate::breaker::{Applied, BreakerParams, State};
use crate::gate::pacer::Signal;
use crate::gate::quota::{AdmittedRate, QuotaParams, Settlement, Tokens};
use crate::gate::{FailureKind, Outcome};
use crate::logs::{self, Kind};

impl<B: Backend> Engine<B> {
    /// Report the outcome of the attempt made under `permit`.
    pub async fn report(
        &self,
        owner: OwnerId,
        permit: u64,
        outcome: Outcome,
    ) -> Result<Applied, EngineError> {
        self.report_in_call(owner, permit, outcome).await?.1
    }

    /// [`Engine::report`], also naming the call the permit belonged to (`Retry` and
    /// `Finish` go on with it). The outer `Err` means nothing changed (unknown permit,
    /// invalid outcome); otherwise the permit is gone and the inner result is the
    /// report's (a backend failure included).
    pub async fn report_in_call(
        &self,
        owner: OwnerId,
        permit: u64,
        outcome: Outcome,
    ) -> Result<(u64, Result<Applied, EngineError>), EngineError> {
        self.report_with(owner, permit, outcome, None).await
    }

    /// [`Engine::report`] with the response's observed limits (§18).
    pub async fn report_observed(
        &self,
        owner: OwnerId,
        permit: u64,
        outcome: Outcome,
        observed: Option<Box<Observation>>,
    ) -> Result<Applied, EngineError> {
        self.report_with(owner, permit, outcome, observed).await?.1
    }

    /// [`Engine::report_in_call`] with the response's observed limits (§18), which
    /// the backend applies atomically with the settlement; each reset is capped at
    /// `max_rate_limit_block` like a 429's `retry_after`.
    pub async fn report_with(
        &self,
        owner: OwnerId,
        permit: u64,
        outcome: Outcome,
        observed: Option<Box<Observation>>,
    ) -> Result<(u64, Result<Applied, EngineError>), EngineError> {
        self.report_full(owner, permit, outcome, observed, 0).await
    }

    /// [`Engine::report_with`] for a success whose input included `cached` reads
    /// from the provider's prompt cache (§19: a tenant's cost prices them at the
    /// source's cached rate; quota buckets settle as without them).
    pub async fn report_full(
        &self,
        owner: OwnerId,
        permit: u64,
        outcome: Outcome,
        mut observed: Option<Box<Observation>>,
        cached: u64,
    ) -> Result<(u64, Result<Applied, EngineError>), EngineError> {
        if let Some(o) = observed.as_deref_mut() {
            for d in o.dims.iter_mut().flatten() {
                d.reset = d.reset.map(|r| r.min(self.max_rate_limit_block));
            }
        }
        // §7: one buggy worker (or an upstream's daily Retry-After) must not block a
        // source for every host for a day: the block is capped, silently.
        let outcome = match outcome {
            Outcome::RateLimited {
                retry_after: Some(d),
            } => Outcome::RateLimited {
                retry_after: Some(d.min(self.max_rate_limit_block)),
            },
            o => o,
        };
        let now = self.clock.now();
        let p = self.lock().take_reported(owner, permit, &outcome, now)?;
        let src = &self.sources[p.source];
        bump(match outcome {
            Outcome::Success { .. } => &src.counters.successes,
            Outcome::Failure { .. } => &src.counters.failures,
            Outcome::RateLimited { .. } => &src.counters.rate_limited,
            Outcome::Cancelled => &src.counters.cancelled,
        });
        // §8: only a usable success grows the ceiling; a `count_attempt = false`
        // success (its result was unusable) holds it, like the other failures.
        let signal = match outcome {
            Outcome::Success {
                count_attempt: true,
                ..
            } => Signal::Increase,
            Outcome::RateLimited { .. }
            | Outcome::Failure {
                kind: FailureKind::Timeout,
                ..
            } => Signal::Decrease,
            _ => Signal::Hold,
        };
        src.pacer
            .release_as(signal, self.class_name(p.scope, p.class).as_deref());
        // §4: health counts a `count_attempt = false` success as a failure, and
        // forgets with the half-life of the scope's breaker window.
        let half_life = self.scopes[p.scope].with_policy(|pol| pol.bp.window);
        let latency = now.saturating_sub(p.granted_at);
        match outcome {
            Outcome::Success { count_attempt, .. } => {
                src.health.record(count_attempt, latency, now, half_life)
            }
            Outcome::Failure { .. } => src.health.record(false, latency, now, half_life),
            _ => {}
        }
        // §19: what an unlimited tenant (no ledger to settle) is charged all the same.
        let how = outcome.settlement(p.tokens);
        let spent = (
            charged_tokens(how),
            src.params().prices.settled(how, cached),
        );
        let settle = Settle::of_permit(self, &p, outcome, cached).observed(observed);
        self.tenant_settled(&p, settle.tenant.as_ref(), spent);
        let r = self
            .detached(settle)
            .await
            .unwrap_or_else(|| Err(BackendError::Unavailable("report task failed".into())));
        let applied = match r {
            Ok(a) => a,
            Err(e) => {
                self.wake_one(p.source);
                let e = EngineError::BackendUnavailable {
                    scope: Some(self.scopes[p.scope].name.clone()),
                    message: e.to_string(),
                    reasons: Vec::new(),
                };
                return Ok((p.call, Err(e)));
            }
        };
        self.note_state(p.source, &applied);
        self.observe_report(&p, &outcome, &applied);
        if p.is_probe && applied.applied && applied.state == State::Closed {
            self.wake_all(p.source); // the probe closed the breaker: everyone may go
        } else {
            self.wake_one(p.source);
        }
        Ok((p.call, Ok(applied)))
    }

    /// §12: the breaker state a report's answer shows, with its reason when this
    /// report caused the change; a 429 with a retry-after starts a quota block.
    fn observe_report(&self, p: &PermitRec, outcome: &Outcome, a: &Applied) {
        if let Outcome::RateLimited {
            retry_after: Some(d),
        } = outcome
        {
            let names = Names {
                scope_idx: p.scope,
                scope: &self.scopes[p.scope].name,
                source: &self.sources[p.source].name,
            };
            self.sources[p.source]
                .transitions
                .quota_block(self.clock.now(), names, *d);
        }
        let reason = match (a.applied, a.trip, p.is_probe, outcome, a.state) {
            (true, Some(t), _, _, _) => Reason::from(t),
            (true, None, true, Outcome::Failure { .. }, State::Open) => Reason::ProbeFailure,
            (true, None, true, Outcome::Success { .. }, State::Closed) => Reason::ProbeSuccess,
            _ => Reason::Observed,
        };
        self.observe(
            p.scope,
            p.source,
            Transition {
                state: a.state,
                epoch: a.epoch,
                reason,
                cooldown: a.retry_after,
                level: Some(a.level),
            },
        );
    }

    /// Forget the call; an unreported permit is abandoned (settled as if the upstream
    /// used the estimate, probe lease released).
    pub async fn end_call(&self, owner: OwnerId, call: u64) -> Result<(), EngineError> {
        let (permit, ended) = self.lock().end_call(owner, call)?;
        self.calls_ended(std::iter::once(ended));
        if let Some(p) = permit {
            self.abandon_all(vec![p]).await;
        }
        Ok(())
    }

    /// Release everything `owner` holds (connection closed): permits settled as if the
    /// upstream used the estimate, probe leases released, pacer slots freed, calls
    /// forgotten. Waits of the owner end when their futures are dropped.
    pub async fn release_owner(&self, owner: OwnerId) {
        let (permits, ended) = self.lock().release_owner(owner);
        self.calls_ended(ended);
        self.abandon_all(permits).await;
    }

    /// §19: calls that ended leave their tenants' books.
    fn calls_ended(&self, ended: impl IntoIterator<Item = Ended>) {
        for (scope, tenant) in ended {
            if let (Some(book), Some(t)) = (&self.scopes[scope].book, tenant) {
                book.leave(&t);
            }
        }
    }

    /// §19: a permit of a tenant settles on this host: its book counts the tokens and
    /// dollars charged, and its fair-turn counter is corrected from the estimate it was
    /// charged at grant to what was used. `spent`: the tokens and n$ of the outcome,
    /// for a tenant without a ledger (unlimited).
    fn tenant_settled(&self, p: &PermitRec, t: Option<&TenantPart>, spent: (u64, u64)) {
        let sc = &self.scopes[p.scope];
        let Some(book) = &sc.book else { return };
        let (tokens, cost) = t.map_or(spent, |t| (charged_tokens(t.how), t.cost));
        if let Some(id) = &p.tenant {
            book.note(id, Event::Settled { tokens, cost });
        }
        if let (Some(q), Some(t)) = (&sc.queue, t) {
            q.correct(&p.tenant, tokens as f64 - p.tokens.total as f64, t.weight);
        }
    }

    /// Reclaim permits whose lease (2 × source timeout) expired; returns how many.
    /// The daemon calls this periodically.
    pub async fn reclaim_expired(&self) -> usize {
        let now = self.clock.now();
        let expired: Vec<PermitRec> = {
            let mut t = self.lock();
            let ids = t.expired(now);
            t.detach(&ids, now)
        };
        let n = expired.len();
        for p in &expired {
            if logs::allow(Kind::Reclaimed) {
                tracing::warn!(source = %self.sources[p.source].name, "reclaimed a permit never reported within its lease");
            }
        }
        self.abandon_all(expired).await;
        n
    }

    /// Settle abandoned permits (never reported: connection closed, call ended,
    /// lease expired): the quota keeps the estimate as if the upstream used it, a
    /// probe lease is released, the pacer slot freed; no verdict reaches the breaker.
    /// Every pacer slot is freed at once, then the backend work runs concurrently (two
    /// round trips each on Redis, none serialised behind another permit's), in tasks
    /// that finish even if the caller is dropped.
    async fn abandon_all(&self, permits: Vec<PermitRec>) {
        for p in &permits {
            let cls = self.class_name(p.scope, p.class);
            self.sources[p.source]
                .pacer
                .release_as(Signal::Hold, cls.as_deref());
            bump(&self.sources[p.source].counters.abandoned);
            // §19: an abandoned permit keeps its estimate, for the tenant too.
            if let (Some(book), Some(id)) = (&self.scopes[p.scope].book, &p.tenant) {
                let prices = self.sources[p.source].params().prices;
                let cost = p
                    .ledger
                    .map_or_else(|| prices.estimate(p.tokens), |l| l.cost);
                book.note(
                    id,
                    Event::Settled {
                        tokens: p.tokens.total,
                        cost,
                    },
                );
            }
        }
        join_all(permits.into_iter().map(|p| self.detached(Abandon(p)))).await;
    }
}

/// The backend half of a report: settle a grant's reservation for `outcome` and feed
/// the breaker under the grant's epoch, with the parameters current when it was made.
pub(super) struct Settle {
    /// Source index.
    source: usize,
    /// Breaker parameters of the call's scope.
    bp: BreakerParams,
    /// Quota parameters of the source.
    qp: QuotaParams,
    /// Breaker epoch of the grant.
    epoch: u64,
    /// The grant holds the probe lease.
    is_probe: bool,
    /// Tokens the grant reserved.
    tokens: Tokens,
    /// §18 `learn_rate`: the learned factor they were reserved at, the last cut then.
    rate: AdmittedRate,
    /// What happened.
    outcome: Outcome,
    /// §15: the grant's priority class, whose usage settles with the buckets
    /// (`None`: the scope has no classes).
    class: Option<Arc<str>>,
    /// §18: the response's observed limits (boxed: most reports carry none).
    observed: Option<Box<Observation>>,
    /// §19: the grant's tenant reservation, settled in the same step (`None`: no
    /// ledger was charged).
    tenant: Option<TenantPart>,
}

/// §19: the tenant side of a [`Settle`] (what [`TenantSettle`] borrows).
pub(super) struct TenantPart {
    /// The scope's name.
    scope: Arc<str>,
    /// The tenant (`None`: the anonymous tenant, with limits).
    tenant: Option<Arc<str>>,
    /// Its limits now.
    params: TenantParams,
    /// Its weight now (its fair-turn counter's correction).
    weight: f64,
    /// What the grant charged.
    charge: Charge,
    /// How its tokens settle.
    how: Settlement,
    /// What the settlement costs, n$.
    cost: u64,
    /// The day number the grant charged.
    day: u32,
}

impl TenantPart {
    /// Borrowed for a backend.
    pub(super) fn settle(&self) -> TenantSettle<'_> {
        TenantSettle {
            key: TenantKey {
                scope: &self.scope,
                tenant: self.tenant.as_deref().unwrap_or(""),
            },
            params: &self.params,
            charge: self.charge,
            how: self.how,
            cost: self.cost,
            day: self.day,
        }
    }

    /// The tenant part of settling `p` `how` at `cost` (`None`: no ledger charged).
    pub(super) fn of<B: Backend>(
        engine: &Engine<B>,
        p: &PermitRec,
        how: Settlement,
        cost: u64,
    ) -> Option<Self> {
        let l = p.ledger?;
        let sc = &engine.scopes[p.scope];
        let r = sc.with_policy(|pol| pol.tenants.as_ref().map(|t| *t.of(p.tenant.as_deref())))?;
        Some(TenantPart {
            scope: sc.name.as_str().into(),
            tenant: p.tenant.clone(),
            params: r.params,
            weight: r.weight,
            charge: Charge {
                tokens: p.tokens,
                cost: l.cost,
            },
            how,
            cost,
            day: l.day,
        })
    }
}

/// The tokens a settlement charges (the refunds: none).
fn charged_tokens(how: Settlement) -> u64 {
    match how {
        Settlement::Charge { tokens, .. } => tokens,
        Settlement::RefundTokens | Settlement::RefundAll => 0,
    }
}

impl Settle {
    /// The report of `p`'s attempt (`cached`: the success's cached input reads).
    fn of_permit<B: Backend>(
        engine: &Engine<B>,
        p: &PermitRec,
        outcome: Outcome,
        cached: u64,
    ) -> Self {
        let prices = engine.sources[p.source].params().prices;
        let how = outcome.settlement(p.tokens);
        Settle {
            source: p.source,
            bp: engine.scopes[p.scope].with_policy(|pol| pol.bp),
            qp: engine.sources[p.source].params().qp,
            epoch: p.epoch,
            is_probe: p.is_probe,
            tokens: p.tokens,
            rate: p.rate,
            outcome,
            class: engine.class_name(p.scope, p.class),
            observed: None,
            tenant: TenantPart::of(engine, p, how, prices.settled(how, cached)),
        }
    }

    /// The same, carrying the response's observed limits (§18).
    fn observed(self, observed: Option<Box<Observation>>) -> Self {
        Settle { observed, ..self }
    }

    /// Giving back `g`, a hold of a call in `scope` that never became a permit.
    pub(super) fn of_hold<B: Backend>(engine: &Engine<B>, scope: usize, g: &Hold) -> Self {
        let tenant = g.ledger.and_then(|l| {
            let sc = &engine.scopes[scope];
            let r =
                sc.with_policy(|pol| pol.tenants.as_ref().map(|t| *t.of(g.tenant.as_deref())))?;
            Some(TenantPart {
                scope: sc.name.as_str().into(),
                tenant: g.tenant.clone(),
                params: r.params,
                weight: r.weight,
                charge: Charge {
                    tokens: g.tokens,
                    cost: l.cost,
                },
                how: Settlement::RefundAll,
                cost: 0,
                day: l.day,
            })
        });
        Settle {
            tenant,
            source: g.source,
            bp: engine.scopes[scope].with_policy(|pol| pol.bp),
            qp: engine.sources[g.source].params().qp,
            epoch: g.epoch,
            is_probe: g.is_probe,
            tokens: g.tokens,
            rate: g.rate,
            outcome: Outcome::Cancelled,
            class: engine.class_name(scope, g.class),
            observed: None,
        }
    }
}

impl<B: Backend> Work<B> for Settle {
    type Output = BResult<Applied>;

    fn run<'a>(&'a self, engine: &'a Engine<B>) -> impl Future<Output = Self::Output> + Send + 'a {
        let name = &engine.sources[self.source].name;
        async move {
            let mut r = ReportRequest::new(
                &self.bp,
                &self.qp,
                self.epoch,
                self.is_probe,
                self.tokens,
                self.outcome,
            )
            .admitted_at(self.rate);
            if let Some(class) = &self.class {
                r = r.class(class);
            }
            if let Some(o) = &self.observed {
                r = r.observed(o);
            }
            if let Some(t) = &self.tenant {
                r = r.tenant(t.settle());
            }
            engine.backend.report(name, r).await
        }
    }
}

/// Give back a hold that never became a permit (nothing was sent), with nobody to
/// tell: a failure is logged, and the freed capacity wakes a waiter.
pub(super) struct GiveBack(
    /// The cancellation report that gives it back.
    pub(super) Settle,
);

impl<B: Backend> Work<B> for GiveBack {
    type Output = ();

    async fn run(&self, engine: &Engine<B>) {
        if let Err(e) = self.0.run(engine).await {
            let name = &engine.sources[self.0.source].name;
            if logs::allow(Kind::ReleaseFailed) {
                tracing::warn!(source = %name, error = %e, "could not release a grant");
            }
        }
        engine.wake_one(self.0.source);
    }
}

/// The backend half of abandoning a permit: keep the estimate, release a probe.
pub(super) struct Abandon(
    /// The permit, already out of the tables.
    pub(super) PermitRec,
);

impl<B: Backend> Work<B> for Abandon {
    type Output = ();

    async fn run(&self, engine: &Engine<B>) {
        let p = &self.0;
        let src = &engine.sources[p.source];
        let how = Outcome::success(None).settlement(p.tokens);
        if let Err(e) = engine
            .backend
            .settle(&src.name, &src.params().qp, p.tokens, how)
            .await
        {
            if logs::allow(Kind::ReleaseFailed) {
                tracing::warn!(source = %src.name, error = %e, "could not settle an abandoned permit");
            }
        }
        if let Err(e) = engine.backend.neutral(&src.name, p.epoch, p.is_probe).await {
            if logs::allow(Kind::ReleaseFailed) {
                tracing::warn!(source = %src.name, error = %e, "could not release an abandoned probe");
            }
        }
        // §19: the tenant keeps the estimate too (its permit is no longer in flight).
        let cost = p.ledger.map_or(0, |l| l.cost);
        if let Some(t) = TenantPart::of(engine, p, how, cost) {
            if let Err(e) = engine.backend.tenant_settle(t.settle()).await {
                if logs::allow(Kind::ReleaseFailed) {
                    tracing::warn!(source = %src.name, error = %e, "could not settle an abandoned permit's tenant");
                }
            }
        }
        engine.wake_one(p.source);
    }
}
