//! A tenant's ledger (§19): the second ledger of gate 3, beside the source's quota.
//! Plain data; `now` (the backend's monotonic clock) and `wall` (its UTC time, for
//! the calendar windows of dollar budgets) are passed in. The Redis backend keeps the
//! same rules in `gate.lua` ("tenants").
//!
//! A tenant has, in a scope, up to four continuously refilled buckets (`tpm`, `rpm`,
//! `tpd`, `rpd`: the §7 / §7a rules exactly, kept in a [`Quota`]) and up to two dollar
//! budgets that do **not** refill: what was spent in the current UTC day and month
//! ([`Window`]), reset when the window changes. Admission takes the reservation's
//! tokens, one request and its estimated cost, in the same atomic step as the
//! source's (both or neither); settlement follows §7's table for both ledgers: a
//! success (or a non-transient failure) is charged its reported usage and the cost of
//! it, a transient failure or a 429 gives the tokens and the cost back, a cancellation
//! everything; an abandoned permit keeps its estimate. A tenant's tokens are always
//! charged as used (`tokens_charged = "estimate"` is a source's provider rule, not the
//! tenant's bill).
//!
//! Money is integer nano-dollars (n$) everywhere. A call's cost is reserved from its
//! estimate and settled from its usage in the window it was admitted in: a settlement
//! that arrives after that window ended changes nothing (the old window is gone; the
//! new one owes nothing for it).

use std::time::Duration;

use super::quota::{Bucket, Quota, QuotaParams, Settlement, Split, Tokens};

/// Seconds in a UTC day.
const DAY_S: u64 = 86_400;

/// A tenant's limits in one scope, as the gate applies them (config: `TenantLimits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantParams {
    /// The token and request buckets (`tpm`, `rpm`, `tpd`, `rpd`; the other keys at
    /// their defaults, `max_debt` as the sources').
    pub q: QuotaParams,
    /// Dollars per UTC day, n$.
    pub usd_per_day: Option<u64>,
    /// Dollars per UTC month, n$.
    pub usd_per_month: Option<u64>,
}

impl TenantParams {
    /// `true` when no limit is set: the tenant is tracked (spend, fair turns) and
    /// never refused.
    pub fn unlimited(&self) -> bool {
        self.q.tpm.is_none()
            && self.q.rpm.is_none()
            && self.q.tpd.is_none()
            && self.q.rpd.is_none()
            && self.usd_per_day.is_none()
            && self.usd_per_month.is_none()
    }

    /// §10: every limit cut to `share` of itself (at least 1; a degraded host's
    /// share of the fleet's tenant limits).
    pub fn share(&self, share: f64) -> TenantParams {
        if share.is_nan() || share >= 1.0 {
            return *self;
        }
        let cut = |l: Option<u64>| l.map(|l| ((l as f64 * share.max(0.0)) as u64).max(1));
        TenantParams {
            q: self.q.share(share),
            usd_per_day: cut(self.usd_per_day),
            usd_per_month: cut(self.usd_per_month),
        }
    }
}

/// Which of a tenant's limits refused (`Reply::TenantLimited` names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantLimit {
    /// Tokens per minute.
    Tpm,
    /// Requests per minute.
    Rpm,
    /// Tokens per day.
    Tpd,
    /// Requests per day.
    Rpd,
    /// Dollars per UTC day.
    UsdPerDay,
    /// Dollars per UTC month.
    UsdPerMonth,
}

impl TenantLimit {
    /// The config key, as the wire and status name it.
    pub const fn as_str(self) -> &'static str {
        match self {
            TenantLimit::Tpm => "tpm",
            TenantLimit::Rpm => "rpm",
            TenantLimit::Tpd => "tpd",
            TenantLimit::Rpd => "rpd",
            TenantLimit::UsdPerDay => "usd_per_day",
            TenantLimit::UsdPerMonth => "usd_per_month",
        }
    }

    /// A dollar budget: it does not refill, so no call waits on it (§19).
    pub const fn is_budget(self) -> bool {
        matches!(self, TenantLimit::UsdPerDay | TenantLimit::UsdPerMonth)
    }

    /// The limit of a quota bucket (only the four a tenant has).
    fn of(b: Bucket) -> Self {
        match b {
            Bucket::Tpm => TenantLimit::Tpm,
            Bucket::Rpm => TenantLimit::Rpm,
            Bucket::Tpd => TenantLimit::Tpd,
            _ => TenantLimit::Rpd,
        }
    }

    /// Parses [`TenantLimit::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        [
            TenantLimit::Tpm,
            TenantLimit::Rpm,
            TenantLimit::Tpd,
            TenantLimit::Rpd,
            TenantLimit::UsdPerDay,
            TenantLimit::UsdPerMonth,
        ]
        .into_iter()
        .find(|l| l.as_str() == s)
    }
}

/// What one admission charges a tenant: the source's reservation and its cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    /// Tokens reserved (total, input, output).
    pub tokens: Tokens,
    /// Estimated cost, n$.
    pub cost: u64,
}

/// A source's prices (§19), in n$ per token (dollars per million × 1000).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Prices {
    /// Per input token (input excluding cached reads).
    pub input: f64,
    /// Per output token.
    pub output: f64,
    /// Per cached input read.
    pub cached: f64,
}

impl Prices {
    /// From dollars per million tokens (`None` = free; the cached price defaults to
    /// the input price).
    pub fn per_million(input: Option<f64>, output: Option<f64>, cached: Option<f64>) -> Self {
        let n = |p: Option<f64>| p.unwrap_or(0.0) * 1e3;
        Prices {
            input: n(input),
            output: n(output),
            cached: n(cached.or(input)),
        }
    }

    /// `true` for a free source (no price configured).
    pub fn free(&self) -> bool {
        self.input == 0.0 && self.output == 0.0 && self.cached == 0.0
    }

    /// The cost, n$ rounded up, of `input` input tokens, `cached` cached reads and
    /// `output` output tokens.
    pub fn cost(&self, input: u64, cached: u64, output: u64) -> u64 {
        let c =
            input as f64 * self.input + cached as f64 * self.cached + output as f64 * self.output;
        if c.is_finite() {
            c.max(0.0).ceil().min(u64::MAX as f64) as u64
        } else {
            u64::MAX
        }
    }

    /// The estimated cost of a reservation: its input and output parts at their
    /// prices, or, with neither part, its total priced as input; at a priced source
    /// at least 1 n$, so that a call estimated at no tokens (a source without `tpm`
    /// estimates 0 by default) is still refused by a spent dollar budget (§19).
    pub fn estimate(&self, t: Tokens) -> u64 {
        let c = if t.input == 0 && t.output == 0 {
            self.cost(t.total, 0, 0)
        } else {
            self.cost(t.input, 0, t.output)
        };
        if self.free() {
            c
        } else {
            c.max(1)
        }
    }

    /// The cost a settlement charges: the reported split (a total without a split is
    /// priced as input), `cached` reads at the cached price; nothing for a refund.
    pub fn settled(&self, how: Settlement, cached: u64) -> u64 {
        match how {
            Settlement::Charge {
                split: Some(Split { input, output }),
                ..
            } => self.cost(input, cached, output),
            Settlement::Charge {
                tokens,
                split: None,
            } => self.cost(tokens, cached, 0),
            Settlement::RefundTokens | Settlement::RefundAll => 0,
        }
    }
}

/// UTC calendar windows of a day number (days since 1970-01-01).
pub mod calendar {
    /// The day number of unix time `s`.
    pub fn day_of(s: u64) -> u32 {
        (s / super::DAY_S) as u32
    }

    /// (year, month 1–12) of day number `d` (Howard Hinnant's `civil_from_days`).
    pub fn civil(d: u32) -> (i64, u32) {
        let z = i64::from(d) + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let y = yoe + era * 400 + i64::from(m <= 2);
        (y, m)
    }

    /// The day number of the first day of (year, month) (`days_from_civil`).
    pub fn first_day(y: i64, m: u32) -> u32 {
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let mp = i64::from(if m > 2 { m - 3 } else { m + 9 });
        let doy = (153 * mp + 2) / 5;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        (era * 146_097 + doe - 719_468) as u32
    }

    /// The month number (months since 1970-01) of day number `d`.
    pub fn month_of(d: u32) -> u32 {
        let (y, m) = civil(d);
        ((y - 1970) * 12 + i64::from(m) - 1) as u32
    }

    /// Unix seconds at which the month containing day `d` ends.
    pub fn month_end_s(d: u32) -> u64 {
        let (y, m) = civil(d);
        let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
        u64::from(first_day(ny, nm)) * super::DAY_S
    }

    /// Unix seconds at which day `d` ends.
    pub fn day_end_s(d: u32) -> u64 {
        (u64::from(d) + 1) * super::DAY_S
    }
}

/// Spend in one calendar window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Window {
    /// The window: a day number (day windows) or a month number (month windows).
    pub id: u32,
    /// Spent in it, n$ (reservations of calls in flight included).
    pub spent: u64,
}

impl Window {
    /// Spent in window `id` (0 when this window is an older one).
    fn spent_in(&self, id: u32) -> u64 {
        if self.id == id {
            self.spent
        } else {
            0
        }
    }

    /// Add `n` n$ to window `id` (starting it afresh when it is a newer one).
    fn add(&mut self, id: u32, n: u64) {
        if self.id != id {
            if id < self.id {
                return; // an older window's charge: it is gone
            }
            *self = Window { id, spent: 0 };
        }
        self.spent = self.spent.saturating_add(n);
    }

    /// Give `n` n$ back to window `id`, only while it is still the current one.
    fn give_back(&mut self, id: u32, n: u64) {
        if self.id == id {
            self.spent = self.spent.saturating_sub(n);
        }
    }
}

/// A refusal by the tenant's ledger.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusal {
    /// The limit that refused (the longest wait's, a dollar budget before a bucket).
    pub limit: TenantLimit,
    /// §6: how long until this reservation certainly fits: the bucket's refill, or
    /// the end of the budget's window. Never zero.
    pub retry_after: Duration,
}

/// One tenant's ledger in one scope.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Ledger {
    /// `tpm`, `rpm`, `tpd`, `rpd` (§7 buckets; the others stay unset).
    quota: Quota,
    /// Spend in the current UTC day.
    day: Window,
    /// Spend in the current UTC month.
    month: Window,
    /// Reservations not yet settled (calls in flight): a ledger with any is never
    /// idle, and after a run with nothing in flight it must read 0 (no leaked hold).
    in_flight: u32,
}

/// A ledger for status.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LedgerView {
    /// Levels of `tpm`, `rpm`, `tpd`, `rpd` (`None`: not limited).
    pub levels: [Option<f64>; 4],
    /// Spent today (UTC), n$.
    pub spent_day: u64,
    /// Spent this month (UTC), n$.
    pub spent_month: u64,
    /// Reservations not yet settled.
    pub in_flight: u32,
}

/// The buckets a tenant has, in [`LedgerView::levels`] order, with their index in
/// the quota's bucket list.
pub const TENANT_BUCKETS: [Bucket; 4] = [Bucket::Tpm, Bucket::Rpm, Bucket::Tpd, Bucket::Rpd];

impl Ledger {
    /// Could `c` be taken at `now` (`wall`: unix seconds)? `None` = yes; otherwise
    /// which limit refuses and until when. A dollar budget refuses when spent plus
    /// the estimate passes it (a call estimated above the whole budget is refused
    /// too: a budget is never overspent by an admission, only by usage above an
    /// estimate), until its window ends; a bucket as §7 says.
    pub fn check(&self, p: &TenantParams, c: Charge, now: Duration, wall: u64) -> Option<Refusal> {
        let today = calendar::day_of(wall);
        let month = calendar::month_of(today);
        let over = |budget: Option<u64>, spent: u64| {
            budget.is_some_and(|b| c.cost > 0 && spent.saturating_add(c.cost) > b)
        };
        // Past the end of the window, never zero.
        let until = |end_s: u64| Duration::from_secs(end_s.saturating_sub(wall).max(1));
        if over(p.usd_per_month, self.month.spent_in(month)) {
            return Some(Refusal {
                limit: TenantLimit::UsdPerMonth,
                retry_after: until(calendar::month_end_s(today)),
            });
        }
        if over(p.usd_per_day, self.day.spent_in(today)) {
            return Some(Refusal {
                limit: TenantLimit::UsdPerDay,
                retry_after: until(calendar::day_end_s(today)),
            });
        }
        self.quota
            .refusing(&p.q, c.tokens, now)
            .map(|(b, retry_after)| Refusal {
                limit: TenantLimit::of(b),
                retry_after,
            })
    }

    /// Take `c` (after [`Ledger::check`] said yes, under the same lock); returns the
    /// day number the reservation's cost was charged to (settlement needs it).
    pub fn take(&mut self, p: &TenantParams, c: Charge, now: Duration, wall: u64) -> u32 {
        let today = calendar::day_of(wall);
        let reserved = self.quota.reserve(&p.q, c.tokens, now);
        debug_assert!(matches!(reserved, super::quota::Reserve::Reserved));
        // A window is kept only under its budget (as `gate.lua` does): a tenant
        // without one has nothing to forget and is idle as soon as its buckets are.
        if p.usd_per_day.is_some() {
            self.day.add(today, c.cost);
        }
        if p.usd_per_month.is_some() {
            self.month.add(calendar::month_of(today), c.cost);
        }
        self.in_flight = self.in_flight.saturating_add(1);
        today
    }

    /// Settle a reservation `c` charged to day `day`: the buckets by `how` (§7), the
    /// dollar windows by the difference between the estimate and `cost` (what the
    /// settlement charges; the estimate itself for an abandoned permit), each only
    /// while the window it was charged to is still the current one.
    pub fn settle(
        &mut self,
        p: &TenantParams,
        c: Charge,
        how: Settlement,
        cost: u64,
        day: u32,
        now: Duration,
    ) {
        self.quota.settle(&p.q, c.tokens, how, now);
        let month = calendar::month_of(day);
        if cost <= c.cost {
            self.day.give_back(day, c.cost - cost);
            self.month.give_back(month, c.cost - cost);
        } else {
            let more = cost - c.cost;
            if self.day.id == day && p.usd_per_day.is_some() {
                self.day.add(day, more);
            }
            if self.month.id == month && p.usd_per_month.is_some() {
                self.month.add(month, more);
            }
        }
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// `true` when forgetting the ledger changes nothing any more: every bucket full,
    /// nothing in flight, nothing spent in the current windows.
    pub fn idle(&self, p: &TenantParams, now: Duration, wall: u64) -> bool {
        let today = calendar::day_of(wall);
        self.in_flight == 0
            && self.day.spent_in(today) == 0
            && self.month.spent_in(calendar::month_of(today)) == 0
            && self.quota.full(&p.q, now)
    }

    /// Reservations not yet settled.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The ledger for status.
    pub fn view(&self, p: &TenantParams, now: Duration, wall: u64) -> LedgerView {
        let today = calendar::day_of(wall);
        let v = self.quota.view(&p.q, now);
        LedgerView {
            levels: TENANT_BUCKETS.map(|b| v.levels[b as usize]),
            spent_day: self.day.spent_in(today),
            spent_month: self.month.spent_in(calendar::month_of(today)),
            in_flight: self.in_flight,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_round_trips_and_knows_month_lengths() {
        // 2026-12-06 is day 20428; December 2026 ends at 2027-01-01.
        let d = calendar::day_of(1_796_601_600);
        assert_eq!(calendar::civil(d), (2026, 12));
        assert_eq!(calendar::month_end_s(d), 1_798_761_600);
        assert_eq!(
            calendar::first_day(2024, 2) + 29,
            calendar::first_day(2024, 3)
        );
        assert_eq!(
            calendar::first_day(2025, 2) + 28,
            calendar::first_day(2025, 3)
        );
        assert_eq!(calendar::first_day(1970, 1), 0);
        for d in (0..60_000u32).step_by(13) {
            let (y, m) = calendar::civil(d);
            let f = calendar::first_day(y, m);
            assert!(f <= d && d < (calendar::month_end_s(d) / DAY_S) as u32);
            assert_eq!(calendar::civil(f), (y, m));
        }
    }

    fn budget(day: u64) -> TenantParams {
        TenantParams {
            usd_per_day: Some(day),
            ..TenantParams::default()
        }
    }

    #[test]
    fn a_dollar_budget_refuses_past_it_until_the_day_ends_and_settles_to_the_usage() {
        let p = budget(1_000);
        let mut l = Ledger::default();
        let now = Duration::ZERO;
        let wall = 10 * DAY_S + 3600; // 01:00 UTC
        let c = Charge {
            tokens: Tokens::from(10),
            cost: 600,
        };
        assert_eq!(l.check(&p, c, now, wall), None);
        let day = l.take(&p, c, now, wall);
        // 600 spent: another 600 would pass 1000.
        let r = l.check(&p, c, now, wall).expect("refused");
        assert_eq!(r.limit, TenantLimit::UsdPerDay);
        assert_eq!(r.retry_after, Duration::from_secs(23 * 3600));
        // The usage cost 100: 500 go back, and the next fits.
        l.settle(&p, c, Settlement::charge(10), 100, day, now);
        assert_eq!(l.view(&p, now, wall).spent_day, 100);
        assert_eq!(l.check(&p, c, now, wall), None);
        // A call estimated above the whole budget never fits.
        let huge = Charge { cost: 1_001, ..c };
        assert!(Ledger::default().check(&p, huge, now, wall).is_some());
        // The next day starts afresh.
        assert_eq!(l.check(&p, c, now, wall + DAY_S), None);
        assert!(!l.idle(&p, now, wall));
        assert!(l.idle(&p, now, wall + DAY_S));
    }

    #[test]
    fn a_settlement_after_its_window_ended_changes_nothing() {
        let p = budget(1_000);
        let mut l = Ledger::default();
        let c = Charge {
            tokens: Tokens::from(1),
            cost: 400,
        };
        let wall = 5 * DAY_S + 100;
        let day = l.take(&p, c, Duration::ZERO, wall);
        let next = wall + DAY_S;
        let c2 = l.take(&p, c, Duration::ZERO, next);
        l.settle(&p, c, Settlement::RefundAll, 0, day, Duration::ZERO);
        assert_eq!(
            l.view(&p, Duration::ZERO, next).spent_day,
            400,
            "the new day keeps its own"
        );
        l.settle(&p, c, Settlement::RefundAll, 0, c2, Duration::ZERO);
        assert_eq!(l.view(&p, Duration::ZERO, next).spent_day, 0);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn a_token_bucket_refuses_like_a_source_quota() {
        let p = TenantParams {
            q: QuotaParams {
                tpm: Some(100),
                ..QuotaParams::default()
            },
            ..TenantParams::default()
        };
        let mut l = Ledger::default();
        let now = Duration::from_secs(1);
        let c = Charge {
            tokens: Tokens::from(80),
            cost: 0,
        };
        l.take(&p, c, now, 0);
        let r = l.check(&p, c, now, 0).expect("refused");
        assert_eq!(r.limit, TenantLimit::Tpm);
        // 60 tokens short at 100/min: 36 s.
        assert!((r.retry_after.as_secs_f64() - 36.0).abs() < 0.01, "{r:?}");
        assert!(!r.limit.is_budget());
    }

    #[test]
    fn prices_charge_the_split_and_cached_reads() {
        let pr = Prices::per_million(Some(2.5), Some(10.0), Some(1.25));
        // 1000 input at $2.50/M = 2500 n$·1000... in n$: 1000 × 2500 = 2.5e6.
        assert_eq!(pr.cost(1000, 0, 0), 2_500_000);
        assert_eq!(pr.cost(0, 1000, 0), 1_250_000);
        assert_eq!(pr.cost(0, 0, 1000), 10_000_000);
        let t = Tokens {
            total: 300,
            input: 200,
            output: 100,
        };
        assert_eq!(pr.estimate(t), 200 * 2500 + 100 * 10_000);
        assert_eq!(pr.estimate(Tokens::from(40)), 40 * 2500);
        assert_eq!(pr.settled(Settlement::charge(40), 0), 40 * 2500);
        assert_eq!(pr.settled(Settlement::RefundTokens, 9), 0);
        assert!(Prices::per_million(None, None, None).free());
        // A call estimated at no tokens reserves 1 n$ at a priced source (a spent
        // budget refuses it), nothing at a free one.
        assert_eq!(pr.estimate(Tokens::from(0)), 1);
        assert_eq!(
            Prices::per_million(None, None, None).estimate(Tokens::from(0)),
            0
        );
        assert_eq!(Prices::per_million(Some(1.0), None, None).cached, 1000.0);
    }
}
