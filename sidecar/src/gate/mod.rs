//! The gates (§4, §6–§9): each a small, clock-free state machine with its own types,
//! plus the one composition of the two cross-host gates that the hot path uses.
//!
//! - [`memo`] (gate 1, §9) and [`pacer`] (gate 2, §8) are host-local and live in the
//!   engine; [`health`] ranks sources for the `health` selector (§4).
//! - [`quota`] (gate 3, §7) and [`breaker`] (gate 4, §6) hold the state a backend
//!   keeps per source. [`Gates`] is that pair for one source, with the combined
//!   operations [`Gates::admit`] (reserve, then enter; a breaker refusal gives the
//!   reservation back) and [`Gates::report`] (settle, then the verdict). The memory
//!   backend runs them under one lock; the Redis script implements the same rules.
//! - [`tenant`] (§19) is gate 3's second ledger, a tenant's: a backend keeps one per
//!   scope and tenant and takes it in the same atomic step as the source's gates
//!   ([`AdmitRequest::tenant`], [`ReportRequest::tenant`]).
//!
//! Nothing here imports a backend or the engine: they import the gates.

pub mod breaker;
pub mod classes;
pub mod health;
pub mod memo;
pub mod observed;
pub mod pacer;
pub mod quota;
pub mod tenant;

use std::time::Duration;

use breaker::{Applied, Breaker, BreakerParams, State};
use classes::{ClassTag, ClassUsage, Held};
use observed::Observation;
use quota::{AdmittedRate, Quota, QuotaParams, Reserve, Settlement, Split, Tokens};
use tenant::{Charge, TenantLimit, TenantParams};

/// Answer of the combined admission step (gates 3 + 4, [`Gates::admit`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admit {
    /// Quota reserved and breaker entered.
    Admitted {
        /// Epoch of the grant, carried by the permit.
        epoch: u64,
        /// The permit is the half-open probe.
        is_probe: bool,
        /// §19: the UTC day number the tenant's reservation was charged to (its
        /// settlement goes to that day's and month's budgets); 0 without a tenant.
        tenant_day: u32,
        /// §18 `learn_rate`: the learned factor the reservation was taken at and the
        /// last cut then in force ([`AdmittedRate::WHOLE`] on a source that does
        /// not learn). The permit carries it back ([`ReportRequest::admitted_at`]) so
        /// its settlement gives back what the reservation took, however the factor
        /// moved since, and its 429 cuts only if no cut was made since.
        rate: AdmittedRate,
    },
    /// §19: the call's tenant has no room for it (its bucket, or its dollar budget at
    /// this source's prices); nothing was taken, the source's gates not consulted.
    TenantLimited {
        /// The limit that refused.
        limit: TenantLimit,
        /// §6: until the tenant's ledger certainly admits this reservation.
        retry_after: Duration,
    },
    /// §19: the backend tracks `max_tenants` tenants of the scope already and this is
    /// a new one (memory backend); nothing was taken.
    TenantsFull,
    /// Quota refused (gate 3); the breaker was not consulted.
    RateLimited {
        /// Estimated time until quota frees.
        retry_after: Duration,
    },
    /// §15: the quota had room, but not for this call's priority class (its `limit`,
    /// or other classes' unused reserves on a saturated source); nothing was taken.
    ClassHeld {
        /// Which rule held it.
        why: Held,
        /// §6: time until the class's share certainly frees (or the bucket's own
        /// wait, whichever is later).
        retry_after: Duration,
    },
    /// Breaker refused (gate 4); the quota reservation was released.
    CircuitOpen {
        /// Breaker state.
        state: State,
        /// Epoch of the refusing state (the memo remembers it, §9/§10).
        epoch: u64,
        /// §6 retry-after.
        retry_after: Duration,
    },
}

/// Failure kinds (§13), as the engine sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Timed out (also lowers the pacer ceiling).
    Timeout,
    /// 5xx.
    ServerError,
    /// Connection trouble.
    Connection,
    /// Unusable answer.
    BadResult,
    /// Anything else.
    Error,
}

impl FailureKind {
    /// §7: a transient failure (`timeout`, `connection`, `server_error`) consumed no
    /// tokens upstream, so its token reservation is refunded; the others (`bad_result`,
    /// `error`: the upstream answered) are charged.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            FailureKind::Timeout | FailureKind::Connection | FailureKind::ServerError
        )
    }
}

/// What happened on one attempt (§2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// Useful answer.
    Success {
        /// Actual tokens; `None` keeps the estimate.
        tokens: Option<u64>,
        /// §7a: their input/output parts; `None` splits `tokens` in proportion to
        /// the reservation.
        split: Option<Split>,
        /// `false` keeps the success out of the breaker window.
        count_attempt: bool,
    },
    /// The upstream failed.
    Failure {
        /// What went wrong.
        kind: FailureKind,
        /// Tokens the upstream reported for a non-transient failure; `None` charges
        /// the estimate. Ignored for transient kinds (refunded, §7).
        tokens: Option<u64>,
        /// §7a: their input/output parts, as for a success.
        split: Option<Split>,
    },
    /// 429: backpressure, not failure.
    RateLimited {
        /// Upstream retry-after: blocks the quota until then, for every host.
        retry_after: Option<Duration>,
    },
    /// Given up before or while sending.
    Cancelled,
}

impl Outcome {
    /// A failure of `kind` without a token count.
    pub fn failure(kind: FailureKind) -> Self {
        Outcome::Failure {
            kind,
            tokens: None,
            split: None,
        }
    }

    /// A success of `tokens` (no split), counted in the window.
    pub fn success(tokens: Option<u64>) -> Self {
        Outcome::Success {
            tokens,
            split: None,
            count_attempt: true,
        }
    }

    /// §7 settlement of the reservation for this outcome: a success or a
    /// non-transient failure is charged its reported tokens (the estimate when none
    /// were reported), a transient failure or a 429 refunds the tokens, a
    /// cancellation refunds everything.
    /// Without a count the reservation is charged as it was made (its own split).
    pub fn settlement(&self, reserved: impl Into<Tokens>) -> Settlement {
        let r = reserved.into();
        let charge = |tokens: Option<u64>, split: Option<Split>| match (tokens, split) {
            (None, None) => Settlement::Charge {
                tokens: r.total,
                split: Some(Split {
                    input: r.input,
                    output: r.output,
                }),
            },
            (tokens, split) => Settlement::Charge {
                tokens: tokens.unwrap_or_else(|| split.map_or(0, |s| s.input + s.output)),
                split,
            },
        };
        match *self {
            Outcome::Success { tokens, split, .. } => charge(tokens, split),
            Outcome::Failure {
                kind,
                tokens,
                split,
            } if !kind.is_transient() => charge(tokens, split),
            Outcome::Failure { .. } | Outcome::RateLimited { .. } => Settlement::RefundTokens,
            Outcome::Cancelled => Settlement::RefundAll,
        }
    }
}

/// One admission's arguments: what [`Gates::admit`] and every backend's `admit`
/// take (one struct, so a new dimension is one more field, not a twin method).
#[derive(Debug, Clone, Copy)]
pub struct AdmitRequest<'a> {
    /// The scope's breaker parameters (gate 4).
    pub p: &'a BreakerParams,
    /// The source's buckets (gate 3).
    pub q: &'a QuotaParams,
    /// The reservation: total tokens and their input/output parts (§7a).
    pub tokens: Tokens,
    /// §15: the call's priority class (`None`: the scope has none).
    pub class: Option<&'a ClassTag>,
    /// §19: the call's tenant, charged in the same step (`None`: anonymous, or a
    /// scope without tenants).
    pub tenant: Option<TenantAdmit<'a>>,
}

/// Who a tenant is, for a backend: its ledger is keyed by the scope and the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantKey<'a> {
    /// The scope's name.
    pub scope: &'a str,
    /// The tenant id (empty: the anonymous tenant, when it has limits).
    pub tenant: &'a str,
}

/// §19: the tenant's side of one admission.
#[derive(Debug, Clone, Copy)]
pub struct TenantAdmit<'a> {
    /// Whose ledger.
    pub key: TenantKey<'a>,
    /// Its limits now.
    pub params: &'a TenantParams,
    /// What this admission charges it: the source's reservation and its estimated
    /// cost at the source's prices.
    pub charge: Charge,
    /// Most ledgers a backend holding them in memory keeps for the scope (past it a
    /// new tenant is [`Admit::TenantsFull`]).
    pub max_tenants: u32,
}

/// §19: settling a tenant's reservation.
#[derive(Debug, Clone, Copy)]
pub struct TenantSettle<'a> {
    /// Whose ledger.
    pub key: TenantKey<'a>,
    /// Its limits now.
    pub params: &'a TenantParams,
    /// What the admission charged.
    pub charge: Charge,
    /// How its tokens settle (§7's table; a tenant is charged what was used).
    pub how: Settlement,
    /// What the settlement costs, n$ (the estimate again for an abandoned permit).
    pub cost: u64,
    /// The day number the admission charged (`Admit::Admitted::tenant_day`).
    pub day: u32,
}

impl TenantSettle<'_> {
    /// The credits the tenant's ledger gets: tokens and requests by `how` (never the
    /// source's `tokens_charged = "estimate"`: the tenant pays what it used), and the
    /// estimate's difference from the cost (negative: charged more).
    pub fn credits(&self) -> (quota::Credits, i128) {
        let c = self.params.q.credits(self.charge.tokens, self.how);
        (c, self.charge.cost as i128 - self.cost as i128)
    }
}

impl<'a> AdmitRequest<'a> {
    /// An admission of `tokens` without a class.
    pub fn new(p: &'a BreakerParams, q: &'a QuotaParams, tokens: impl Into<Tokens>) -> Self {
        AdmitRequest {
            p,
            q,
            tokens: tokens.into(),
            class: None,
            tenant: None,
        }
    }

    /// The same on behalf of a tenant.
    pub fn tenant(self, t: TenantAdmit<'a>) -> Self {
        AdmitRequest {
            tenant: Some(t),
            ..self
        }
    }

    /// The same for a call of priority class `class`.
    pub fn class(self, class: &'a ClassTag) -> Self {
        AdmitRequest {
            class: Some(class),
            ..self
        }
    }
}

/// One report's arguments: what [`Gates::report`] and every backend's `report` take.
#[derive(Debug, Clone, Copy)]
pub struct ReportRequest<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
    /// The source's buckets.
    pub q: &'a QuotaParams,
    /// The epoch the permit was granted under (§6: a stale verdict is ignored).
    pub epoch: u64,
    /// The permit is the half-open probe (its lease is released).
    pub is_probe: bool,
    /// What the permit's admission reserved.
    pub reserved: Tokens,
    /// What happened.
    pub outcome: Outcome,
    /// §15: the permit's priority class (`None`: the scope has none).
    pub class: Option<&'a str>,
    /// §18: the provider's rate-limit headers of the attempt's response.
    pub observed: Option<&'a Observation>,
    /// §19: the permit's tenant reservation, settled in the same step.
    pub tenant: Option<TenantSettle<'a>>,
    /// §18 `learn_rate`: the factor the permit's reservation was taken at
    /// and the last cut then in force ([`Admit::Admitted::rate`]): its credits are
    /// converted at that factor, and its 429 cuts only under that cut. `None` unless
    /// set by [`ReportRequest::admitted_at`]: credits at the whole limit, a 429 cuts
    /// as if admitted under the last cut.
    pub admitted: Option<AdmittedRate>,
}

impl<'a> ReportRequest<'a> {
    /// A report without a class.
    pub fn new(
        p: &'a BreakerParams,
        q: &'a QuotaParams,
        epoch: u64,
        is_probe: bool,
        reserved: impl Into<Tokens>,
        outcome: Outcome,
    ) -> Self {
        ReportRequest {
            p,
            q,
            epoch,
            is_probe,
            reserved: reserved.into(),
            outcome,
            class: None,
            observed: None,
            tenant: None,
            admitted: None,
        }
    }

    /// The same for a permit whose reservation was taken at the learned factor
    /// `rate` (§18 `learn_rate`, [`Admit::Admitted::rate`]).
    pub fn admitted_at(self, rate: AdmittedRate) -> Self {
        ReportRequest {
            admitted: Some(rate),
            ..self
        }
    }

    /// The same settling the permit's tenant reservation too.
    pub fn tenant(self, t: TenantSettle<'a>) -> Self {
        ReportRequest {
            tenant: Some(t),
            ..self
        }
    }

    /// The same for a permit of priority class `class`.
    pub fn class(self, class: &'a str) -> Self {
        ReportRequest {
            class: Some(class),
            ..self
        }
    }

    /// The same with the response's observed limits (§18).
    pub fn observed(self, o: &'a Observation) -> Self {
        ReportRequest {
            observed: Some(o),
            ..self
        }
    }
}

/// The cross-host gates of one source: what a backend stores for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Gates {
    /// §6 state machine (gate 4).
    pub breaker: Breaker,
    /// §7 buckets and 429 block (gate 3).
    pub quota: Quota,
    /// §15 per-class usage of the buckets (reserves and limits).
    pub classes: ClassUsage,
}

impl Gates {
    /// A closed breaker whose epoch starts at `epoch`, and full buckets.
    pub fn new(now: Duration, epoch: u64) -> Self {
        Gates {
            breaker: Breaker::with_epoch(now, epoch),
            quota: Quota::new(),
            classes: ClassUsage::default(),
        }
    }

    /// Gates 3 and 4 in one step: for a call of a priority class, the class's limit
    /// and the other classes' unused reserves first (§15: a class held back takes
    /// nothing); then reserve the tokens and one request and enter the breaker; a
    /// breaker refusal releases the reservation; a grant counts in the class's usage.
    pub fn admit(&mut self, now: Duration, r: AdmitRequest<'_>) -> Admit {
        let AdmitRequest {
            p,
            q,
            tokens,
            class,
            tenant: _, // the backend keeps tenants' ledgers beside the sources' gates
        } = r;
        if let Some(class) = class {
            // §15 on the limits in force: `"auto"` as learned, scaled by §18's factor
            // (the deficits are in that bucket's refill time, and so is the usage).
            let eq = self.quota.effective(q, now);
            let deficits = self.quota.deficits(q, now);
            if let Some((why, wait)) = self.classes.held(&eq, deficits, class, tokens, now) {
                let bucket = self.quota.wait(q, tokens, now);
                return Admit::ClassHeld {
                    why,
                    retry_after: wait.max(bucket),
                };
            }
        }
        if let Reserve::Denied { retry_after } = self.quota.reserve(q, tokens, now) {
            return Admit::RateLimited { retry_after };
        }
        let e = self.breaker.try_enter(now, p);
        if !e.granted {
            self.quota.settle(q, tokens, Settlement::RefundAll, now);
            return Admit::CircuitOpen {
                state: e.state,
                epoch: e.epoch,
                retry_after: e.retry_after,
            };
        }
        if let Some(class) = class {
            let eq = self.quota.effective(q, now);
            self.classes.take(&eq, &class.share().name, tokens, now);
        }
        Admit::Admitted {
            epoch: e.epoch,
            is_probe: e.is_probe,
            tenant_day: 0,
            rate: self.quota.admitted(q, now),
        }
    }

    /// Settle a permit's reservation for its outcome (§7; a class's usage settles with
    /// the same credits, §15) and feed the outcome to the breaker under the permit's
    /// epoch (§6): a success or failure is a verdict; a 429 (which may block the
    /// quota) or a cancellation only releases a probe lease.
    pub fn report(&mut self, now: Duration, r: ReportRequest<'_>) -> Applied {
        let ReportRequest {
            p,
            q,
            epoch,
            is_probe,
            reserved,
            outcome,
            class,
            observed,
            tenant: _,
            admitted,
        } = r;
        let rate_ppm = admitted.map_or(quota::PPM_WHOLE, |a| a.ppm);
        let how = outcome.settlement(reserved);
        if let Some(class) = class {
            let eq = self.quota.effective(q, now);
            let then = self.quota.effective_at(q, rate_ppm);
            self.classes
                .settle_at(&eq, &then, class, reserved, how, now);
        }
        self.quota.settle_at(q, reserved, how, rate_ppm, now);
        if let Outcome::RateLimited { .. } = outcome {
            // §18 learn_rate: after this report's own settlement (its refund gives
            // back what its reservation took: converted at the factor of its
            // admission), before it blocks anything (a block already in force means
            // the ledger knew).
            self.quota.rate_limited(q, admitted, now);
        }
        if let Some(o) = observed {
            self.quota.observe(q, o, now);
        }
        match outcome {
            Outcome::Success { count_attempt, .. } => {
                self.breaker.record_success(now, epoch, count_attempt, p)
            }
            Outcome::Failure { .. } => self.breaker.record_failure(now, epoch, p),
            Outcome::RateLimited { retry_after } => {
                if let Some(d) = retry_after {
                    self.quota.block(d, now);
                }
                self.breaker.neutral(now, epoch, is_probe)
            }
            Outcome::Cancelled => self.breaker.neutral(now, epoch, is_probe),
        }
    }

    /// Admin: forget breaker and quota state (epoch bumped, never rewound).
    pub fn reset(&mut self, now: Duration) -> Applied {
        self.quota = Quota::new();
        self.classes = ClassUsage::default();
        self.breaker.reset(now)
    }
}
