//! §10 with the quota: a degraded host's share. While the shared state cannot be
//! read, a host that shares a quota uses its share of every limit alone
//! ([`QuotaParams::share`], `degraded_share`; an `"auto"` bucket's learned limit is
//! cut too, through `auto_share_ppm`), and a host that last saw the shared quota
//! refuse starts from empty buckets ([`Quota::drain`]), not a fresh burst.
//!
//! Its own module because it is the one rule of §10 the quota holds; the backend
//! (`backend/redis/reach.rs`, `hosts.rs`) decides when it applies.

use std::time::Duration;

use super::bucket::{dur, Level};
use super::params::{QuotaParams, PPM_WHOLE};
use super::{Quota, BUCKETS};

impl QuotaParams {
    /// §10: these parameters with every limit cut to `share` of itself (rounded
    /// down, at least 1): what one of the hosts sharing a quota may use alone while
    /// the shared state cannot be read (`degraded_share`). A share of 1 or more
    /// changes nothing.
    pub fn share(&self, share: f64) -> QuotaParams {
        if share.is_nan() || share >= 1.0 {
            return *self;
        }
        let cut = |l: Option<u64>| l.map(|l| ((l as f64 * share.max(0.0)) as u64).max(1));
        let ppm = (share.max(0.0) * f64::from(PPM_WHOLE)) as u32;
        QuotaParams {
            auto_share_ppm: ((u64::from(self.auto_share_ppm) * u64::from(ppm)
                / u64::from(PPM_WHOLE)) as u32)
                .max(1),
            tpm: cut(self.tpm),
            rpm: cut(self.rpm),
            itpm: cut(self.itpm),
            otpm: cut(self.otpm),
            tpd: cut(self.tpd),
            rpd: cut(self.rpd),
            ..*self
        }
    }
}

impl Quota {
    /// §10: every configured bucket empty at `now` (never fuller than it was): a
    /// degraded host that last saw the shared quota refuse takes it as spent, and
    /// gets its share of the refill from there, not a fresh burst.
    pub fn drain(&mut self, q: &QuotaParams, now: Duration) {
        for (i, (b, _, _)) in BUCKETS.into_iter().enumerate() {
            if let Some(s) = q.shape(b) {
                let empty = now + dur(s.refill_ns(s.capacity));
                let l = self.buckets[i].get_or_insert(Level { full_at: now });
                l.full_at = l.full_at.max(empty);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::observed::Observation;
    use crate::gate::quota::Settlement;

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
    fn a_drained_quota_is_empty_and_refills_from_there() {
        let qp = QuotaParams {
            rpm: Some(60),
            ..q60()
        };
        let mut q = Quota::new();
        q.drain(&qp, s(10));
        let v = q.view(&qp, s(10));
        assert_eq!((v.tokens(), v.requests()), (Some(0.0), Some(0.0)));
        assert_eq!(q.wait(&qp, 1, s(10)), s(1), "one request's refill");
        let v = q.view(&qp, s(40));
        assert_eq!((v.tokens(), v.requests()), (Some(30.0), Some(30.0)));
        // Never fuller than it was: a bucket in debt stays in debt.
        q.settle(&qp, 0, Settlement::charge(120), s(40));
        q.drain(&qp, s(40));
        assert_eq!(q.view(&qp, s(40)).tokens(), Some(-60.0));
    }

    #[test]
    fn a_share_cuts_every_limit_down_and_keeps_at_least_one() {
        let q = QuotaParams {
            tpm: Some(10_000),
            rpm: Some(10),
            otpm: Some(3),
            rpd: Some(1_000),
            ..QuotaParams::default()
        };
        let h = q.share(0.25);
        assert_eq!(
            (h.tpm, h.rpm, h.itpm, h.otpm, h.tpd, h.rpd),
            (Some(2_500), Some(2), None, Some(1), None, Some(250))
        );
        assert_eq!((h.burst, h.max_debt), (q.burst, q.max_debt));
        assert_eq!(q.share(1.0), q);
        assert_eq!(q.share(f64::NAN), q, "no share is the whole");
    }

    /// §10 with §18: a degraded host's share cuts an `"auto"` bucket's learned limit
    /// too (a learned limit is not in the parameters the share cuts), so N degraded
    /// hosts do not each admit the provider's whole limit.
    #[test]
    fn a_share_cuts_an_auto_buckets_learned_limit() {
        use crate::gate::observed::Dim;
        let q = QuotaParams {
            observe: true,
            auto: 1, // tpm
            ..QuotaParams::default()
        };
        let mut quota = Quota::default();
        let seen = Observation {
            dims: [
                Some(Dim {
                    limit: Some(1_000),
                    remaining: Some(1_000),
                    reset: None,
                }),
                None,
                None,
                None,
            ],
            age: Duration::ZERO,
        };
        quota.observe(&q, &seen, Duration::from_secs(1));
        let whole = quota.view(&q, Duration::from_secs(1)).levels[0];
        assert_eq!(whole, Some(1_000.0), "learned the whole limit");
        let quarter = q.share(0.25);
        assert_eq!(quarter.auto_share_ppm, 250_000);
        let level = quota.view(&quarter, Duration::from_secs(1)).levels[0];
        assert_eq!(level, Some(250.0), "a quarter of the learned limit");
        assert_eq!(q.share(1.0).auto_share_ppm, PPM_WHOLE);
    }
}
