//! The quota's buckets (§7, §7a): the kinds ([`BUCKETS`]: what each counts and over
//! which period), one configured bucket's numbers ([`Shape`]) and one bucket's state
//! ([`Level`]), the arithmetic every quota operation is made of.
//!
//! A bucket is stored as the instant it would be full again if nothing more were
//! taken (`full_at`, a "theoretical arrival time"), not as a level: the level at `now`
//! is `capacity − (full_at − now) × rate`. Taking `n` moves `full_at` forward by the
//! time `n` takes to refill, giving back moves it back (never before `now`: a bucket
//! holds at most its capacity), and the debt floor of −capacity is `full_at ≤ now +
//! 2 × refill time of a full bucket`. Every quantity is then a time, which is what
//! the Redis script keeps as integer microseconds (no float text), and "how long
//! until `need` fits" is one subtraction. §7a in one place ([`Shape`]): a per-minute
//! bucket holds `limit × burst / 60 s` (at least 1), refills `limit` per minute and
//! may go into debt down to −`limit`; a per-day bucket holds and refills a day's
//! worth. With every §7a key at its default each bucket is exactly the §7 one.
//!
//! Its own module because it is the one place the time arithmetic lives: the
//! operations ([`super::Quota`]), §18 corrections and the §10 drain only call it.

use std::time::Duration;

use super::params::Tokens;

/// The refill period of every per-minute bucket: its limit refills in this long.
pub const MINUTE: Duration = Duration::from_secs(60);

/// The refill period of a per-day bucket (§7a).
pub const DAY: Duration = Duration::from_secs(24 * 3600);

/// What a bucket counts, and so how much of a reservation it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counts {
    /// Tokens (`tpm`, `tpd`): the reservation's total.
    Tokens,
    /// Requests (`rpm`, `rpd`): one per reservation.
    Requests,
    /// Input tokens (`itpm`).
    Input,
    /// Output tokens (`otpm`).
    Output,
}

/// The kinds of bucket, in the order [`Quota`](super::Quota) stores them and the
/// Redis script lists them (`gate.lua` `QB`): what each counts and its refill
/// period.
pub const BUCKETS: [(Bucket, Counts, Duration); 6] = [
    (Bucket::Tpm, Counts::Tokens, MINUTE),
    (Bucket::Rpm, Counts::Requests, MINUTE),
    (Bucket::Itpm, Counts::Input, MINUTE),
    (Bucket::Otpm, Counts::Output, MINUTE),
    (Bucket::Tpd, Counts::Tokens, DAY),
    (Bucket::Rpd, Counts::Requests, DAY),
];

/// The name of each bucket kind (its config key; status and metrics show it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    /// Tokens per minute.
    Tpm,
    /// Requests per minute.
    Rpm,
    /// Input tokens per minute.
    Itpm,
    /// Output tokens per minute.
    Otpm,
    /// Tokens per day.
    Tpd,
    /// Requests per day.
    Rpd,
}

impl Bucket {
    /// The config key (`tpm`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            Bucket::Tpm => "tpm",
            Bucket::Rpm => "rpm",
            Bucket::Itpm => "itpm",
            Bucket::Otpm => "otpm",
            Bucket::Tpd => "tpd",
            Bucket::Rpd => "rpd",
        }
    }
}

impl Counts {
    /// This bucket's share of a reservation.
    pub fn amount(self, t: Tokens) -> u64 {
        match self {
            Counts::Tokens => t.total,
            Counts::Requests => 1,
            Counts::Input => t.input,
            Counts::Output => t.output,
        }
    }
}

/// One configured bucket's numbers (§7a): `limit` per `period` refill, `capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// The configured limit: what refills in one period.
    pub limit: u64,
    /// The refill period (a minute or a day).
    pub period: Duration,
    /// What a full bucket holds: a per-minute bucket `max(1, floor(limit × burst /
    /// 60 s))` (burst in whole µs, as the script computes it), a per-day one its
    /// limit.
    pub capacity: u64,
}

impl Shape {
    /// Nanoseconds `amount` takes to refill, rounded up (a debit is never smaller
    /// than its amount).
    pub fn refill_ns(&self, amount: u64) -> u128 {
        let limit = self.limit.max(1);
        match self.product_ns(amount) {
            Some(x) => x.div_ceil(limit) as u128,
            None => (amount as u128 * self.period.as_nanos()).div_ceil(limit as u128),
        }
    }

    /// `amount × period` in u64 nanoseconds when it fits (the common case: a u128
    /// division is a library call, and the hot path makes several per call, §16).
    fn product_ns(&self, amount: u64) -> Option<u64> {
        u64::try_from(self.period.as_nanos())
            .ok()
            .and_then(|p| amount.checked_mul(p))
    }

    /// Nanoseconds `amount` takes to refill, rounded down (a credit is never larger).
    pub fn back_ns(&self, amount: u64) -> u128 {
        let limit = self.limit.max(1);
        match self.product_ns(amount) {
            Some(x) => (x / limit) as u128,
            None => amount as u128 * self.period.as_nanos() / limit as u128,
        }
    }

    /// The deepest deficit: a level of −limit (§7: one absurd count delays later
    /// admissions by at most one more period of refill).
    pub fn floor_ns(&self) -> u128 {
        self.refill_ns(self.capacity + self.limit)
    }

    /// Refill per second (status).
    pub fn refill_per_s(&self) -> f64 {
        self.limit as f64 / self.period.as_secs_f64()
    }
}

/// One bucket's state: full again at `full_at` (a time on the backend's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Level {
    /// When the bucket is full again if nothing more is taken; at or before `now`
    /// means full.
    pub(super) full_at: Duration,
}

pub(super) fn dur(ns: u128) -> Duration {
    Duration::from_nanos(ns.min(u64::MAX as u128) as u64)
}

impl Level {
    /// Taken time: how long until full, at `now`.
    pub(super) fn deficit(&self, now: Duration) -> u128 {
        self.full_at.saturating_sub(now).as_nanos()
    }

    /// Time until the level reaches `need` (capped at the capacity: a reservation
    /// larger than the bucket fits a full bucket). Never zero while it has not: a
    /// wait that rounds to nothing would let a reservation through below `need`.
    pub(super) fn wait_for(&self, s: &Shape, need: u64, now: Duration) -> Duration {
        let room = s.refill_ns(s.capacity - need.min(s.capacity)); // deficit allowed
        let wait = self.deficit(now).saturating_sub(room);
        if wait == 0 {
            Duration::ZERO
        } else {
            dur(wait).max(Duration::from_micros(1))
        }
    }

    /// Take `amount`, keeping the level ≥ −limit.
    pub(super) fn debit(&mut self, s: &Shape, amount: u64, now: Duration) {
        self.debit_at_most(s, amount, u128::MAX, now)
    }

    /// Take `amount`, but no more than `most` ns of refill time (§12: a settlement's
    /// extra debit), keeping the level ≥ −limit.
    pub(super) fn debit_at_most(&mut self, s: &Shape, amount: u64, most: u128, now: Duration) {
        let deficit = (self.deficit(now) + s.refill_ns(amount).min(most)).min(s.floor_ns());
        self.full_at = now + dur(deficit);
    }

    /// Add `amount` (negative: a debit of at most `most` ns of refill time),
    /// converted to refill time at `at`'s limit (§18 `learn_rate`: the limit in force
    /// when the reservation settled was taken; `s` itself otherwise), keeping −limit
    /// ≤ level ≤ capacity of `s` (the limit in force now).
    pub(super) fn add_at(
        &mut self,
        s: &Shape,
        at: &Shape,
        amount: i128,
        most: u128,
        now: Duration,
    ) {
        let n = amount.unsigned_abs().min(u64::MAX as u128) as u64;
        let deficit = self.deficit(now);
        let next = if amount >= 0 {
            deficit.saturating_sub(at.back_ns(n))
        } else {
            (deficit + at.refill_ns(n).min(most)).min(s.floor_ns())
        };
        self.full_at = now + dur(next);
    }

    /// The level at `now` (negative: debt), for status.
    pub(super) fn level(&self, s: &Shape, now: Duration) -> f64 {
        s.capacity as f64 - self.deficit(now) as f64 * s.limit as f64 / s.period.as_nanos() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refill_arithmetic_takes_the_u64_path_only_when_it_is_exact() {
        // The u64 fast path must give the u128 formula's answer, at both edges of
        // u64 and past them (huge limits, day periods, absurd amounts).
        let periods = [
            Duration::from_secs(60),
            Duration::from_secs(86_400),
            Duration::from_nanos(1),
        ];
        let limits = [1u64, 7, 60, 1_000_000, 1 << 40, u64::MAX];
        let amounts = [
            0u64,
            1,
            3,
            59,
            1_000_000_007,
            u64::MAX / 86_400_000_000_000,
            u64::MAX,
        ];
        for &period in &periods {
            for &limit in &limits {
                for &amount in &amounts {
                    let s = Shape {
                        limit,
                        period,
                        capacity: limit,
                    };
                    let wide = amount as u128 * period.as_nanos();
                    assert_eq!(
                        s.refill_ns(amount),
                        wide.div_ceil(limit as u128),
                        "{s:?} {amount}"
                    );
                    assert_eq!(s.back_ns(amount), wide / limit as u128, "{s:?} {amount}");
                }
            }
        }
    }
}
