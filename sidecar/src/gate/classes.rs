//! §15 reserves and limits of priority classes on one source's quota buckets: the
//! per-class part of gate 3. Plain data, `now` passed in; `gate.lua` implements the
//! same rules in its "priority classes" block (one script call per admission still).
//!
//! Each class's use of each bucket is kept like the bucket itself, as the instant its
//! share would have drained (`drain_at`): taking `n` moves it forward by the time `n`
//! takes to refill, a settlement's credit moves it back, and it drains at the
//! bucket's refill rate. So a class's *usage* at `now` is `drain_at − now`, in the
//! same unit (refill time) as the bucket's own deficit, and a share of a bucket is
//! that share of the time a full bucket takes to refill (`whole`: a minute for a §7
//! bucket, `burst` for a §7a per-minute one, a day for a per-day one).
//!
//! For a class `c` taking `a` (as refill time) from a bucket whose deficit is `D`:
//! - **limit** (always): refused when `c` already uses some of the bucket and
//!   `usage_c + a > limit_c × whole` (a class using nothing may always take one
//!   reservation, as an oversized reservation fits a full bucket — otherwise a class
//!   with a small limit on a small bucket could never run). Wait: the excess.
//! - **reserve** (only when saturated, `D + a > saturation × whole`): refused when
//!   what would be left, `whole − D − a`, is less than the other classes' unused
//!   reserves `Σ max(0, reserve_o × whole − usage_o)`. Wait (§6, "certainly"): the
//!   sooner of the bucket draining below saturation and its level covering every
//!   other reserve whole.
//!
//! Every bucket of [`BUCKETS`] counts, each with its own share of the reservation
//! (§7a: input tokens in `itpm`, output in `otpm`); settlements use the same
//! [`QuotaParams::credits`] as the buckets.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::quota::{QuotaParams, Settlement, Shape, Tokens, BUCKETS};

/// Parts per million: shares cross to the Redis script as integers.
pub const PPM: u64 = 1_000_000;

/// Number of buckets a class's usage is kept for (one per [`BUCKETS`] entry).
const N: usize = BUCKETS.len();

/// A scope's classes as the quota gate sees them (their order is the scope's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassShares {
    /// Share of a bucket in use above which reserves apply, in ppm.
    pub saturation_ppm: u64,
    /// Every class of the scope.
    pub classes: Vec<Share>,
}

/// One class's shares, in ppm of a bucket's capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// Class name (its usage is kept per source under this name).
    pub name: Arc<str>,
    /// Kept for the class when saturated.
    pub reserve_ppm: u64,
    /// Never more than this ([`PPM`] = no cap).
    pub limit_ppm: u64,
}

/// A call's class: the scope's shares and which one is the call's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassTag {
    /// The scope's classes.
    pub shares: Arc<ClassShares>,
    /// Index of the call's class in `shares.classes`.
    pub index: usize,
}

impl ClassTag {
    /// The call's class.
    pub fn share(&self) -> &Share {
        &self.shares.classes[self.index]
    }
}

/// Which rule held a class back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// The class reached its `limit`.
    Limit,
    /// The rest is other classes' unused reserve and the source is saturated.
    Reserve,
}

/// Refill time of a full bucket of shape `s`, in ns: what a share is a share of.
fn whole(s: &Shape) -> u128 {
    s.refill_ns(s.capacity)
}

/// `ppm` of `whole`.
fn of(whole: u128, ppm: u64) -> u128 {
    whole * ppm.min(PPM) as u128 / PPM as u128
}

/// The per-class usage of one source's buckets, by class name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassUsage {
    /// Class → `drain_at` per bucket of [`BUCKETS`].
    by_class: HashMap<Arc<str>, [Duration; N]>,
}

impl ClassUsage {
    /// Usage of `class` in bucket `i` at `now`, in ns of refill time.
    fn usage(&self, class: &str, i: usize, now: Duration) -> u128 {
        self.by_class
            .get(class)
            .map_or(0, |d| d[i].saturating_sub(now).as_nanos())
    }

    /// Would `tag`'s class be held back from taking `tokens`, given each bucket's
    /// deficit at `now` (`deficits[i]`, ns; `None` = bucket disabled)? The wait is the
    /// longest over the buckets, never zero when held.
    pub fn held(
        &self,
        q: &QuotaParams,
        deficits: [Option<u128>; N],
        tag: &ClassTag,
        tokens: impl Into<Tokens>,
        now: Duration,
    ) -> Option<(Held, Duration)> {
        let tokens = tokens.into();
        let me = tag.share();
        let mut worst: Option<(Held, u128)> = None;
        let mut note = |why: Held, w: u128| {
            if worst.is_none_or(|(_, x)| w > x) {
                worst = Some((why, w.max(1)));
            }
        };
        for (i, ((b, counts, _), d)) in BUCKETS.into_iter().zip(deficits).enumerate() {
            let (Some(s), Some(d)) = (q.shape(b), d) else {
                continue;
            };
            let whole = whole(&s);
            let sat = of(whole, tag.shares.saturation_ppm);
            let a = s.refill_ns(counts.amount(tokens));
            let used = self.usage(&me.name, i, now);
            if me.limit_ppm < PPM {
                let lim = of(whole, me.limit_ppm);
                if used > 0 && used + a > lim {
                    note(Held::Limit, used + a - lim);
                }
            }
            if d + a > sat {
                let (mut held, mut reserved) = (0u128, 0u128);
                for (j, o) in tag.shares.classes.iter().enumerate() {
                    if j == tag.index || o.reserve_ppm == 0 {
                        continue;
                    }
                    let r = of(whole, o.reserve_ppm);
                    reserved += r;
                    held += r.saturating_sub(self.usage(&o.name, i, now));
                }
                let left = whole.saturating_sub(d + a);
                if left < held {
                    let below_saturation = d + a - sat;
                    let covers_all = (d + a + reserved).saturating_sub(whole);
                    note(Held::Reserve, below_saturation.min(covers_all));
                }
            }
        }
        worst.map(|(why, w)| (why, Duration::from_nanos(w.min(u64::MAX as u128) as u64)))
    }

    /// The class took the reservation `tokens` (and one request).
    pub fn take(
        &mut self,
        q: &QuotaParams,
        class: &Arc<str>,
        tokens: impl Into<Tokens>,
        now: Duration,
    ) {
        let tokens = tokens.into();
        let e = self
            .by_class
            .entry(class.clone())
            .or_insert([Duration::ZERO; N]);
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            if let Some(s) = q.shape(b) {
                let used = e[i].saturating_sub(now).as_nanos();
                let next = (used + s.refill_ns(counts.amount(tokens))).min(s.floor_ns());
                e[i] = now + Duration::from_nanos(next.min(u64::MAX as u128) as u64);
            }
        }
    }

    /// Settle the class's reservation `reserved` `how`: the same credits the buckets
    /// get ([`QuotaParams::credits`], §7, §7a).
    pub fn settle(
        &mut self,
        q: &QuotaParams,
        class: &str,
        reserved: impl Into<Tokens>,
        how: Settlement,
        now: Duration,
    ) {
        self.settle_at(q, q, class, reserved, how, now)
    }

    /// [`ClassUsage::settle`] with the credits converted to refill time at `then`'s
    /// limits (§18 `learn_rate`: those in force at the reservation's admission, as
    /// the buckets' own settlement, [`crate::gate::quota::Quota::settle_at`]); the
    /// usage keeps the bounds of `q`'s, the limits in force now.
    pub fn settle_at(
        &mut self,
        q: &QuotaParams,
        then: &QuotaParams,
        class: &str,
        reserved: impl Into<Tokens>,
        how: Settlement,
        now: Duration,
    ) {
        let c = q.credits(reserved.into(), how);
        let Some(e) = self.by_class.get_mut(class) else {
            return;
        };
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            let Some(s) = q.shape(b) else { continue };
            let credit = c.of(counts);
            if credit == 0 {
                continue;
            }
            let at = then.shape(b).unwrap_or(s);
            let used = e[i].saturating_sub(now).as_nanos();
            let n = credit.unsigned_abs().min(u64::MAX as u128) as u64;
            let next = if credit > 0 {
                used.saturating_sub(at.back_ns(n))
            } else {
                (used + at.refill_ns(n)).min(s.floor_ns())
            };
            e[i] = now + Duration::from_nanos(next.min(u64::MAX as u128) as u64);
        }
    }

    /// Each class's share of each bucket's capacity in use at `now` (status), by
    /// class name; `None` for a disabled bucket, in [`BUCKETS`] order.
    pub fn shares(&self, q: &QuotaParams, now: Duration) -> Vec<(Arc<str>, [Option<f64>; N])> {
        let mut v: Vec<(Arc<str>, [Option<f64>; N])> = self
            .by_class
            .keys()
            .map(|name| {
                let mut sh = [None; N];
                for (i, (b, _, _)) in BUCKETS.into_iter().enumerate() {
                    if let Some(s) = q.shape(b) {
                        sh[i] = Some(self.usage(name, i, now) as f64 / whole(&s) as f64);
                    }
                }
                (name.clone(), sh)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(index: usize) -> ClassTag {
        ClassTag {
            shares: Arc::new(ClassShares {
                saturation_ppm: 800_000,
                classes: vec![
                    Share {
                        name: "interactive".into(),
                        reserve_ppm: 300_000,
                        limit_ppm: PPM,
                    },
                    Share {
                        name: "batch".into(),
                        reserve_ppm: 0,
                        limit_ppm: 900_000,
                    },
                ],
            }),
            index,
        }
    }

    const Q: QuotaParams = QuotaParams {
        tpm: None,
        rpm: Some(100),
        itpm: None,
        otpm: None,
        tpd: None,
        rpd: None,
        burst: crate::gate::quota::MINUTE,
        charge_estimate: false,
        max_debt: crate::gate::quota::DEFAULT_MAX_DEBT,
        observe: false,
        auto: 0,
        auto_share_ppm: crate::gate::quota::PPM_WHOLE,
        learn: 0,
    };

    /// Deficits with only the rpm bucket (index 1) configured.
    fn rpm_only(d: u128) -> [Option<u128>; N] {
        let mut a = [None; N];
        a[1] = Some(d);
        a
    }

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn batch_fills_to_saturation_then_the_reserve_holds() {
        let mut u = ClassUsage::default();
        let batch: Arc<str> = "batch".into();
        let mut deficit = 0u128;
        let per = Q
            .shape(crate::gate::quota::Bucket::Rpm)
            .unwrap()
            .refill_ns(1);
        let mut taken = 0;
        while u.held(&Q, rpm_only(deficit), &tag(1), 0, s(0)).is_none() {
            u.take(&Q, &batch, 0, s(0));
            deficit += per;
            taken += 1;
        }
        assert_eq!(taken, 80, "idle capacity is anyone's below saturation");
        let (why, wait) = u.held(&Q, rpm_only(deficit), &tag(1), 0, s(0)).unwrap();
        assert_eq!(why, Held::Reserve);
        // 81 in use of 100 would be above 80 %: one request's refill (0.6 s) away.
        assert_eq!(wait, Duration::from_millis(600));
        // Interactive is not held by its own reserve.
        assert!(u.held(&Q, rpm_only(deficit), &tag(0), 0, s(0)).is_none());
    }

    #[test]
    fn a_limit_caps_the_class_always_but_lets_an_idle_class_take_one() {
        let mut t = tag(1);
        Arc::make_mut(&mut t.shares).classes[1].limit_ppm = 100_000; // 10 of 100
        let mut u = ClassUsage::default();
        let batch: Arc<str> = "batch".into();
        for _ in 0..10 {
            assert!(u.held(&Q, rpm_only(0), &t, 0, s(0)).is_none());
            u.take(&Q, &batch, 0, s(0));
        }
        let (why, wait) = u.held(&Q, rpm_only(0), &t, 0, s(0)).unwrap();
        assert_eq!((why, wait), (Held::Limit, Duration::from_millis(600)));
        // Refunding one (cancelled before sending) frees it.
        u.settle(&Q, "batch", 0, Settlement::RefundAll, s(0));
        assert!(u.held(&Q, rpm_only(0), &t, 0, s(0)).is_none());
        // Usage drains at the bucket's rate.
        u.take(&Q, &batch, 0, s(0));
        assert!(u.held(&Q, rpm_only(0), &t, 0, s(1)).is_none());
    }
}
