//! The quota gate (§7, §7a): continuously refilled buckets per source (tokens,
//! requests, input and output tokens per minute; tokens and requests per day) and a
//! 429 block. Plain data; `now` is passed in. The Redis
//! backend implements the same rules in `gate.lua` (see `backend/mod.rs`).
//!
//! This module holds one source's state ([`Quota`]) and its operations (wait,
//! reserve, settle, block, view); the rest is split by concept, each re-exported
//! here so every path stays `gate::quota::…`:
//!
//! - `bucket`: the kinds of bucket ([`BUCKETS`]), a configured bucket's numbers
//!   ([`Shape`], §7a) and one bucket's state as a time (the arithmetic).
//! - `params`: the quota's vocabulary ([`QuotaParams`], [`Tokens`], [`Reserve`],
//!   [`Settlement`], [`Credits`]): every backend speaks it, and none of it depends
//!   on a backend.
//! - `observe`: §18, in-flight counts, observations and `"auto"` limits.
//! - `share`: §10, a degraded host's share and the drain.
//! - `learn`: §18 `learn_rate = "aimd"`, the rate learned from the 429s.

mod bucket;
pub mod learn;
mod observe;
mod params;
mod share;

use std::time::Duration;

use bucket::Level;
pub use bucket::{Bucket, Counts, Shape, BUCKETS, DAY, MINUTE};
pub use learn::{AdmittedRate, SeenCut};
pub use observe::UNLEARNED_WAIT;
pub use params::{
    Credits, QuotaParams, Reserve, Settlement, Split, Tokens, DEFAULT_MAX_DEBT, PPM_WHOLE,
};

use super::observed::Seen;

/// The longest 429 block any backend keeps (7 days; `gate.lua`'s `QMAX_BLOCK`). The
/// engine already cuts a 429's `retry_after` to `max_rate_limit_block` (§7, default
/// 10 min); this only bounds a backend driven directly.
pub const MAX_QUOTA_BLOCK: Duration = Duration::from_secs(7 * 24 * 3600);

/// One source's quota state.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    /// One slot per entry of [`BUCKETS`]; a bucket never used (or disabled) is
    /// `None` and reads as full.
    buckets: [Option<Level>; 6],
    /// A 429 `retry_after` blocks reservations until then.
    blocked_until: Duration,
    /// §18: in-flight counts and observations, for a source that observes (boxed:
    /// the others never allocate it).
    seen: Option<Box<Seen>>,
    /// §18 `learn_rate`: the factor learned from the 429s (`None`: whole).
    rate: Option<learn::LearnedRate>,
}

/// Quota levels for status, one per entry of [`BUCKETS`] (`None`: not configured).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuotaView {
    /// Each bucket's level (negative: debt).
    pub levels: [Option<f64>; 6],
    /// Remaining block.
    pub blocked: Duration,
}

impl QuotaView {
    /// Token level (negative: debt).
    pub fn tokens(&self) -> Option<f64> {
        self.levels[Bucket::Tpm as usize]
    }

    /// Request level.
    pub fn requests(&self) -> Option<f64> {
        self.levels[Bucket::Rpm as usize]
    }

    /// §6: the time until a reservation `t` fits buckets at these levels and the
    /// block is over (status shows it; zero = now).
    pub fn wait(&self, q: &QuotaParams, t: Tokens) -> Duration {
        let mut wait = self.blocked;
        for ((b, counts, _), level) in BUCKETS.into_iter().zip(self.levels) {
            if let (Some(s), Some(level)) = (q.shape(b), level) {
                let need = counts.amount(t).min(s.capacity) as f64;
                if level < need {
                    let secs = (need - level) / s.refill_per_s();
                    wait = wait.max(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX));
                }
            }
        }
        wait
    }
}

impl Quota {
    /// Full buckets, no block.
    pub fn new() -> Self {
        Quota {
            buckets: [None; 6],
            blocked_until: Duration::ZERO,
            seen: None,
            rate: None,
        }
    }

    /// §6/§7: the time until a reservation `t` certainly fits (the longest wait
    /// over the buckets and the block); zero = now.
    pub fn wait(&self, q: &QuotaParams, t: impl Into<Tokens>, now: Duration) -> Duration {
        let q = &*self.effective(q, now);
        let t = t.into();
        let mut wait = self.blocked_until.saturating_sub(now);
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            if let (Some(s), Some(l)) = (q.shape(b), &self.buckets[i]) {
                wait = wait.max(l.wait_for(&s, counts.amount(t), now));
            }
        }
        wait
    }

    /// Gate 3: take the reservation `t` (and one request), or nothing.
    pub fn reserve(&mut self, q: &QuotaParams, t: impl Into<Tokens>, now: Duration) -> Reserve {
        let t = t.into();
        self.redate(now);
        let wait = self.wait(q, t, now).max(self.unlearned_wait(q));
        if !wait.is_zero() {
            return Reserve::Denied { retry_after: wait };
        }
        self.track(q, t, true);
        let q = &*self.effective(q, now);
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            match q.shape(b) {
                Some(s) => self.buckets[i].get_or_insert(Level { full_at: now }).debit(
                    &s,
                    counts.amount(t),
                    now,
                ),
                None => self.buckets[i] = None,
            }
        }
        Reserve::Reserved
    }

    /// Settle a reservation `reserved` taken at the factor in force now. An extra
    /// debit takes at most [`QuotaParams::max_debt`] of refill time from each bucket
    /// (§12).
    pub fn settle(
        &mut self,
        q: &QuotaParams,
        reserved: impl Into<Tokens>,
        how: Settlement,
        now: Duration,
    ) {
        let ppm = self.rate_factor(q, now);
        self.settle_at(q, reserved, how, ppm, now)
    }

    /// Settle a reservation `reserved` taken while §18's learned factor was `ppm`
    /// ([`Quota::admitted_ppm`] at its admission; [`PPM_WHOLE`] for a source that
    /// does not learn): its credits are converted to refill time at the limits of
    /// that factor, so a refund gives back what the reservation took even when the
    /// factor was cut since; the buckets keep the bounds of the limits in force now.
    pub fn settle_at(
        &mut self,
        q: &QuotaParams,
        reserved: impl Into<Tokens>,
        how: Settlement,
        ppm: u32,
        now: Duration,
    ) {
        let reserved = reserved.into();
        self.redate(now);
        self.track(q, reserved, false);
        let then = self.effective_at(q, ppm);
        let q = &*self.effective(q, now);
        let c = q.credits(reserved, how);
        let most = q.max_debt.as_nanos();
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            let credit = c.of(counts);
            match q.shape(b) {
                Some(s) if credit != 0 => {
                    let at = then.shape(b).unwrap_or(s);
                    self.buckets[i]
                        .get_or_insert(Level { full_at: now })
                        .add_at(&s, &at, credit, most, now)
                }
                Some(_) => {}
                None => self.buckets[i] = None,
            }
        }
    }

    /// §18 `learn_rate`: what a reservation taken at `now` is taken at, for its
    /// settlement ([`Quota::settle_at`] converts at its factor) and its 429
    /// ([`Quota::rate_limited`] cuts only under the same last cut):
    /// [`AdmittedRate::WHOLE`] on a source that does not learn.
    pub fn admitted(&self, q: &QuotaParams, now: Duration) -> AdmittedRate {
        if q.learn == 0 {
            AdmittedRate::WHOLE
        } else {
            AdmittedRate {
                ppm: self.rate_factor(q, now),
                cut: self.rate.map_or(SeenCut::None, |r| SeenCut::At(r.at)),
            }
        }
    }

    /// §18 `learn_rate`: a 429 reported at `now`, after its settlement (at the
    /// factor before the cut) and before its block: unless a block was already in
    /// force (the ledger knew) or a cut was made since the call's admission (`seen`,
    /// [`Quota::admitted`]; `None`: not known), it may cut the learned factor
    /// ([`learn::cut`]). Nothing for a source that does not learn.
    pub fn rate_limited(&mut self, q: &QuotaParams, seen: Option<AdmittedRate>, now: Duration) {
        if q.learn == 0 {
            return;
        }
        self.redate(now);
        let blocked = self.blocked_until > now;
        if let Some(r) = learn::cut(self.rate, q.learn, blocked, seen, now) {
            self.rate = Some(r);
        }
    }

    /// §18 `learn_rate`: a cut dated after `now` is re-dated `now`
    /// ([`learn::LearnedRate::redated`]).
    fn redate(&mut self, now: Duration) {
        self.rate = self.rate.map(|r| r.redated(now));
    }

    /// §18 `learn_rate`, §10: start from the factor `ppm` as of `at` (what a shared
    /// backend's host last read, for its local fallback); it recovers from then.
    pub fn seed_rate(&mut self, ppm: u32, at: Duration) {
        self.rate = (ppm < PPM_WHOLE).then_some(learn::LearnedRate { ppm, at });
    }

    /// §18 `learn_rate`: the learned factor at `now`, ppm of the limit.
    pub fn rate_factor(&self, q: &QuotaParams, now: Duration) -> u32 {
        learn::factor(self.rate, q.learn, now)
    }

    /// 429: block until `now + d` (only moves forward; `d` at most
    /// [`MAX_QUOTA_BLOCK`]).
    pub fn block(&mut self, d: Duration, now: Duration) {
        self.blocked_until = self
            .blocked_until
            .max(now.saturating_add(d.min(MAX_QUOTA_BLOCK)));
    }

    /// Levels for status.
    pub fn view(&self, q: &QuotaParams, now: Duration) -> QuotaView {
        let q = &*self.effective(q, now);
        let mut levels = [None; 6];
        for (i, (b, _, _)) in BUCKETS.into_iter().enumerate() {
            levels[i] = q
                .shape(b)
                .map(|s| self.buckets[i].map_or(s.capacity as f64, |l| l.level(&s, now)));
        }
        QuotaView {
            levels,
            blocked: self.blocked_until.saturating_sub(now),
        }
    }
}

// §19: what a tenant's ledger reads of its buckets (gate/tenant.rs).
impl Quota {
    /// The bucket with the longest wait for reservation `t` and that wait, `None`
    /// when `t` fits now (a tenant's buckets have no 429 block).
    pub fn refusing(
        &self,
        q: &QuotaParams,
        t: impl Into<Tokens>,
        now: Duration,
    ) -> Option<(Bucket, Duration)> {
        let t = t.into();
        let mut worst: Option<(Bucket, Duration)> = None;
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            if let (Some(s), Some(l)) = (q.shape(b), &self.buckets[i]) {
                let w = l.wait_for(&s, counts.amount(t), now);
                if !w.is_zero() && worst.is_none_or(|(_, m)| w > m) {
                    worst = Some((b, w));
                }
            }
        }
        worst
    }

    /// Every configured bucket full at `now` (nothing to remember).
    pub fn full(&self, q: &QuotaParams, now: Duration) -> bool {
        BUCKETS.into_iter().enumerate().all(|(i, (b, _, _))| {
            q.shape(b).is_none() || self.buckets[i].is_none_or(|l| l.deficit(now) == 0)
        })
    }
}

// §15: what the priority classes' reserves and limits read of the buckets
// (gate/classes.rs keeps the per-class side).
impl Quota {
    /// Each configured bucket's deficit at `now` (ns of refill time; 0 = full),
    /// `None` for a disabled bucket, in [`BUCKETS`] order.
    pub fn deficits(&self, q: &QuotaParams, now: Duration) -> [Option<u128>; 6] {
        let q = &*self.effective(q, now);
        let mut d = [None; 6];
        for (i, (b, _, _)) in BUCKETS.into_iter().enumerate() {
            if q.shape(b).is_some() {
                d[i] = Some(self.buckets[i].map_or(0, |l| l.deficit(now)));
            }
        }
        d
    }
}

impl Default for Quota {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn q60() -> QuotaParams {
        QuotaParams {
            tpm: Some(60),
            ..QuotaParams::default()
        }
    }

    #[test]
    fn the_wait_covers_debt_and_the_block_whichever_is_later() {
        let qp = q60();
        let mut q = Quota::new();
        assert_eq!(q.reserve(&qp, 50, s(0)), Reserve::Reserved);
        q.settle(&qp, 50, Settlement::charge(90), s(0)); // level −30
        assert_eq!(q.view(&qp, s(0)).tokens(), Some(-30.0));
        // 10 tokens need 40 more: 40 s at one token per second.
        assert_eq!(q.wait(&qp, 10, s(0)), s(40));
        q.block(s(5), s(0));
        assert_eq!(q.wait(&qp, 10, s(0)), s(40), "refill is the later");
        q.block(s(100), s(0));
        assert_eq!(q.wait(&qp, 10, s(0)), s(100), "the block is the later");
        assert_eq!(
            q.reserve(&qp, 10, s(1)),
            Reserve::Denied { retry_after: s(99) }
        );
    }

    #[test]
    fn levels_stay_within_plus_minus_capacity_and_refill_continuously() {
        let qp = q60();
        let mut q = Quota::new();
        assert_eq!(
            q.reserve(&qp, 100, s(0)),
            Reserve::Reserved,
            "oversized fits a full bucket"
        );
        assert_eq!(q.view(&qp, s(0)).tokens(), Some(-40.0));
        q.settle(&qp, 0, Settlement::charge(u64::MAX), s(0));
        assert_eq!(q.view(&qp, s(0)).tokens(), Some(-60.0), "debt floor");
        assert_eq!(q.view(&qp, s(90)).tokens(), Some(30.0));
        q.settle(&qp, 1_000, Settlement::RefundTokens, s(90));
        assert_eq!(q.view(&qp, s(90)).tokens(), Some(60.0), "capacity cap");
    }
}
