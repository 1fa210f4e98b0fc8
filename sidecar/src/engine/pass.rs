//! One admission pass over a scope's candidates (§4) and the nap formula (§5).
//!
//! The pass visits candidates in selector order with the call's failed sources moved
//! to the back, and asks each gate in turn: memo → pacer → quota → breaker (the last
//! two in one backend operation). It allocates one small vector per pass for the
//! order, nothing per candidate. An OPEN source remembered in the memo costs no
//! backend traffic, except that on a shared backend this host re-checks it at most
//! once per [`MEMO_RECHECK`] (a read): a backend whose epoch went backwards lost its
//! state (§10), and the memo entry is dropped rather than skipping a CLOSED source.
//!
//! Every refusal also says when that source would certainly pass (§6, the table of
//! call-ending errors): memo / OPEN → until − now, HALF_OPEN → 0, quota → the
//! backend's wait for this call's estimate (refill after debt, or the 429 block,
//! whichever is later), paced → 0. The minimum is the `retry_after` of an error the
//! call ends with after this pass.

use std::future::Future;
use std::time::Duration;

use super::detach::Work;
use super::report::{GiveBack, Settle};
use super::runtime::bump;
use super::runtime::Policy;
use super::tables::{Hold, LedgerHold};
use super::transitions::{Observation, Reason};
use super::CallEst;
use super::{Engine, SkipReason};
use crate::backend::{
    AdmitRequest, BResult, Backend, BackendError, Charge, TenantAdmit, TenantKey, TenantParams,
};
use crate::config::Selector;
use crate::gate::breaker::{BreakerParams, Peek, State};
use crate::gate::classes::{ClassTag, Held};
use crate::gate::health::rank;
use crate::gate::quota::{QuotaParams, Tokens};
use crate::gate::Admit;
use std::sync::Arc;

/// A shared backend's memo entry is re-checked at most this often per source (§10).
pub const MEMO_RECHECK: Duration = Duration::from_secs(1);

/// What a pass that granted nothing saw.
#[derive(Debug, Default)]
pub(crate) struct Refused {
    /// Sources refused for circuit reasons (memo or breaker): §5 `gate_rejections`.
    pub gate_rejections: usize,
    /// §19: sources the call's tenant had no room for, and the limit that refused the
    /// last of them (a dollar budget wins over a bucket: nothing refills it).
    pub tenant_rejections: usize,
    /// §19: every tenant refusal was a dollar budget's.
    pub tenant_budgets_only: bool,
    /// §19: the limit named by the call-ending error.
    pub tenant_limit: Option<crate::gate::tenant::TenantLimit>,
    /// §19: min over the tenant-refused sources of the tenant's wait.
    pub tenant_retry_after: Option<Duration>,
    /// §19: the backend tracks too many tenants of the scope already.
    pub tenants_full: bool,
    /// §6: min over the scope's sources of the time until the gate that refused each
    /// would certainly pass (`None` before any source was looked at).
    pub retry_after: Option<Duration>,
    /// A backend error under `fail_closed`, if any source hit one.
    pub unavailable: Option<String>,
}

impl Refused {
    /// One more source refused, passing certainly after `d`.
    fn source(&mut self, d: Duration) {
        self.retry_after = Some(self.retry_after.map_or(d, |m| m.min(d)));
    }

    /// §19: one more source refused by the call's tenant's `limit`.
    fn tenant(&mut self, limit: crate::gate::tenant::TenantLimit, d: Duration) {
        self.source(d);
        if self.tenant_rejections == 0 {
            self.tenant_budgets_only = true;
        }
        self.tenant_rejections += 1;
        self.tenant_budgets_only &= limit.is_budget();
        if self.tenant_limit.is_none_or(|l| !l.is_budget()) {
            self.tenant_limit = Some(limit);
        }
        self.tenant_retry_after = Some(self.tenant_retry_after.map_or(d, |m| m.min(d)));
    }

    /// §19: every source that reached the quota gate was refused by the call's tenant
    /// (the others, if any, for circuit reasons): the tenant is what stops the call.
    pub(crate) fn tenant_only(&self, sources: usize) -> bool {
        self.tenant_rejections > 0 && self.gate_rejections + self.tenant_rejections == sources
    }

    /// The §6 retry-after of an error the call ends with now.
    pub(crate) fn retry_after(&self) -> Duration {
        self.retry_after.unwrap_or(Duration::ZERO)
    }
}

/// What the memo re-check decided about a source it holds.
enum Memo {
    /// Still OPEN: skip it, certainly passing after this long.
    Skip(Duration),
    /// The entry was wrong (state lost, or closed meanwhile): ask the gates.
    Dropped,
}

impl<B: Backend> Engine<B> {
    /// One pass (§4) under one policy snapshot. `reasons` is indexed by position in
    /// the scope and persists across the passes of one Acquire (`paced` never
    /// overwrites a recorded reason).
    #[allow(clippy::too_many_arguments)] // one pass's inputs, each its own
    pub(super) async fn pass(
        &self,
        scope: usize,
        policy: &Policy,
        failed: &[usize],
        est: CallEst,
        class: usize,
        tenant: &Option<Arc<str>>,
        reasons: &mut [Option<SkipReason>],
    ) -> Result<Hold, Refused> {
        // §19: the call's tenant's limits, read with the policy (a reload applies to
        // calls already waiting); `None`: no ledger to charge (no tenants, or an
        // unlimited tenant).
        let tenant_limits = policy
            .tenants
            .as_ref()
            .map(|t| (*t.of(tenant.as_deref()), t.max_tenants))
            .filter(|(r, _)| !r.params.unlimited());
        self.passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut refused = Refused::default();
        for (pos, idx) in self.candidates(scope, policy, failed) {
            let src = &self.sources[idx];
            let params = src.params();
            let now = self.clock.now();
            // Gate 1: cooldown memo.
            let rem = src.memo.remaining(now);
            if !rem.is_zero() {
                let skip = match self.recheck_memo(idx, now).await {
                    None => Some(rem),
                    Some(Memo::Skip(d)) => Some(d),
                    Some(Memo::Dropped) => None,
                };
                if let Some(d) = skip {
                    reasons[pos] = Some(SkipReason::CircuitOpen);
                    refused.gate_rejections += 1;
                    refused.source(d);
                    continue;
                }
            }
            // Gate 2: pacer (check and take in one step). The slot is a guard: any
            // way out of this iteration but a grant gives it back, including a
            // cancelled Acquire dropping this future mid-round-trip.
            let tag = policy.shares.as_ref().map(|s| ClassTag {
                shares: s.clone(),
                index: class,
            });
            let slot = match &tag {
                None => src.pacer.try_slot(),
                Some(t) => src.pacer.try_slot_class(t),
            };
            let Some(slot) = slot else {
                reasons[pos].get_or_insert(SkipReason::Paced);
                refused.source(Duration::ZERO);
                continue;
            };
            // Gates 3 + 4: quota then breaker, one backend operation — unless this
            // host's quota hint already knows the answer for this tick.
            let tokens = params.estimate(est);
            let poll = policy.cfg.poll_interval;
            if let Some(wait) = src.quota_hint.wait(now, tokens.total, poll) {
                reasons[pos] = Some(SkipReason::RateLimited);
                refused.source(wait);
                continue;
            }
            let hint_generation = src.quota_hint.generation();
            let admission = Admission {
                scope,
                source: idx,
                bp: policy.bp,
                qp: params.qp,
                tokens,
                class: tag,
                tenant: tenant_limits.map(|(r, max)| TenantAsk {
                    id: tenant.clone(),
                    params: r.params,
                    charge: Charge {
                        tokens,
                        cost: params.prices.estimate(tokens),
                    },
                    max_tenants: max,
                }),
            };
            let ask_cost = admission.tenant.as_ref().map(|t| t.charge.cost);
            let answer = self
                .detached(admission)
                .await
                .unwrap_or_else(|| Err(BackendError::Unavailable("admission task failed".into())));
            match answer {
                Ok(Admit::Admitted {
                    epoch,
                    is_probe,
                    tenant_day,
                    rate,
                }) => {
                    // From here the Acquire's Ticket owns the slot (no await between).
                    slot.keep();
                    let (state, reason) = match is_probe {
                        true => (State::HalfOpen, Reason::CooldownOver),
                        false => (State::Closed, Reason::Observed),
                    };
                    self.observe(scope, idx, Observation::of(state, epoch, reason));
                    return Ok(Hold {
                        source: idx,
                        epoch,
                        is_probe,
                        tokens,
                        rate,
                        class,
                        ledger: ask_cost.map(|cost| LedgerHold {
                            day: tenant_day,
                            cost,
                        }),
                        tenant: tenant.clone(),
                    });
                }
                // §19: the tenant has no room on this source (its price, or its
                // estimate here, may differ on another). The source's own gates were
                // not asked: its quota hint stays as it was.
                Ok(Admit::TenantLimited { limit, retry_after }) => {
                    reasons[pos] = Some(SkipReason::TenantLimited);
                    refused.tenant(limit, retry_after);
                }
                Ok(Admit::TenantsFull) => {
                    reasons[pos] = Some(SkipReason::TenantLimited);
                    refused.source(Duration::ZERO);
                    refused.tenants_full = true;
                }
                Ok(Admit::RateLimited { retry_after }) => {
                    reasons[pos] = Some(SkipReason::RateLimited);
                    refused.source(retry_after);
                    src.quota_hint.set(
                        hint_generation,
                        self.clock.now(),
                        retry_after,
                        tokens.total,
                    );
                }
                // §15: room, but not for this class. Only this class is held: the
                // host's quota hint (shared by every class) stays as it was.
                Ok(Admit::ClassHeld { why, retry_after }) => {
                    reasons[pos] = Some(SkipReason::RateLimited);
                    refused.source(retry_after);
                    if let Some(c) = self.scopes[scope].class_counters.get(class) {
                        bump(match why {
                            Held::Limit => &c.held_limit,
                            Held::Reserve => &c.held_reserve,
                        });
                    }
                }
                Ok(Admit::CircuitOpen {
                    state,
                    epoch,
                    retry_after,
                }) => {
                    reasons[pos] = Some(SkipReason::CircuitOpen);
                    refused.gate_rejections += 1;
                    refused.source(retry_after);
                    self.observe(
                        scope,
                        idx,
                        Observation {
                            cooldown: retry_after,
                            ..Observation::of(state, epoch, Reason::Observed)
                        },
                    );
                    // Only an OPEN refusal has a deadline worth remembering (§9).
                    if state == State::Open && !retry_after.is_zero() {
                        {
                            let now = self.clock.now();
                            src.memo.set_until(now + retry_after, epoch, now);
                        }
                    }
                }
                // Unreachable under `fail_closed` (under `local` the backend serves
                // from memory and never says so): the call fails with that error.
                Err(e @ BackendError::Unavailable(_)) => {
                    reasons[pos] = Some(SkipReason::BackendUnavailable);
                    refused.source(Duration::ZERO);
                    refused.unavailable = Some(e.to_string());
                }
                // The store answered but rejected the operation (a bug, or a key
                // clobbered by something else): skip this source, keep the others
                // going, and say so in the log (at most every 10 s per source).
                Err(e) => {
                    reasons[pos] = Some(SkipReason::BackendUnavailable);
                    refused.source(Duration::ZERO);
                    self.log_backend_error(idx, &e);
                }
            }
        }
        Err(refused)
    }

    /// §10: on a shared backend, a memo entry is re-checked at most once per
    /// [`MEMO_RECHECK`] (`None`: not due, or not a shared backend, or the backend
    /// could not be read — trust the entry). The entry is dropped when the backend's
    /// epoch is lower than the one it was set under (the shared state was lost:
    /// FLUSHALL, a restart without persistence, failover to an empty replica) or when
    /// the source is no longer OPEN there (closed by an operator whose broadcast this
    /// host missed); a source OPEN again after a loss gets its new deadline.
    async fn recheck_memo(&self, idx: usize, now: Duration) -> Option<Memo> {
        let src = &self.sources[idx];
        if !self.backend.is_remote() || !src.memo.recheck_due(now, MEMO_RECHECK) {
            return None;
        }
        let Peek {
            state,
            epoch,
            retry_after,
        } = self.backend.peek(&src.name).await.ok()?;
        let remembered = src.memo.epoch();
        let open = state == State::Open && !retry_after.is_zero();
        if epoch < remembered {
            tracing::warn!(
                source = %src.name,
                remembered,
                epoch,
                "the shared breaker's epoch went backwards (its state was lost, or a \
                 degraded period ended): dropping this host's memo entry"
            );
        }
        if epoch < remembered || !open {
            src.memo.clear();
            self.wake_all(idx);
        }
        if open {
            let now = self.clock.now();
            src.memo.set_until(now + retry_after, epoch, now);
            Some(Memo::Skip(retry_after))
        } else {
            Some(Memo::Dropped)
        }
    }

    /// Candidate order for a pass: selector order, then this call's failed sources
    /// moved to the back (their order kept). Entries are (position in scope, source).
    fn candidates(&self, scope: usize, policy: &Policy, failed: &[usize]) -> Vec<(usize, usize)> {
        let sc = &self.scopes[scope];
        let mut order: Vec<(usize, usize)> = sc.sources.iter().copied().enumerate().collect();
        if policy.cfg.selector == Selector::Health {
            let (now, half_life) = (self.clock.now(), policy.bp.window);
            order.sort_by_cached_key(|&(pos, idx)| {
                (rank(self.sources[idx].health.score(now, half_life)), pos)
            });
        }
        if !failed.is_empty() {
            // Stable: keeps the relative order within both groups.
            order.sort_by_key(|&(_, idx)| failed.contains(&idx));
        }
        order
    }
}

/// Gates 3 + 4 for one source as one backend operation. On a remote backend it runs
/// in its own task ([`Engine::detached`]); if the Acquire was cancelled during the
/// round trip, before or after the answer came, a grant in the unread answer is given
/// back to the backend. The pacer slot is not touched there: the pass's slot guard
/// released it when the Acquire was dropped.
struct Admission {
    /// Scope of the call (its breaker parameters settle a give-back).
    scope: usize,
    /// Source index.
    source: usize,
    /// Breaker parameters of the scope's policy.
    bp: BreakerParams,
    /// Quota parameters of the source.
    qp: QuotaParams,
    /// Tokens to reserve.
    tokens: Tokens,
    /// §15: the call's class (`None`: the scope has none).
    class: Option<ClassTag>,
    /// §19: the call's tenant's ledger, charged in the same step (`None`: none).
    tenant: Option<TenantAsk>,
}

/// §19: the tenant side of an [`Admission`] (what [`TenantAdmit`] borrows).
struct TenantAsk {
    /// The tenant (`None`: the anonymous tenant, with limits).
    id: Option<Arc<str>>,
    /// Its limits now.
    params: TenantParams,
    /// What the admission charges it.
    charge: Charge,
    /// The scope's `max_tenants`.
    max_tenants: u32,
}

impl<B: Backend> Work<B> for Admission {
    type Output = BResult<Admit>;

    fn run<'a>(&'a self, engine: &'a Engine<B>) -> impl Future<Output = Self::Output> + Send + 'a {
        let name = &engine.sources[self.source].name;
        async move {
            let mut r = AdmitRequest::new(&self.bp, &self.qp, self.tokens);
            if let Some(c) = &self.class {
                r = r.class(c);
            }
            if let Some(t) = &self.tenant {
                r = r.tenant(TenantAdmit {
                    key: TenantKey {
                        scope: &engine.scopes[self.scope].name,
                        tenant: t.id.as_deref().unwrap_or(""),
                    },
                    params: &t.params,
                    charge: t.charge,
                    max_tenants: t.max_tenants,
                });
            }
            engine.backend.admit(name, r).await
        }
    }

    fn unread(&self, out: Self::Output, engine: &Engine<B>) {
        if let Ok(Admit::Admitted {
            epoch,
            is_probe,
            tenant_day,
            rate,
        }) = out
        {
            // A task's answer is dropped inside the runtime; outside one (runtime
            // teardown) nothing could run the give-back anyway.
            if tokio::runtime::Handle::try_current().is_ok() {
                let g = Hold {
                    source: self.source,
                    epoch,
                    is_probe,
                    tokens: self.tokens,
                    rate,
                    class: self.class.as_ref().map_or(0, |c| c.index),
                    ledger: self.tenant.as_ref().map(|t| LedgerHold {
                        day: tenant_day,
                        cost: t.charge.cost,
                    }),
                    tenant: self.tenant.as_ref().and_then(|t| t.id.clone()),
                };
                engine.detach(GiveBack(Settle::of_hold(engine, self.scope, &g)));
            }
        }
    }
}

/// §5 nap: `r` is a uniform random number in [0, 1).
pub(crate) fn nap(
    hint: Duration,
    poll: Duration,
    stall_window: Duration,
    stall: Duration,
    r: f64,
) -> Duration {
    let jitter = poll.mul_f64(0.5 + 0.5 * r.clamp(0.0, 1.0));
    let budget = (stall_window + poll).saturating_sub(stall);
    let wait = if hint > Duration::ZERO {
        hint + jitter
    } else {
        jitter
    };
    jitter.max(wait.min(budget))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nap_without_hint_is_jitter_in_half_to_full_poll() {
        for i in 0..=100 {
            let r = i as f64 / 100.0;
            let n = nap(Duration::ZERO, ms(50), ms(300_000), ms(0), r);
            assert!(n >= ms(25) && n <= ms(50), "{n:?}");
        }
        assert_eq!(nap(Duration::ZERO, ms(50), ms(1000), ms(0), 0.0), ms(25));
        assert_eq!(nap(Duration::ZERO, ms(50), ms(1000), ms(0), 1.0), ms(50));
    }

    #[test]
    fn nap_with_hint_sleeps_hint_plus_jitter_clamped_to_budget() {
        // Plenty of budget: hint + jitter.
        assert_eq!(nap(ms(1000), ms(50), ms(300_000), ms(0), 0.0), ms(1025));
        // Budget = stall_window − stall + poll = 10 000 − 4 000 + 50.
        assert_eq!(
            nap(ms(60_000), ms(50), ms(10_000), ms(4_000), 0.0),
            ms(6_050)
        );
        // Never below the jitter, even with no budget left.
        assert_eq!(nap(ms(60_000), ms(50), ms(10_000), ms(10_040), 1.0), ms(50));
    }
}
