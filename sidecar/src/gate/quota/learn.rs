//! §18 `learn_rate = "aimd"`: the rate a source may use, learned from the 429s
//! themselves. A provider whose headers do not say when its counters refill (Azure's
//! per-second rule: `remaining` only) gives §18's lowering nothing to act on; a 429
//! nothing predicted does. The source's per-minute limits (`tpm`, `rpm`, `itpm`,
//! `otpm`) are scaled by a factor in parts per million of the configured (or learned
//! `"auto"`) limit, kept in the quota state so every host uses the same:
//!
//! - **multiplicative decrease**: a 429 reported while no 429 block is in force (the
//!   ledger admitted the call and nothing since said the quota was spent) cuts the
//!   factor to [`CUT_NUM`]/[`CUT_DEN`] of itself, never below [`FLOOR_PPM`], at most
//!   once per [`CUT_EVERY`] (the 429s of one moment count once), and only when the
//!   call was admitted under the last cut ([`AdmittedRate::cut`]: a 429 of a call
//!   sent before it says nothing of the rate after it);
//! - **additive recovery**: from the last cut the factor grows by
//!   [`QuotaParams::learn`] ppm per second (default [`RECOVER_PPM_PER_S`]), never
//!   above the whole limit.
//!
//! The state is two numbers (the factor as of the last cut, and that instant), so the
//! factor at any `now` is one formula; `gate.lua` keeps the same in the quota hash's
//! field `ar` (`"<ppm> <at µs>"`) with the same integer arithmetic. A source with
//! `learn = 0` never has any of it.

use std::time::Duration;

use super::params::{QuotaParams, PPM_WHOLE};

/// Lowest factor (5 % of the limit): a run of 429s never stops a source.
pub const FLOOR_PPM: u32 = 50_000;
/// A cut keeps `CUT_NUM / CUT_DEN` of the factor (×0.7).
pub const CUT_NUM: u32 = 7;
/// See [`CUT_NUM`].
pub const CUT_DEN: u32 = 10;
/// At most one cut per this long (`gate.lua` `LCUT_EVERY`).
pub const CUT_EVERY: Duration = Duration::from_secs(1);
/// Default recovery: +0.5 % of the limit per second without a cut (0.7 → 1 in a
/// minute).
pub const RECOVER_PPM_PER_S: u32 = 5_000;

/// The learned factor: `ppm` as of `at` (the last cut, on the backend's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LearnedRate {
    /// The factor right after the last cut, ppm of the limit.
    pub ppm: u32,
    /// When that cut was made.
    pub at: Duration,
}

/// What a permit's admission saw of the learned factor, carried back by its report
/// (`Admit::Admitted::rate`, `ReportRequest::admitted_at`; on Redis the admit reply's
/// elements 7 and 8, the report's script slots 55 and 56).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmittedRate {
    /// The factor the reservation was taken at, ppm of the limits: its settlement
    /// converts at it, so a refund gives back what the reservation took.
    pub ppm: u32,
    /// The last cut in force then: the call's 429 cuts only while that cut is still
    /// the last one, as classic AIMD cuts only on the loss of a packet sent after the
    /// last cut.
    pub cut: SeenCut,
}

/// The last cut a permit's admission saw ([`AdmittedRate::cut`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeenCut {
    /// No cut was in force.
    None,
    /// The cut dated this ([`LearnedRate::at`], on the admitting backend's clock).
    At(Duration),
    /// Not comparable: the permit was admitted by another ledger than the one its
    /// report goes to (Redis and a host's local fallback, across a degradation),
    /// whose dates are on another clock. Its 429 cuts as if admitted under the last
    /// cut (as before the permit carried a cut at all).
    Unknown,
}

impl AdmittedRate {
    /// What a source that does not learn is admitted at.
    pub const WHOLE: AdmittedRate = AdmittedRate {
        ppm: PPM_WHOLE,
        cut: SeenCut::None,
    };

    /// The same, its cut no longer comparable ([`SeenCut::Unknown`]).
    pub fn foreign(self) -> AdmittedRate {
        AdmittedRate {
            cut: SeenCut::Unknown,
            ..self
        }
    }

    /// A cut was made since this admission, judged against the last cut `last`.
    fn cut_since(&self, last: &LearnedRate) -> bool {
        match self.cut {
            SeenCut::None => true,
            SeenCut::At(at) => at != last.at,
            SeenCut::Unknown => false,
        }
    }
}

impl LearnedRate {
    /// The factor at `now`: `ppm` plus `recover` ppm per second since `at` (whole
    /// microseconds, rounded down), at most the whole limit.
    pub fn factor(&self, recover: u32, now: Duration) -> u32 {
        let us = now.saturating_sub(self.at).as_micros();
        let up = us * u128::from(recover) / 1_000_000;
        (u128::from(self.ppm) + up).min(u128::from(PPM_WHOLE)) as u32
    }

    /// The same re-dated to `now` when the cut is dated after it (the clock that
    /// dated it was ahead: a failover to a server whose clock is behind): recovery
    /// and the next cut then run from `now`, not from when the clock catches up
    /// (`gate.lua` writes the re-dated cut the same).
    pub fn redated(self, now: Duration) -> LearnedRate {
        LearnedRate {
            at: self.at.min(now),
            ..self
        }
    }

    /// When the factor is whole again (nothing to remember after that).
    pub fn whole_at(&self, recover: u32) -> Duration {
        let missing = u64::from(PPM_WHOLE.saturating_sub(self.ppm));
        let us = (missing * 1_000_000).div_ceil(u64::from(recover.max(1)));
        self.at + Duration::from_micros(us)
    }
}

/// The factor of `r` at `now` (whole when nothing was learned).
pub fn factor(r: Option<LearnedRate>, recover: u32, now: Duration) -> u32 {
    r.map_or(PPM_WHOLE, |r| r.factor(recover, now))
}

/// A 429 reported at `now` on a source learning with `recover` ppm/s, of a call
/// admitted as `seen` says (`None`: a report that does not say): the new state when
/// it cuts the factor, `None` when nothing changes. It cuts nothing when `blocked`
/// (a 429 block was in force, so the 429 was predicted), when the last cut is less
/// than [`CUT_EVERY`] old, or when a cut was made since the call's admission (its
/// 429 says nothing of the rate after that cut).
pub fn cut(
    r: Option<LearnedRate>,
    recover: u32,
    blocked: bool,
    seen: Option<AdmittedRate>,
    now: Duration,
) -> Option<LearnedRate> {
    let r = r.map(|r| r.redated(now));
    if recover == 0
        || blocked
        || r.is_some_and(|r| {
            now.saturating_sub(r.at) < CUT_EVERY || seen.is_some_and(|s| s.cut_since(&r))
        })
    {
        return None;
    }
    let f = factor(r, recover, now);
    let ppm = (u64::from(f) * u64::from(CUT_NUM) / u64::from(CUT_DEN)) as u32;
    Some(LearnedRate {
        ppm: ppm.max(FLOOR_PPM),
        at: now,
    })
}

/// `limit` scaled by `ppm` (rounded down, at least 1).
pub fn scale(limit: u64, ppm: u32) -> u64 {
    ((u128::from(limit) * u128::from(ppm) / u128::from(PPM_WHOLE)) as u64).max(1)
}

impl QuotaParams {
    /// These parameters with every per-minute limit scaled by `ppm` (a learned
    /// factor below the whole; per-day limits are left alone: a per-second rule's
    /// 429 says nothing about a day).
    pub fn scaled(&self, ppm: u32) -> QuotaParams {
        if ppm >= PPM_WHOLE {
            return *self;
        }
        let s = |l: Option<u64>| l.map(|l| scale(l, ppm));
        QuotaParams {
            tpm: s(self.tpm),
            rpm: s(self.rpm),
            itpm: s(self.itpm),
            otpm: s(self.otpm),
            ..*self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_cut_keeps_seven_tenths_once_per_interval_and_recovery_is_additive() {
        let r = RECOVER_PPM_PER_S;
        let a = cut(None, r, false, None, s(10)).expect("the first 429 cuts");
        assert_eq!(
            a,
            LearnedRate {
                ppm: 700_000,
                at: s(10)
            }
        );
        assert_eq!(
            cut(Some(a), r, false, None, s(10) + ms(999)),
            None,
            "one moment counts once"
        );
        // Recovery: +0.5 % a second from the cut.
        assert_eq!(a.factor(r, s(10) + ms(999)), 704_995);
        assert_eq!(a.factor(r, s(12)), 710_000);
        let b = cut(Some(a), r, false, None, s(12)).expect("a second later it cuts again");
        assert_eq!(b.ppm, 497_000, "0.7 of the recovered factor");
        assert_eq!(b.factor(r, s(12) + s(60)), 797_000);
        assert_eq!(b.factor(r, s(1_000)), PPM_WHOLE, "never above the limit");
        assert_eq!(b.whole_at(r), s(12) + Duration::from_micros(100_600_000));
    }

    #[test]
    fn a_predicted_429_cuts_nothing_and_the_factor_has_a_floor() {
        let r = RECOVER_PPM_PER_S;
        assert_eq!(
            cut(None, r, true, None, s(1)),
            None,
            "blocked: the ledger knew"
        );
        assert_eq!(
            cut(None, 0, false, None, s(1)),
            None,
            "a source that does not learn"
        );
        let mut st = None;
        for i in 0..20 {
            if let Some(n) = cut(st, r, false, None, s(2 * i)) {
                st = Some(n);
            }
        }
        assert_eq!(st.unwrap().ppm, FLOOR_PPM);
    }

    #[test]
    fn a_429_cuts_only_when_its_call_was_admitted_under_the_last_cut() {
        let r = RECOVER_PPM_PER_S;
        let before = AdmittedRate::WHOLE; // admitted while nothing was cut
        let a = cut(None, r, false, Some(before), s(10)).expect("the first 429 cuts");
        // Two seconds later, a slow response of a call sent before that cut.
        assert_eq!(
            cut(Some(a), r, false, Some(before), s(12)),
            None,
            "a call admitted before the last cut"
        );
        let under = AdmittedRate {
            ppm: a.factor(r, s(11)),
            cut: SeenCut::At(a.at),
        };
        assert_eq!(
            cut(Some(a), r, false, Some(under), s(12)).map(|c| c.ppm),
            Some(497_000),
            "a call admitted after the cut cuts again (0.7 of 0.71)"
        );
        assert_eq!(
            cut(Some(a), r, false, None, s(12)).map(|c| c.ppm),
            Some(497_000),
            "a report that does not say what its admission saw cuts as before"
        );
        assert_eq!(
            cut(Some(a), r, false, Some(before.foreign()), s(12)).map(|c| c.ppm),
            Some(497_000),
            "admitted by another ledger (its dates on another clock): cuts as before"
        );
        assert!(
            cut(None, r, false, Some(under), s(12)).is_some(),
            "no cut remembered (the state was dropped): none since the admission"
        );
    }

    #[test]
    fn a_cut_dated_ahead_of_the_clock_is_redated_now() {
        let r = RECOVER_PPM_PER_S;
        let ahead = LearnedRate {
            ppm: 700_000,
            at: s(100),
        };
        let here = ahead.redated(s(40));
        assert_eq!(here.at, s(40), "dated now, not 60 s from now");
        assert_eq!(here.factor(r, s(42)), 710_000, "it recovers from now");
        assert_eq!(ahead.redated(s(200)), ahead, "a cut in the past stays");
        assert_eq!(
            cut(Some(ahead), r, false, None, s(40)),
            None,
            "now is the cut's moment"
        );
        assert_eq!(
            cut(Some(here), r, false, None, s(41)).map(|c| c.ppm),
            Some(493_500),
            "a second after the re-dating it cuts again (0.7 of 0.705)"
        );
    }

    #[test]
    fn scaling_cuts_the_per_minute_limits_only_and_keeps_at_least_one() {
        let q = QuotaParams {
            tpm: Some(6_000),
            rpm: Some(1),
            tpd: Some(100),
            ..QuotaParams::default()
        };
        let h = q.scaled(500_000);
        assert_eq!((h.tpm, h.rpm, h.tpd), (Some(3_000), Some(1), Some(100)));
        assert_eq!(q.scaled(PPM_WHOLE), q);
        assert_eq!(scale(1_000_000_000_000, 999_999), 999_999_000_000);
    }
}
