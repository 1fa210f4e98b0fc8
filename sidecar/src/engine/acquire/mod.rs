//! A call's start and its Acquire (§3, §5): the budget checks, the loop of passes,
//! the §5 dispatch after a pass that granted nothing, and the grant. How the
//! Acquire waits between passes (the quota line's poller and followers, the §15
//! napper and turns, their cost rule) is described and implemented in [`wait`].
//!
//! Cancel-safety: dropping the Acquire future at any await ends the wait and leaves
//! nothing reserved. The guards here carry that: [`AcquireGuard`] clears the call's
//! `acquiring` flag, [`WaiterGuard`] the scope's waiter count, and a [`Ticket`] gives
//! a pass's hold back unless it became a permit (no await between the two).

mod wait;

use std::pin::pin;
use std::time::Duration;

use super::error::{EngineError, Exhaustion, SkipReason};
use super::queue::{size_class, Spot};
use super::report::{Abandon, GiveBack, Settle};
use super::runtime::bump;
use super::tables::{Hold, OwnerId, PermitRec};
use super::CallEst;
use super::{Engine, Grant};
use crate::backend::Backend;
use crate::config::Mode;
use crate::gate::pacer::Signal;
use wait::{ended, nap_in, stall_edge, WaitTimer, WaiterGuard};

impl<B: Backend> Engine<B> {
    /// Start a call in `scope` (its default priority class); the stall clock
    /// starts now.
    pub fn begin_call(
        &self,
        owner: OwnerId,
        scope: &str,
        est: impl Into<CallEst>,
    ) -> Result<u64, EngineError> {
        self.begin_call_as(owner, scope, est, None)
    }

    /// Start a call in `scope` of priority class `priority` (§15; `None`: the
    /// scope's `default_priority`). A class the scope does not declare is
    /// [`EngineError::UnknownPriority`], naming the scope's classes.
    pub fn begin_call_as(
        &self,
        owner: OwnerId,
        scope: &str,
        est: impl Into<CallEst>,
        priority: Option<&str>,
    ) -> Result<u64, EngineError> {
        let est = est.into();
        let si = *self
            .scope_index
            .get(scope)
            .ok_or_else(|| EngineError::UnknownScope {
                scope: crate::limits::echo(scope).into_owned(),
                known: self.scopes.iter().map(|s| s.name.clone()).collect(),
            })?;
        let sc = &self.scopes[si];
        let class = match priority {
            None => sc.with_policy(|p| p.cfg.default_priority),
            Some(p) => sc
                .class_names
                .iter()
                .position(|c| &**c == p)
                .ok_or_else(|| EngineError::UnknownPriority {
                    scope: scope.to_string(),
                    priority: crate::limits::echo(p).into_owned(),
                    classes: sc.class_names.iter().map(|c| c.to_string()).collect(),
                })?,
        };
        let now = self.clock.now();
        self.lock().begin(owner, si, est, class, now)
    }

    /// Run admission for the call (§4–§5); may wait. Cancel-safe: dropping the future
    /// ends the wait and leaves nothing reserved.
    pub async fn acquire(&self, owner: OwnerId, call: u64) -> Result<Grant, EngineError> {
        self.acquire_or_wait(owner, call, || {}).await
    }

    /// [`Engine::acquire`], calling `on_wait` once, the first time the Acquire goes
    /// to sleep waiting for a source (not for a backend round trip). The server uses
    /// it to stop counting a waiting Acquire against the connection's in-flight cap.
    pub async fn acquire_or_wait(
        &self,
        owner: OwnerId,
        call: u64,
        on_wait: impl FnOnce(),
    ) -> Result<Grant, EngineError> {
        let r = self.acquire_inner(owner, call, on_wait).await;
        if let Err(e) = &r {
            self.count_error(e, call);
        }
        r
    }

    async fn acquire_inner(
        &self,
        owner: OwnerId,
        call: u64,
        on_wait: impl FnOnce(),
    ) -> Result<Grant, EngineError> {
        let mut on_wait = Some(on_wait);
        if self.shutdown.is_cancelled() {
            return Err(EngineError::ShuttingDown);
        }
        let (si, class) = self.lock().start_acquire(owner, call)?;
        let _acquiring = AcquireGuard { engine: self, call };
        let sc = &self.scopes[si];
        let _timer = WaitTimer {
            hist: &sc.counters.wait,
            clock: &*self.clock,
            started: self.clock.now(),
        };
        let scope_name = || sc.name.clone();
        let mut reasons: Vec<Option<SkipReason>> = vec![None; sc.sources.len()];
        let mut waiting: Option<WaiterGuard<'_>> = None;
        let mut failed = Vec::new();
        let mut first = true;
        // §15: a classed scope's waiters take turns in fair order; this Acquire's
        // place (it leaves, passing any turn on, however the Acquire ends). Without
        // classes every Acquire passes whenever it wakes, as it always did.
        let place = sc.queue.as_ref().map(|q| q.join(class));
        let mut my_turn = place.as_ref().is_none_or(|p| p.arrive());
        // §6 retry-after of the last pass, for a stall found between passes.
        let mut last_retry_after: Option<Duration> = None;
        // §5 quota line (scopes without classes): this Acquire's spot once a pass
        // of it was refused by quota or pacer; it leaves (handing any poller turn
        // on) however the Acquire ends.
        let mut spot: Option<Spot<'_>> = None;
        loop {
            // Register for early wake-ups before looking, so none is missed. An
            // Option, so a quota follower can leave the scope's channel (a wake-up
            // it would sit on is passed on to the next registered waiter).
            let mut notified = pin!(Some(sc.notify.notified()));
            if let Some(n) = notified.as_mut().as_pin_mut() {
                n.enable();
            }
            // Read per pass: a SIGHUP reload applies to calls already waiting.
            let policy = sc.policy();
            let cfg = &policy.cfg;

            let budget = self.lock().budget(call, self.clock.now(), &mut failed)?;
            // §5: the budgets are checked once, before the first pass; after a nap the
            // pass the nap was timed for always runs (the post-pass stall check below
            // ends the call if that pass grants nothing).
            let check_budgets = std::mem::take(&mut first);
            if check_budgets && budget.attempts >= cfg.max_attempts {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::RetryExhausted,
                    retry_after: Duration::ZERO,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            if check_budgets && budget.stall > cfg.stall_window {
                // No pass ran in this Acquire: what this host knows without asking.
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::Stalled,
                    retry_after: self.known_retry_after(si, &policy, budget.est),
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            if check_budgets && place.is_none() && self.quota_lines[si].has_members() {
                // §5 no barging: the scope has quota waiters, so this new Acquire
                // joins the line behind them instead of taking capacity freed for
                // them; it runs its first pass when its size line makes it poller
                // (at once if its size line was empty).
                let s = self.quota_lines[si].join(self.size_class_of(si, budget.est));
                let follower = !s.is_poller();
                spot = Some(s);
                if follower {
                    let edge = stall_edge(cfg, budget.stall);
                    if let Some(f) = on_wait.take() {
                        f();
                    }
                    waiting = Some(self.start_waiting(si, class, call, edge, &reasons)?);
                    notified.set(None);
                    let s = spot.as_ref().expect("just set");
                    tokio::select! {
                        _ = s.woken() => {}
                        _ = tokio::time::sleep(edge) => {}
                        _ = self.shutdown.cancelled() => return Err(EngineError::ShuttingDown),
                        _ = ended(&waiting) => return Err(EngineError::CallEnded(call)),
                    }
                    continue;
                }
            }
            if !my_turn {
                // Not this waiter's turn (it went to the one fair order put first):
                // no pass, only the stall budget, then nap on.
                let stall = self.lock().stall(call, self.clock.now())?;
                if stall > cfg.stall_window {
                    return Err(EngineError::Exhausted {
                        scope: scope_name(),
                        reason: Exhaustion::Stalled,
                        retry_after: last_retry_after
                            .unwrap_or_else(|| self.known_retry_after(si, &policy, budget.est)),
                        reasons: self.reasons_of(si, &reasons),
                    });
                }
                // One waiter naps and asks again for everyone; the others sleep
                // until handed a turn or to the edge of their stall window.
                let napper = place.as_ref().is_some_and(|p| p.napping());
                let sleep = if napper {
                    nap_in(cfg, Duration::ZERO, stall)
                } else {
                    stall_edge(cfg, stall)
                };
                if waiting.is_none() {
                    if let Some(f) = on_wait.take() {
                        f();
                    }
                    waiting = Some(self.start_waiting(si, class, call, sleep, &reasons)?);
                }
                my_turn = self
                    .wait_turn(place.as_ref(), sleep, &waiting, call)
                    .await?;
                continue;
            }
            let refused = match self
                .pass(si, &policy, &failed, budget.est, class, &mut reasons)
                .await
            {
                Ok(hold) => {
                    let ticket = Ticket {
                        engine: self,
                        scope: si,
                        hold: Some(hold),
                    };
                    let (grant, stale) = self.record_grant(owner, call, ticket)?;
                    if let Some(p) = place {
                        p.granted();
                        bump(&sc.class_counters[class].grants);
                    }
                    // No await before returning: a Cancel now cannot strand the grant.
                    for p in stale {
                        let cls = self.class_name(p.scope, p.class);
                        self.sources[p.source]
                            .pacer
                            .release_as(Signal::Hold, cls.as_deref());
                        bump(&self.sources[p.source].counters.abandoned);
                        self.detach(Abandon(p));
                    }
                    return Ok(grant);
                }
                Err(refused) => refused,
            };
            if let Some(message) = refused.unavailable {
                return Err(EngineError::BackendUnavailable {
                    scope: Some(scope_name()),
                    message,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            // §5 dispatch. `retry_after` is §6's for whichever error ends the call
            // here: the min over the sources of when each would certainly pass.
            let retry_after = refused.retry_after();
            let quota_wait = refused.gate_rejections != sc.sources.len();
            if !quota_wait {
                // §5: refused only for circuit reasons, it leaves the quota line (the
                // next takes the poller turn): it must not hold up the waiters
                // behind it, who may fit where it cannot.
                spot = None;
            }
            let hint = if !quota_wait {
                // Every source refused for circuit reasons: the min is the breakers'.
                if cfg.circuit_open == Mode::FailFast {
                    return Err(EngineError::CircuitOpen {
                        scope: scope_name(),
                        retry_after,
                        reasons: self.reasons_of(si, &reasons),
                    });
                }
                retry_after
            } else {
                if cfg.quota_full == Mode::FailFast {
                    return Err(EngineError::Exhausted {
                        scope: scope_name(),
                        reason: Exhaustion::QuotaExhausted,
                        retry_after,
                        reasons: self.reasons_of(si, &reasons),
                    });
                }
                Duration::ZERO // §5: the quota wait polls with plain jitter
            };
            let stall = self.lock().stall(call, self.clock.now())?;
            if stall > cfg.stall_window {
                return Err(EngineError::Exhausted {
                    scope: scope_name(),
                    reason: Exhaustion::Stalled,
                    retry_after,
                    reasons: self.reasons_of(si, &reasons),
                });
            }
            last_retry_after = Some(retry_after);
            if place.as_ref().is_some_and(|p| p.retry_now()) {
                continue; // capacity freed while this pass looked: look again
            }
            let sleep = nap_in(cfg, hint, stall);
            if waiting.is_none() {
                if let Some(f) = on_wait.take() {
                    f();
                }
                waiting = Some(self.start_waiting(si, class, call, sleep, &reasons)?);
            }
            if let Some(p) = &place {
                // §15 queue: only its napper keeps the §5 nap; the others sleep
                // until handed a turn or to their stall edge (see the header).
                let sleep = if p.napping() {
                    sleep
                } else {
                    stall_edge(cfg, stall)
                };
                my_turn = self
                    .wait_turn(place.as_ref(), sleep, &waiting, call)
                    .await?;
                continue;
            }
            if quota_wait && spot.is_none() {
                let size = self.size_class_of(si, budget.est);
                spot = Some(self.quota_lines[si].join(size));
            }
            match &spot {
                // A follower: no polling. It sleeps until it is made poller or
                // nudged, or to the edge of its stall window (the pass then run
                // ends it as stalled, §5's bound kept).
                Some(s) if !s.is_poller() => {
                    notified.set(None);
                    let edge = stall_edge(cfg, stall);
                    tokio::select! {
                        _ = s.woken() => {}
                        _ = tokio::time::sleep(edge) => {}
                        _ = self.shutdown.cancelled() => return Err(EngineError::ShuttingDown),
                        _ = ended(&waiting) => return Err(EngineError::CallEnded(call)),
                    }
                }
                // The poller (or a call not in the quota wait): nap as §5 says.
                _ => {
                    let turn = async {
                        match &spot {
                            Some(s) => s.woken().await,
                            None => std::future::pending().await,
                        }
                    };
                    let notified = async {
                        if let Some(n) = notified.as_mut().as_pin_mut() {
                            n.await
                        }
                    };
                    tokio::select! {
                        _ = tokio::time::sleep(sleep) => {}
                        _ = notified => {}
                        _ = turn => {}
                        _ = self.shutdown.cancelled() => return Err(EngineError::ShuttingDown),
                        _ = ended(&waiting) => return Err(EngineError::CallEnded(call)),
                    }
                }
            }
        }
    }

    /// §5 quota line: the size class of a call's estimate, the largest over the
    /// scope's sources (their defaults may differ when the call gives none).
    fn size_class_of(&self, scope: usize, est: CallEst) -> u32 {
        let tokens = self.scopes[scope]
            .sources
            .iter()
            .map(|&i| self.sources[i].params().estimate(est).total)
            .max()
            .unwrap_or(0);
        size_class(tokens)
    }

    /// §6 retry-after from host-local knowledge alone, for a call that ends before
    /// any pass: min over the scope's sources of the memo's remainder, else the
    /// quota hint's wait for this call's estimate, else 0 (nothing known: now).
    fn known_retry_after(
        &self,
        scope: usize,
        policy: &super::runtime::Policy,
        est: CallEst,
    ) -> Duration {
        let now = self.clock.now();
        self.scopes[scope]
            .sources
            .iter()
            .map(|&idx| {
                let src = &self.sources[idx];
                let memo = src.memo.remaining(now);
                if !memo.is_zero() {
                    return memo;
                }
                let tokens = src.params().estimate(est).total;
                src.quota_hint
                    .wait(now, tokens, policy.cfg.poll_interval)
                    .unwrap_or(Duration::ZERO)
            })
            .min()
            .unwrap_or(Duration::ZERO)
    }

    /// The skip reasons of a scope's sources by name, config order.
    fn reasons_of(
        &self,
        scope: usize,
        reasons: &[Option<SkipReason>],
    ) -> Vec<(String, SkipReason)> {
        self.scopes[scope]
            .sources
            .iter()
            .zip(reasons)
            .filter_map(|(&idx, r)| r.map(|r| (self.sources[idx].name.to_string(), r)))
            .collect()
    }

    /// Count an Acquire that ended in a gateway error (grants are counted in
    /// `record_grant`, which knows the source's index).
    fn count_error(&self, e: &EngineError, call: u64) {
        let scope = match e {
            EngineError::CircuitOpen { scope, .. }
            | EngineError::Exhausted { scope, .. }
            | EngineError::BackendUnavailable {
                scope: Some(scope), ..
            } => scope,
            _ => return,
        };
        let Some(&si) = self.scope_index.get(scope) else {
            return;
        };
        let c = &self.scopes[si].counters;
        bump(c.errors.of(e));
        // §15: the same by class (a lookup only on this error path).
        let classes = &self.scopes[si].class_counters;
        if classes.is_empty() {
            return;
        }
        let Some(c) = self.lock().class_of(call).and_then(|i| classes.get(i)) else {
            return;
        };
        bump(c.errors.of(e));
    }

    /// Turn a pass's hold into a permit of the call (or give it back if the call
    /// ended meanwhile). A new probe means the breaker saw the previous probe's lease
    /// expire: any older probe permit of the source still held here is returned for
    /// reclaiming at once, so this host never holds two probes of one source (the
    /// periodic reclaim could otherwise lag the lease by up to its period).
    fn record_grant(
        &self,
        owner: OwnerId,
        call: u64,
        mut ticket: Ticket<'_, B>,
    ) -> Result<(Grant, Vec<PermitRec>), EngineError> {
        let g = ticket.hold.expect("ticket armed");
        let src = &self.sources[g.source];
        let now = self.clock.now();
        let mut t = self.lock();
        let Some((permit, attempt)) = t.grant(owner, call, &g, now, src.params().lease) else {
            drop(t);
            return Err(EngineError::UnknownCall(call)); // ticket drop gives it back
        };
        let stale = if g.is_probe {
            let ids = t.other_probes(g.source, permit);
            t.detach(&ids, now)
        } else {
            Vec::new()
        };
        drop(t);
        ticket.hold = None;
        bump(&src.counters.grants);
        if g.is_probe {
            bump(&src.counters.probes);
        }
        let grant = Grant {
            permit,
            source: src.name.clone(),
            is_probe: g.is_probe,
            attempt,
            est_tokens: g.tokens.total,
        };
        Ok((grant, stale))
    }

    /// Give back a hold that never became a permit: nothing was sent.
    fn give_back(&self, scope: usize, g: Hold) {
        let cls = self.class_name(scope, g.class);
        self.sources[g.source]
            .pacer
            .release_as(Signal::Hold, cls.as_deref());
        self.detach(GiveBack(Settle::of_hold(self, scope, &g)));
        self.wake_one(g.source);
    }
}

/// Clears a call's `acquiring` flag when the Acquire ends, however it ends.
struct AcquireGuard<'a, B: Backend> {
    /// The engine holding the call.
    engine: &'a Engine<B>,
    /// The call whose Acquire this is.
    call: u64,
}

impl<B: Backend> Drop for AcquireGuard<'_, B> {
    fn drop(&mut self) {
        self.engine.lock().end_acquire(self.call);
    }
}

/// A pass's [`Hold`] not yet turned into a permit. Dropping it unrecorded (cancelled
/// Acquire, call ended meanwhile) gives everything back: nothing was sent upstream.
struct Ticket<'a, B: Backend> {
    /// The engine that made the grant.
    engine: &'a Engine<B>,
    /// Scope of the call (its breaker parameters settle the give-back).
    scope: usize,
    /// What the pass holds; `None` once it became a permit.
    hold: Option<Hold>,
}

impl<B: Backend> Drop for Ticket<'_, B> {
    fn drop(&mut self) {
        if let Some(h) = self.hold.take() {
            self.engine.give_back(self.scope, h);
        }
    }
}
