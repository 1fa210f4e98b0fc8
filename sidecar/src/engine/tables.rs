//! Call and permit bookkeeping (§3, §12): who holds which call and permit, each
//! call's attempts, stall clock and failed sources. Plain synchronous data behind the
//! engine's one short-held lock: no await, no backend, no gate; the engine modules do
//! the rest around these steps.

// foldhash: these maps are keyed by our own ids and config names (nothing a peer
// inserts), and SipHash was ~1.5 % of the per-frame CPU (§16).
use foldhash::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::error::EngineError;
use super::CallEst;
use crate::gate::quota::{AdmittedRate, Tokens};
use crate::gate::Outcome;

/// Identifies who holds calls and permits (one per connection in the daemon).
pub type OwnerId = u64;

/// Most live calls one owner (connection) may hold: a client that begins calls and
/// never ends them must not grow the daemon without bound.
pub const MAX_CALLS_PER_OWNER: u32 = 10_000;

/// A live call.
#[derive(Debug)]
pub(crate) struct CallRec {
    /// Who may use it.
    owner: OwnerId,
    /// Scope index.
    pub(crate) scope: usize,
    /// The call's own estimates.
    est: CallEst,
    /// Attempts granted so far (a cancelled attempt gives its attempt back).
    attempts: u32,
    /// Sources that failed in this call (call-local demotion), in failure order.
    failed: Vec<usize>,
    /// Stalled time accumulated before `stalled_since`.
    stalled: Duration,
    /// Since when the call is stalled; `None` while an attempt runs.
    stalled_since: Option<Duration>,
    /// An Acquire of this call is running.
    acquiring: bool,
    /// The call's unreported permit.
    permit: Option<u64>,
    /// §15: index of the call's priority class in its scope (0 without classes).
    pub(crate) class: usize,
    /// §12: set while an Acquire of the call sleeps (never on the no-wait path):
    /// `EndCall` wakes it so the wait ends at once with an error.
    ended: Option<Arc<Notify>>,
    /// §19: the call's tenant (interned by the scope's book); `None`: anonymous, or
    /// a scope without tenants.
    pub(crate) tenant: Option<Arc<str>>,
}

impl CallRec {
    /// The stall clock at `now` (§3).
    fn stall(&self, now: Duration) -> Duration {
        self.stalled
            + self
                .stalled_since
                .map_or(Duration::ZERO, |s| now.saturating_sub(s))
    }
}

/// §19: what a grant charged its tenant's ledger (`None` in [`Hold::ledger`]: no
/// ledger was charged: an unlimited tenant, or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LedgerHold {
    /// The day number the backend charged the cost to.
    pub(crate) day: u32,
    /// The estimated cost charged, n$.
    pub(crate) cost: u64,
}

/// A live permit.
#[derive(Debug, Clone)]
pub(crate) struct PermitRec {
    /// Who may report it.
    pub(crate) owner: OwnerId,
    /// Its call.
    pub(crate) call: u64,
    /// Scope index of the call.
    pub(crate) scope: usize,
    /// Source index.
    pub(crate) source: usize,
    /// Breaker epoch of the grant.
    pub(crate) epoch: u64,
    /// Holds the probe lease.
    pub(crate) is_probe: bool,
    /// Tokens reserved.
    pub(crate) tokens: Tokens,
    /// §18 `learn_rate`: the learned factor they were reserved at and the last cut
    /// then (the report settles at it, and its 429 cuts only under that cut).
    pub(crate) rate: AdmittedRate,
    /// §15: the call's priority class (its share of the source settles with it).
    pub(crate) class: usize,
    /// When granted (latency for health).
    pub(crate) granted_at: Duration,
    /// When it is reclaimed if never reported.
    pub(crate) expires: Duration,
    /// §19: its call's tenant (the report settles its book and fair-turn counter,
    /// also after the call ended).
    pub(crate) tenant: Option<Arc<str>>,
    /// §19: what its grant charged the tenant's ledger.
    pub(crate) ledger: Option<LedgerHold>,
}

/// What a pass admitted and the Acquire has not yet recorded as a permit: a source
/// whose pacer slot, quota reservation and (for a probe) breaker lease are held for
/// the call. Recorded by [`Tables::grant`], or given back.
#[derive(Debug, Clone)]
pub(crate) struct Hold {
    /// Source index (engine-wide).
    pub(crate) source: usize,
    /// Breaker epoch of the grant.
    pub(crate) epoch: u64,
    /// The grant is the probe.
    pub(crate) is_probe: bool,
    /// Tokens reserved.
    pub(crate) tokens: Tokens,
    /// §18 `learn_rate`: the learned factor they were reserved at, the last cut then.
    pub(crate) rate: AdmittedRate,
    /// §15: the call's priority class in its scope (0 without classes).
    pub(crate) class: usize,
    /// §19: what the grant charged the call's tenant's ledger.
    pub(crate) ledger: Option<LedgerHold>,
    /// §19: the call's tenant (a give-back settles its ledger).
    pub(crate) tenant: Option<Arc<str>>,
}

/// What an Acquire needs to know about its call before a pass.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    /// Attempts granted so far.
    pub(crate) attempts: u32,
    /// The stall clock now.
    pub(crate) stall: Duration,
    /// The call's own estimates.
    pub(crate) est: CallEst,
}

/// §19: a call that ended: its scope and tenant (the book counts its calls).
pub(crate) type Ended = (usize, Option<Arc<str>>);

/// Calls and permits, under one short-held lock.
#[derive(Debug, Default)]
pub(crate) struct Tables {
    /// Live calls by id.
    calls: HashMap<u64, CallRec>,
    /// Live calls per owner (for the cap).
    owner_calls: HashMap<OwnerId, u32>,
    /// Live permits by id.
    permits: HashMap<u64, PermitRec>,
}

/// Counts for invariant checks in tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveCounts {
    /// Live calls.
    pub calls: usize,
    /// Live permits.
    pub permits: usize,
    /// Live permits holding a probe lease.
    pub probes: usize,
    /// Sum of pacer in-flight over all sources.
    pub pacer_in_flight: u32,
    /// Tokens reserved by live permits.
    pub reserved_tokens: u64,
    /// The most live probe permits any one source has (must never exceed 1).
    pub max_probes_per_source: usize,
}

/// A fresh id, nonzero and not live in `taken`.
fn fresh_id<V>(taken: &HashMap<u64, V>) -> u64 {
    loop {
        let id: u64 = rand::random();
        if id != 0 && !taken.contains_key(&id) {
            return id;
        }
    }
}

impl Tables {
    /// A new call of `owner` in scope `scope`; its stall clock starts at `now`.
    pub(crate) fn begin(
        &mut self,
        owner: OwnerId,
        scope: usize,
        est: CallEst,
        class: usize,
        tenant: Option<Arc<str>>,
        now: Duration,
    ) -> Result<u64, EngineError> {
        let n = self.owner_calls.entry(owner).or_insert(0);
        if *n >= MAX_CALLS_PER_OWNER {
            return Err(EngineError::InvalidArgument(format!(
                "this connection already holds {MAX_CALLS_PER_OWNER} live calls (the limit); \
                 end calls (EndCall) before beginning more"
            )));
        }
        *n += 1;
        let id = fresh_id(&self.calls);
        self.calls.insert(
            id,
            CallRec {
                owner,
                scope,
                est,
                attempts: 0,
                failed: Vec::new(),
                stalled: Duration::ZERO,
                stalled_since: Some(now),
                acquiring: false,
                permit: None,
                class,
                ended: None,
                tenant,
            },
        );
        Ok(id)
    }

    /// Mark an Acquire of `owner`'s `call` as running; returns the call's scope, class
    /// and tenant. One Acquire at a time, and none while the call holds an unreported
    /// permit.
    pub(crate) fn start_acquire(
        &mut self,
        owner: OwnerId,
        call: u64,
    ) -> Result<(usize, usize, Option<Arc<str>>), EngineError> {
        let c = self
            .calls
            .get_mut(&call)
            .filter(|c| c.owner == owner)
            .ok_or(EngineError::UnknownCall(call))?;
        if c.acquiring || c.permit.is_some() {
            return Err(EngineError::Busy(call));
        }
        c.acquiring = true;
        Ok((c.scope, c.class, c.tenant.clone()))
    }

    /// §15: the call's class, if the call still exists.
    pub(crate) fn class_of(&self, call: u64) -> Option<usize> {
        self.calls.get(&call).map(|c| c.class)
    }

    /// The Acquire of `call` ended (if the call still exists).
    pub(crate) fn end_acquire(&mut self, call: u64) {
        if let Some(c) = self.calls.get_mut(&call) {
            c.acquiring = false;
            c.ended = None;
        }
    }

    /// §12: the Acquire of `call` goes to sleep; `EndCall` will wake `ended`.
    /// [`EngineError::CallEnded`] when the call is already gone.
    pub(crate) fn watch_end(&mut self, call: u64, ended: Arc<Notify>) -> Result<(), EngineError> {
        let c = self
            .calls
            .get_mut(&call)
            .ok_or(EngineError::CallEnded(call))?;
        c.ended = Some(ended);
        Ok(())
    }

    /// The call's budgets at `now`; its failed sources are copied into `failed`.
    pub(crate) fn budget(
        &self,
        call: u64,
        now: Duration,
        failed: &mut Vec<usize>,
    ) -> Result<Budget, EngineError> {
        let c = self
            .calls
            .get(&call)
            .ok_or(EngineError::UnknownCall(call))?;
        failed.clone_from(&c.failed);
        Ok(Budget {
            attempts: c.attempts,
            stall: c.stall(now),
            est: c.est,
        })
    }

    /// The call's stall clock at `now`.
    pub(crate) fn stall(&self, call: u64, now: Duration) -> Result<Duration, EngineError> {
        Ok(self
            .calls
            .get(&call)
            .ok_or(EngineError::UnknownCall(call))?
            .stall(now))
    }

    /// Record the hold `g` as a new permit of `owner`'s `call`, granted at `now` with a lease
    /// of `lease` (one more attempt; the stall clock stops). `None` when the call
    /// ended meanwhile: nothing is recorded. Returns the permit id and the attempt.
    pub(crate) fn grant(
        &mut self,
        owner: OwnerId,
        call: u64,
        g: &Hold,
        now: Duration,
        lease: Duration,
    ) -> Option<(u64, u32)> {
        let permit = fresh_id(&self.permits);
        let c = self.calls.get_mut(&call)?;
        c.attempts += 1;
        c.permit = Some(permit);
        c.stalled = c.stall(now);
        c.stalled_since = None;
        let attempt = c.attempts;
        let scope = c.scope;
        let tenant = c.tenant.clone();
        self.permits.insert(
            permit,
            PermitRec {
                owner,
                call,
                scope,
                source: g.source,
                epoch: g.epoch,
                is_probe: g.is_probe,
                tokens: g.tokens,
                rate: g.rate,
                class: g.class,
                granted_at: now,
                expires: now + lease,
                tenant,
                ledger: g.ledger,
            },
        );
        Some((permit, attempt))
    }

    /// Ids of the live probe permits of `source` other than `except`.
    pub(crate) fn other_probes(&self, source: usize, except: u64) -> Vec<u64> {
        self.permits
            .iter()
            .filter(|(&id, p)| id != except && p.is_probe && p.source == source)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Take `owner`'s `permit` out for its report: the call's stall clock runs again,
    /// a failed, rate-limited or unusable source is demoted for the rest of the call, and a
    /// cancelled attempt (nothing was sent) is given back.
    pub(crate) fn take_reported(
        &mut self,
        owner: OwnerId,
        permit: u64,
        outcome: &Outcome,
        now: Duration,
    ) -> Result<PermitRec, EngineError> {
        if self.permits.get(&permit).is_none_or(|p| p.owner != owner) {
            return Err(EngineError::UnknownPermit(permit));
        }
        let p = self.permits.remove(&permit).expect("checked");
        if let Some(c) = self.calls.get_mut(&p.call) {
            c.permit = None;
            c.stalled_since = Some(now);
            match outcome {
                // A failure, a 429 or an unusable answer (§4: a `count_attempt =
                // false` success counts as a failure for selection): the source goes
                // to the back for the rest of the call.
                Outcome::Failure { .. }
                | Outcome::RateLimited { .. }
                | Outcome::Success {
                    count_attempt: false,
                    ..
                } => {
                    if !c.failed.contains(&p.source) {
                        c.failed.push(p.source);
                    }
                }
                // Nothing was sent: the attempt is given back.
                Outcome::Cancelled => c.attempts = c.attempts.saturating_sub(1),
                Outcome::Success { .. } => {}
            }
        }
        Ok(p)
    }

    /// Forget `owner`'s `call`; returns its unreported permit, if any, and (§19) its
    /// scope and tenant.
    pub(crate) fn end_call(
        &mut self,
        owner: OwnerId,
        call: u64,
    ) -> Result<(Option<PermitRec>, Ended), EngineError> {
        if self.calls.get(&call).is_none_or(|c| c.owner != owner) {
            return Err(EngineError::UnknownCall(call));
        }
        let c = self.calls.remove(&call).expect("checked");
        if let Some(n) = self.owner_calls.get_mut(&owner) {
            *n = n.saturating_sub(1);
        }
        // §12: a sleeping Acquire of the call ends now (a stored permit if it is
        // between two sleeps: it sees it at its next one).
        if let Some(ended) = &c.ended {
            ended.notify_one();
        }
        let permit = c.permit.and_then(|id| self.permits.remove(&id));
        Ok((permit, (c.scope, c.tenant)))
    }

    /// `owner` holds an unreported permit.
    pub(crate) fn holds_permit(&self, owner: OwnerId) -> bool {
        self.permits.values().any(|p| p.owner == owner)
    }

    /// `owner` has a live call (the idle timeout leaves such a connection open).
    pub(crate) fn holds_call(&self, owner: OwnerId) -> bool {
        self.owner_calls.get(&owner).is_some_and(|&n| n > 0)
    }

    /// Forget every call of `owner`; returns its permits and (§19) the scope and
    /// tenant of every call forgotten.
    pub(crate) fn release_owner(&mut self, owner: OwnerId) -> (Vec<PermitRec>, Vec<Ended>) {
        let mut ended = Vec::new();
        self.calls.retain(|_, c| {
            let keep = c.owner != owner;
            if !keep && c.tenant.is_some() {
                ended.push((c.scope, c.tenant.take()));
            }
            keep
        });
        self.owner_calls.remove(&owner);
        let ids: Vec<u64> = self
            .permits
            .iter()
            .filter(|(_, p)| p.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        let permits = ids
            .iter()
            .filter_map(|id| self.permits.remove(id))
            .collect();
        (permits, ended)
    }

    /// Take permits out as reclaimed: their calls go on (the attempt counted, stall
    /// clock running again from `now`); the caller must abandon them.
    pub(crate) fn detach(&mut self, ids: &[u64], now: Duration) -> Vec<PermitRec> {
        let ps: Vec<PermitRec> = ids
            .iter()
            .filter_map(|id| self.permits.remove(id))
            .collect();
        for p in &ps {
            if let Some(c) = self.calls.get_mut(&p.call) {
                c.permit = None;
                c.stalled_since = Some(now);
            }
        }
        ps
    }

    /// Ids of the permits whose lease ended by `now`.
    pub(crate) fn expired(&self, now: Duration) -> Vec<u64> {
        self.permits
            .iter()
            .filter(|(_, p)| p.expires <= now)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Live calls per scope index, for `n` scopes.
    pub(crate) fn calls_per_scope(&self, n: usize) -> Vec<u32> {
        let mut v = vec![0u32; n];
        for c in self.calls.values() {
            v[c.scope] += 1;
        }
        v
    }

    /// Counts over `sources` sources (pacer in-flight is the caller's to fill in).
    pub(crate) fn live_counts(&self, sources: usize) -> LiveCounts {
        LiveCounts {
            calls: self.calls.len(),
            permits: self.permits.len(),
            probes: self.permits.values().filter(|p| p.is_probe).count(),
            pacer_in_flight: 0,
            reserved_tokens: self.permits.values().map(|p| p.tokens.total).sum(),
            max_probes_per_source: (0..sources)
                .map(|s| {
                    self.permits
                        .values()
                        .filter(|p| p.is_probe && p.source == s)
                        .count()
                })
                .max()
                .unwrap_or(0),
        }
    }

    /// The earliest lease expiry among live permits.
    pub(crate) fn oldest_expiry(&self) -> Option<Duration> {
        self.permits.values().map(|p| p.expires).min()
    }
}
