//! §15 reserves and limits of priority classes on one source's quota buckets: the
//! per-class part of gate 3. Plain data, `now` passed in; `gate.lua` implements the
//! same rules in its "priority classes" block (one script call per admission still).
//!
//! Each class's use of each bucket is kept like the bucket itself, as the instant its
//! share would have drained (`drain_at`): taking `n` moves it forward by the time `n`
//! takes to refill, a settlement's credit moves it back, and it drains at the
//! bucket's refill rate. So a class's *usage* at `now` is `drain_at − now`, in the
//! same unit (time of a minute's refill) as the bucket's own deficit, and a share of
//! the capacity is `share × MINUTE`.
//!
//! For a class `c` taking `a` (as refill time) from a bucket whose deficit is `D`:
//! - **limit** (always): refused when `c` already uses some of the bucket and
//!   `usage_c + a > limit_c × MINUTE` (a class using nothing may always take one
//!   reservation, as an oversized reservation fits a full bucket — otherwise a class
//!   with a small limit on a small bucket could never run). Wait: the excess.
//! - **reserve** (only when saturated, `D + a > saturation × MINUTE`): refused when
//!   what would be left, `MINUTE − D − a`, is less than the other classes' unused
//!   reserves `Σ max(0, reserve_o × MINUTE − usage_o)`. Wait (§6, "certainly"): the
//!   sooner of the bucket draining below saturation and its level covering every
//!   other reserve whole.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::quota::{QuotaParams, Settlement, MINUTE};

/// Parts per million: shares cross to the Redis script as integers.
pub const PPM: u64 = 1_000_000;

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

/// `share` (ppm) of a minute, in ns.
fn of_minute(ppm: u64) -> u128 {
    MINUTE.as_nanos() * ppm.min(PPM) as u128 / PPM as u128
}

fn refill_ns(amount: u64, cap: u64) -> u128 {
    (amount as u128 * MINUTE.as_nanos()).div_ceil(cap.max(1) as u128)
}

/// The per-class usage of one source's buckets, by class name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClassUsage {
    /// Class → `drain_at` per bucket of [`QuotaParams::buckets`].
    by_class: HashMap<Arc<str>, [Duration; 2]>,
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
        deficits: [Option<u128>; 2],
        tag: &ClassTag,
        tokens: u64,
        now: Duration,
    ) -> Option<(Held, Duration)> {
        let me = tag.share();
        let sat = of_minute(tag.shares.saturation_ppm);
        let whole = MINUTE.as_nanos();
        let mut worst: Option<(Held, u128)> = None;
        let mut note = |why: Held, w: u128| {
            if worst.is_none_or(|(_, x)| w > x) {
                worst = Some((why, w.max(1)));
            }
        };
        for (i, ((counts, cap), d)) in q.buckets().into_iter().zip(deficits).enumerate() {
            let (Some(cap), Some(d)) = (cap, d) else {
                continue;
            };
            let a = refill_ns(counts.amount(tokens), cap);
            let used = self.usage(&me.name, i, now);
            if me.limit_ppm < PPM {
                let lim = of_minute(me.limit_ppm);
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
                    let r = of_minute(o.reserve_ppm);
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

    /// The class took `tokens` (and one request).
    pub fn take(&mut self, q: &QuotaParams, class: &Arc<str>, tokens: u64, now: Duration) {
        let e = self
            .by_class
            .entry(class.clone())
            .or_insert([Duration::ZERO; 2]);
        for (i, (counts, cap)) in q.buckets().into_iter().enumerate() {
            if let Some(cap) = cap {
                let used = e[i].saturating_sub(now).as_nanos();
                let next =
                    (used + refill_ns(counts.amount(tokens), cap)).min(2 * MINUTE.as_nanos());
                e[i] = now + Duration::from_nanos(next as u64);
            }
        }
    }

    /// Settle the class's reservation of `reserved` tokens `how` (the same credits the
    /// buckets get, §7).
    pub fn settle(
        &mut self,
        q: &QuotaParams,
        class: &str,
        reserved: u64,
        how: Settlement,
        now: Duration,
    ) {
        let (tc, rc): (i128, i128) = match how {
            Settlement::Charge { tokens } => (reserved as i128 - tokens as i128, 0),
            Settlement::RefundTokens => (reserved as i128, 0),
            Settlement::RefundAll => (reserved as i128, 1),
        };
        let Some(e) = self.by_class.get_mut(class) else {
            return;
        };
        for (i, (counts, cap)) in q.buckets().into_iter().enumerate() {
            let Some(cap) = cap else { continue };
            let credit = match counts {
                super::quota::Counts::Tokens => tc,
                super::quota::Counts::Requests => rc,
            };
            if credit == 0 {
                continue;
            }
            let used = e[i].saturating_sub(now).as_nanos();
            let n = credit.unsigned_abs().min(u64::MAX as u128) as u64;
            let next = if credit > 0 {
                used.saturating_sub(n as u128 * MINUTE.as_nanos() / cap.max(1) as u128)
            } else {
                (used + refill_ns(n, cap)).min(2 * MINUTE.as_nanos())
            };
            e[i] = now + Duration::from_nanos(next as u64);
        }
    }

    /// Each class's share of each bucket's capacity in use at `now` (status), by
    /// class name; `None` for a disabled bucket.
    pub fn shares(&self, q: &QuotaParams, now: Duration) -> Vec<(Arc<str>, [Option<f64>; 2])> {
        let whole = MINUTE.as_nanos() as f64;
        let mut v: Vec<(Arc<str>, [Option<f64>; 2])> = self
            .by_class
            .keys()
            .map(|name| {
                let mut s = [None; 2];
                for (i, (_, cap)) in q.buckets().into_iter().enumerate() {
                    if cap.is_some() {
                        s[i] = Some(self.usage(name, i, now) as f64 / whole);
                    }
                }
                (name.clone(), s)
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
    };

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn batch_fills_to_saturation_then_the_reserve_holds() {
        let mut u = ClassUsage::default();
        let batch: Arc<str> = "batch".into();
        let mut deficit = 0u128;
        let per = refill_ns(1, 100);
        let mut taken = 0;
        while u
            .held(&Q, [None, Some(deficit)], &tag(1), 0, s(0))
            .is_none()
        {
            u.take(&Q, &batch, 0, s(0));
            deficit += per;
            taken += 1;
        }
        assert_eq!(taken, 80, "idle capacity is anyone's below saturation");
        let (why, wait) = u.held(&Q, [None, Some(deficit)], &tag(1), 0, s(0)).unwrap();
        assert_eq!(why, Held::Reserve);
        // 81 in use of 100 would be above 80 %: one request's refill (0.6 s) away.
        assert_eq!(wait, Duration::from_millis(600));
        // Interactive is not held by its own reserve.
        assert!(u
            .held(&Q, [None, Some(deficit)], &tag(0), 0, s(0))
            .is_none());
    }

    #[test]
    fn a_limit_caps_the_class_always_but_lets_an_idle_class_take_one() {
        let mut t = tag(1);
        Arc::make_mut(&mut t.shares).classes[1].limit_ppm = 100_000; // 10 of 100
        let mut u = ClassUsage::default();
        let batch: Arc<str> = "batch".into();
        for _ in 0..10 {
            assert!(u.held(&Q, [None, Some(0)], &t, 0, s(0)).is_none());
            u.take(&Q, &batch, 0, s(0));
        }
        let (why, wait) = u.held(&Q, [None, Some(0)], &t, 0, s(0)).unwrap();
        assert_eq!((why, wait), (Held::Limit, Duration::from_millis(600)));
        // Refunding one (cancelled before sending) frees it.
        u.settle(&Q, "batch", 0, Settlement::RefundAll, s(0));
        assert!(u.held(&Q, [None, Some(0)], &t, 0, s(0)).is_none());
        // Usage drains at the bucket's rate.
        u.take(&Q, &batch, 0, s(0));
        assert!(u.held(&Q, [None, Some(0)], &t, 0, s(1)).is_none());
    }
}
