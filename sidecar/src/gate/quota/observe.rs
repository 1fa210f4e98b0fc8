//! §18 in the quota: limits learned from the provider. A source that observes keeps
//! in-flight counts per dimension ([`Quota::inflight`]), applies a response's
//! rate-limit headers to its buckets ([`Quota::observe`]: a level only ever lowers,
//! `remaining = 0` blocks), and an `"auto"` bucket takes the provider's limit as its
//! own once learned (until then one call at a time, [`UNLEARNED_WAIT`]).
//!
//! Its own module because none of it runs for a source that does not observe
//! (`observe_limits` off, no `"auto"` bucket); the types are in `gate/observed.rs`.

use std::borrow::Cow;
use std::time::Duration;

use super::bucket::{dur, Bucket, Level, BUCKETS};
use super::params::{QuotaParams, Tokens, PPM_WHOLE};
use super::Quota;
use crate::gate::observed::{LastSeen, Observation, DIMS};

impl QuotaParams {
    /// Whether the source keeps in-flight counts (it observes, or learns a limit).
    pub fn tracks(&self) -> bool {
        self.observe || self.auto != 0
    }

    /// Set `b`'s limit (an `"auto"` bucket's learned one).
    pub fn set_limit(&mut self, b: Bucket, v: Option<u64>) {
        match b {
            Bucket::Tpm => self.tpm = v,
            Bucket::Rpm => self.rpm = v,
            Bucket::Itpm => self.itpm = v,
            Bucket::Otpm => self.otpm = v,
            Bucket::Tpd => self.tpd = v,
            Bucket::Rpd => self.rpd = v,
        }
    }

    /// Whether bucket `i` of [`BUCKETS`] is `"auto"`.
    pub fn is_auto(&self, i: usize) -> bool {
        i < DIMS && self.auto & (1 << i) != 0
    }
}

/// How long a source with an `"auto"` bucket not learned yet waits for its one call
/// in flight (§18: one call at a time until the first response); a report wakes a
/// waiter sooner.
pub const UNLEARNED_WAIT: Duration = Duration::from_secs(1);

impl Quota {
    /// The parameters in force at `now`: `q` with every `"auto"` bucket's limit as
    /// learned (`None` until then, §18), and with `learn_rate` the per-minute limits
    /// scaled by the factor learned at `now`; `q` itself when neither applies. §15's
    /// class usage is kept in these limits.
    pub fn effective<'a>(&self, q: &'a QuotaParams, now: Duration) -> Cow<'a, QuotaParams> {
        if q.learn == 0 {
            return self.effective_at(q, PPM_WHOLE);
        }
        self.effective_at(q, self.rate_factor(q, now))
    }

    /// [`Quota::effective`] with the learned factor `ppm` (§18 `learn_rate`: the one
    /// a reservation was admitted at, [`Quota::admitted`]) instead of the one at
    /// some `now`.
    pub fn effective_at<'a>(&self, q: &'a QuotaParams, ppm: u32) -> Cow<'a, QuotaParams> {
        if q.auto == 0 && q.learn == 0 {
            return Cow::Borrowed(q);
        }
        let mut e = *q;
        for (i, (b, _, _)) in BUCKETS.into_iter().enumerate().take(DIMS) {
            if q.is_auto(i) {
                let learned = self.seen.as_ref().and_then(|s| s.learned[i]);
                let cut = |l: u64| {
                    (u128::from(l) * u128::from(q.auto_share_ppm) / u128::from(PPM_WHOLE)).max(1)
                        as u64
                };
                e.set_limit(b, learned.map(cut));
            }
        }
        if q.learn != 0 {
            e = e.scaled(ppm);
        }
        Cow::Owned(e)
    }

    /// §18: a source with an `"auto"` bucket not learned yet admits one call at a
    /// time: the wait while one is in flight (zero otherwise).
    pub(super) fn unlearned_wait(&self, q: &QuotaParams) -> Duration {
        let seen = self.seen.as_deref();
        let unlearned =
            (0..DIMS).any(|i| q.is_auto(i) && seen.is_none_or(|s| s.learned[i].is_none()));
        let busy = seen.is_some_and(|s| s.inflight[Bucket::Rpm as usize] > 0);
        if unlearned && busy {
            UNLEARNED_WAIT
        } else {
            Duration::ZERO
        }
    }

    /// Count a reservation in (`add`) or out of the in-flight counts.
    pub(super) fn track(&mut self, q: &QuotaParams, t: Tokens, add: bool) {
        if !q.tracks() {
            return;
        }
        let seen = self.seen.get_or_insert_with(Box::default);
        for (i, (_, counts, _)) in BUCKETS.into_iter().enumerate().take(DIMS) {
            let n = counts.amount(t);
            let f = &mut seen.inflight[i];
            *f = if add {
                f.saturating_add(n)
            } else {
                f.saturating_sub(n)
            };
        }
    }

    /// §18: apply a response's rate-limit headers. Ignored unless the source
    /// observes, and when dated (`now − age`) before an observation already applied.
    /// Per dimension: an `"auto"` bucket learns the `limit`; a configured bucket's
    /// level becomes `min(level, remaining − in flight)` as of the observation (it
    /// only ever lowers); `remaining = 0` with a reset blocks the quota until then
    /// (the caller capped the reset at `max_rate_limit_block`).
    pub fn observe(&mut self, q: &QuotaParams, o: &Observation, now: Duration) {
        if !q.tracks() {
            return;
        }
        let at = now.saturating_sub(o.age);
        let seen = self.seen.get_or_insert_with(Box::default);
        if seen.at.is_some_and(|last| at < last) {
            return;
        }
        seen.at = Some(at);
        for (i, d) in o.dims.iter().enumerate() {
            let Some(d) = d else { continue };
            if q.is_auto(i) {
                if let Some(l) = d.limit.filter(|&l| l > 0) {
                    seen.learned[i] = Some(l);
                }
            }
        }
        let e = *self.effective(q, now);
        let mut block = Duration::ZERO;
        for (i, d) in o.dims.iter().enumerate() {
            let Some(d) = d else { continue };
            let Some(rem) = d.remaining else { continue };
            let b = BUCKETS[i].0;
            let seen = self.seen.as_deref_mut().expect("created above");
            seen.last[i] = Some((rem, d.limit, at));
            if rem == 0 {
                if let Some(r) = d.reset {
                    block = block.max((at + r).saturating_sub(now));
                }
            }
            let Some(s) = e.shape(b) else { continue };
            let target = rem as i128 - seen.inflight[i] as i128;
            if target >= s.capacity as i128 {
                continue;
            }
            // The level `target` at `at`: full again `refill(capacity − target)` later,
            // never deeper than the debt floor.
            let taken = (s.capacity as i128 - target)
                .unsigned_abs()
                .min(u64::MAX as u128) as u64;
            let full_at = (at + dur(s.refill_ns(taken))).min(now + dur(s.floor_ns()));
            let level = self.buckets[i].get_or_insert(Level { full_at: now });
            let old = level.full_at.max(now);
            if full_at > old {
                let removed = (full_at - old).as_nanos() * s.limit as u128 / s.period.as_nanos();
                level.full_at = full_at;
                let seen = self.seen.as_deref_mut().expect("created above");
                seen.removed[i] =
                    seen.removed[i].saturating_add(removed.min(u64::MAX as u128) as u64);
            }
        }
        if !block.is_zero() {
            self.block(block, now);
        }
    }

    /// §18 for status: per dimension, the last observation (its age at `now`) and
    /// what the corrections removed; `None` where nothing was observed.
    pub fn seen(&self, now: Duration) -> [Option<LastSeen>; DIMS] {
        let mut v = [None; DIMS];
        if let Some(s) = self.seen.as_deref() {
            for (i, slot) in v.iter_mut().enumerate() {
                *slot = s.last[i].map(|(remaining, limit, at)| LastSeen {
                    limit,
                    remaining,
                    age: now.saturating_sub(at),
                    removed: s.removed[i],
                });
            }
        }
        v
    }

    /// §18: the in-flight counts (tokens, requests, input, output).
    pub fn inflight(&self) -> [u64; DIMS] {
        self.seen.as_ref().map_or([0; DIMS], |s| s.inflight)
    }

    /// §18: an `"auto"` bucket's learned limits (`None`: not learned, or not auto).
    pub fn learned(&self) -> [Option<u64>; DIMS] {
        self.seen.as_ref().map_or([None; DIMS], |s| s.learned)
    }
}
