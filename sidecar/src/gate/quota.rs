//! The quota gate (§7, §7a): continuously refilled buckets per source (tokens,
//! requests, input and output tokens per minute; tokens and requests per day) and a
//! 429 block. Plain data; `now` is passed in. The Redis
//! backend implements the same rules in `gate.lua` (see `backend/mod.rs`).
//!
//! A bucket is stored as the instant it would be full again if nothing more were
//! taken (`full_at`, a "theoretical arrival time"), not as a level: the level at `now`
//! is `capacity − (full_at − now) × rate`. Taking `n` moves `full_at` forward by the
//! time `n` takes to refill, giving back moves it back (never before `now`: a bucket
//! holds at most its capacity), and the debt floor of −capacity is `full_at ≤ now +
//! 2 × refill time of a full bucket`. Every quantity is then a time, which is what
//! the Redis script keeps as integer microseconds (no float text), and "how long
//! until `need` fits" is one subtraction. The buckets are a list ([`BUCKETS`]): each
//! kind says what it counts and over which period; [`QuotaParams::limit`] says
//! whether it is configured. §7a in one place ([`Shape`]): a per-minute bucket
//! holds `limit × burst / 60 s` (at least 1), refills `limit` per minute and may go
//! into debt down to −`limit`; a per-day bucket holds and refills a day's worth. With
//! every §7a key at its default each bucket is exactly the §7 one.
//!
//! The quota's vocabulary lives here too ([`QuotaParams`], [`Reserve`],
//! [`Settlement`]): every backend speaks it, and none of it depends on a backend.

use std::borrow::Cow;
use std::time::Duration;

use super::observed::{LastSeen, Observation, Seen, DIMS};

/// Quota parameters of a source (§7, §7a). `None` disables that bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaParams {
    /// Tokens per minute.
    pub tpm: Option<u64>,
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// §7a: input tokens per minute (Anthropic ITPM).
    pub itpm: Option<u64>,
    /// §7a: output tokens per minute (Anthropic OTPM).
    pub otpm: Option<u64>,
    /// §7a: tokens per day.
    pub tpd: Option<u64>,
    /// §7a: requests per day.
    pub rpd: Option<u64>,
    /// §7a: a per-minute bucket holds `limit × burst / 60 s` (≤ 60 s).
    pub burst: Duration,
    /// §7a `tokens_charged = "estimate"`: the reservation is the charge, whatever
    /// usage is reported (refunds of §7 still apply).
    pub charge_estimate: bool,
    /// §12: the extra debit one settlement makes (usage above the reservation) takes
    /// at most this much refill time from any bucket, per-day ones included
    /// (`sidecar.max_rate_limit_block`), so one report of an absurd token count cannot
    /// block a source for longer than a 429 could.
    pub max_debt: Duration,
    /// §18 `observe_limits`: keep in-flight counts and apply the provider's
    /// rate-limit headers reported with the outcomes (off: a report costs what it
    /// did before §18).
    pub observe: bool,
    /// §18: bit `i` set = the `i`-th of [`BUCKETS`] (tpm, rpm, itpm, otpm) is
    /// `"auto"`: its limit is the provider's, learned from the first response.
    pub auto: u8,
    /// §10 with §18: the share (parts per million) of an `"auto"` bucket's learned
    /// limit this host may use ([`QuotaParams::share`]; configured limits are cut
    /// in place, a learned one only once known). 1,000,000: the whole.
    pub auto_share_ppm: u32,
}

impl Default for QuotaParams {
    fn default() -> Self {
        QuotaParams {
            tpm: None,
            rpm: None,
            itpm: None,
            otpm: None,
            tpd: None,
            rpd: None,
            burst: MINUTE,
            charge_estimate: false,
            max_debt: DEFAULT_MAX_DEBT,
            observe: false,
            auto: 0,
            auto_share_ppm: PPM_WHOLE,
        }
    }
}

/// [`QuotaParams::auto_share_ppm`] of the whole limit.
pub const PPM_WHOLE: u32 = 1_000_000;

/// Default [`QuotaParams::max_debt`]: `sidecar.max_rate_limit_block`'s default.
pub const DEFAULT_MAX_DEBT: Duration = Duration::from_secs(600);

/// A reservation's tokens (§7a): the total for `tpm`/`tpd`, and its input and
/// output parts for `itpm`/`otpm`. A bare count is all input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tokens {
    /// Total tokens.
    pub total: u64,
    /// Input (prompt) tokens.
    pub input: u64,
    /// Output tokens (normally the request's `max_tokens`).
    pub output: u64,
}

impl From<u64> for Tokens {
    fn from(n: u64) -> Self {
        Tokens {
            total: n,
            input: n,
            output: 0,
        }
    }
}

/// Reported input/output usage (§7a; input excludes cached reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Input tokens.
    pub input: u64,
    /// Output tokens.
    pub output: u64,
}

/// Answer of `reserve` (gate 3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reserve {
    /// Tokens and one request were taken.
    Reserved,
    /// Not enough in a bucket, or blocked by a 429; nothing was taken.
    Denied {
        /// §6/§7a: the time until this reservation certainly fits as far as the quota
        /// knows: every bucket holds its share of it (refill after debt) and the 429
        /// block is over, whichever is later (the longest wait over the buckets).
        /// Never zero.
        retry_after: Duration,
    },
}

/// How a reservation is finally settled (§7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    /// The request counted; the token charge becomes `tokens` (refund or extra debit
    /// of the difference from the reservation).
    Charge {
        /// Actual tokens used.
        tokens: u64,
        /// Their input/output parts; `None` splits `tokens` in proportion to the
        /// reservation's parts (§7a).
        split: Option<Split>,
    },
    /// The request counted but used no tokens (transient failure, 429): the token
    /// deposit nets to zero.
    RefundTokens,
    /// Nothing was sent: both the tokens and the request go back.
    RefundAll,
}

impl Settlement {
    /// A charge of `tokens` without a split.
    pub fn charge(tokens: u64) -> Self {
        Settlement::Charge {
            tokens,
            split: None,
        }
    }
}

/// The refill period of every per-minute bucket: its limit refills in this long.
pub const MINUTE: Duration = Duration::from_secs(60);

/// The refill period of a per-day bucket (§7a).
pub const DAY: Duration = Duration::from_secs(24 * 3600);

/// The longest 429 block any backend keeps (7 days; `gate.lua`'s `QMAX_BLOCK`). The
/// engine already cuts a 429's `retry_after` to `max_rate_limit_block` (§7, default
/// 10 min); this only bounds a backend driven directly.
pub const MAX_QUOTA_BLOCK: Duration = Duration::from_secs(7 * 24 * 3600);

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

/// The kinds of bucket, in the order [`Quota`] stores them and the Redis script
/// lists them (`gate.lua` `QB`): what each counts and its refill period.
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

impl QuotaParams {
    /// The limit configured for `b`.
    pub fn limit(&self, b: Bucket) -> Option<u64> {
        match b {
            Bucket::Tpm => self.tpm,
            Bucket::Rpm => self.rpm,
            Bucket::Itpm => self.itpm,
            Bucket::Otpm => self.otpm,
            Bucket::Tpd => self.tpd,
            Bucket::Rpd => self.rpd,
        }
    }

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

    /// `b`'s shape when configured.
    pub fn shape(&self, b: Bucket) -> Option<Shape> {
        let (_, _, period) = BUCKETS[b as usize];
        let limit = self.limit(b)?;
        let capacity = if period == MINUTE && self.burst != MINUTE {
            let burst_us = self.burst.as_micros().min(MINUTE.as_micros());
            ((limit as u128 * burst_us / MINUTE.as_micros()) as u64).max(1)
        } else {
            limit
        };
        Some(Shape {
            limit,
            period,
            capacity,
        })
    }

    /// The credits settling a reservation `r` `how` gives back to the buckets (§7,
    /// §7a); every backend applies exactly these.
    pub fn credits(&self, r: Tokens, how: Settlement) -> Credits {
        let refund = Credits {
            total: r.total as i128,
            input: r.input as i128,
            output: r.output as i128,
            requests: 0,
        };
        match how {
            Settlement::Charge { .. } if self.charge_estimate => Credits::default(),
            Settlement::Charge { tokens, split } => {
                let split = split.unwrap_or_else(|| proportional(tokens, r));
                Credits {
                    total: r.total as i128 - tokens as i128,
                    input: r.input as i128 - split.input as i128,
                    output: r.output as i128 - split.output as i128,
                    requests: 0,
                }
            }
            Settlement::RefundTokens => refund,
            Settlement::RefundAll => Credits {
                requests: 1,
                ..refund
            },
        }
    }
}

/// §7a: `tokens` split in proportion to the reservation's input and output parts
/// (all input when the reservation has neither).
fn proportional(tokens: u64, r: Tokens) -> Split {
    let parts = r.input as u128 + r.output as u128;
    if parts == 0 {
        return Split {
            input: tokens,
            output: 0,
        };
    }
    let input = ((tokens as u128 * r.input as u128 + parts / 2) / parts) as u64;
    Split {
        input,
        output: tokens - input.min(tokens),
    }
}

/// What a settlement gives back to the buckets of each count (negative: an extra
/// debit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Credits {
    /// Total tokens (`tpm`, `tpd`).
    pub total: i128,
    /// Input tokens (`itpm`).
    pub input: i128,
    /// Output tokens (`otpm`).
    pub output: i128,
    /// Requests (`rpm`, `rpd`): 0 or 1.
    pub requests: u8,
}

impl Credits {
    /// The credit of a bucket counting `c`.
    pub fn of(&self, c: Counts) -> i128 {
        match c {
            Counts::Tokens => self.total,
            Counts::Requests => self.requests as i128,
            Counts::Input => self.input,
            Counts::Output => self.output,
        }
    }
}

/// One bucket's state: full again at `full_at` (a time on the backend's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Level {
    /// When the bucket is full again if nothing more is taken; at or before `now`
    /// means full.
    full_at: Duration,
}

fn dur(ns: u128) -> Duration {
    Duration::from_nanos(ns.min(u64::MAX as u128) as u64)
}

impl Level {
    /// Taken time: how long until full, at `now`.
    fn deficit(&self, now: Duration) -> u128 {
        self.full_at.saturating_sub(now).as_nanos()
    }

    /// Time until the level reaches `need` (capped at the capacity: a reservation
    /// larger than the bucket fits a full bucket). Never zero while it has not: a
    /// wait that rounds to nothing would let a reservation through below `need`.
    fn wait_for(&self, s: &Shape, need: u64, now: Duration) -> Duration {
        let room = s.refill_ns(s.capacity - need.min(s.capacity)); // deficit allowed
        let wait = self.deficit(now).saturating_sub(room);
        if wait == 0 {
            Duration::ZERO
        } else {
            dur(wait).max(Duration::from_micros(1))
        }
    }

    /// Take `amount`, keeping the level ≥ −limit.
    fn debit(&mut self, s: &Shape, amount: u64, now: Duration) {
        self.debit_at_most(s, amount, u128::MAX, now)
    }

    /// Take `amount`, but no more than `most` ns of refill time (§12: a settlement's
    /// extra debit), keeping the level ≥ −limit.
    fn debit_at_most(&mut self, s: &Shape, amount: u64, most: u128, now: Duration) {
        let deficit = (self.deficit(now) + s.refill_ns(amount).min(most)).min(s.floor_ns());
        self.full_at = now + dur(deficit);
    }

    /// Give back `amount`, keeping the level ≤ capacity.
    fn credit(&mut self, s: &Shape, amount: u64, now: Duration) {
        self.full_at = now + dur(self.deficit(now).saturating_sub(s.back_ns(amount)));
    }

    /// Add `amount` (negative: a debit of at most `most` ns of refill time).
    fn add(&mut self, s: &Shape, amount: i128, most: u128, now: Duration) {
        let n = amount.unsigned_abs().min(u64::MAX as u128) as u64;
        if amount >= 0 {
            self.credit(s, n, now)
        } else {
            self.debit_at_most(s, n, most, now)
        }
    }

    /// The level at `now` (negative: debt), for status.
    fn level(&self, s: &Shape, now: Duration) -> f64 {
        s.capacity as f64 - self.deficit(now) as f64 * s.limit as f64 / s.period.as_nanos() as f64
    }
}

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
        }
    }

    /// §6/§7: the time until a reservation `t` certainly fits (the longest wait
    /// over the buckets and the block); zero = now.
    pub fn wait(&self, q: &QuotaParams, t: impl Into<Tokens>, now: Duration) -> Duration {
        let q = &*self.eff(q);
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
        let wait = self.wait(q, t, now).max(self.unlearned_wait(q));
        if !wait.is_zero() {
            return Reserve::Denied { retry_after: wait };
        }
        self.track(q, t, true);
        let q = &*self.eff(q);
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

    /// Settle a reservation `reserved`. An extra debit takes at most
    /// [`QuotaParams::max_debt`] of refill time from each bucket (§12).
    pub fn settle(
        &mut self,
        q: &QuotaParams,
        reserved: impl Into<Tokens>,
        how: Settlement,
        now: Duration,
    ) {
        let reserved = reserved.into();
        self.track(q, reserved, false);
        let q = &*self.eff(q);
        let c = q.credits(reserved, how);
        let most = q.max_debt.as_nanos();
        for (i, (b, counts, _)) in BUCKETS.into_iter().enumerate() {
            let credit = c.of(counts);
            match q.shape(b) {
                Some(s) if credit != 0 => self.buckets[i]
                    .get_or_insert(Level { full_at: now })
                    .add(&s, credit, most, now),
                Some(_) => {}
                None => self.buckets[i] = None,
            }
        }
    }

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

    /// 429: block until `now + d` (only moves forward; `d` at most
    /// [`MAX_QUOTA_BLOCK`]).
    pub fn block(&mut self, d: Duration, now: Duration) {
        self.blocked_until = self
            .blocked_until
            .max(now.saturating_add(d.min(MAX_QUOTA_BLOCK)));
    }

    /// Levels for status.
    pub fn view(&self, q: &QuotaParams, now: Duration) -> QuotaView {
        let q = &*self.eff(q);
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

// §15: what the priority classes' reserves and limits read of the buckets
// (gate/classes.rs keeps the per-class side).
impl Quota {
    /// Each configured bucket's deficit at `now` (ns of refill time; 0 = full),
    /// `None` for a disabled bucket, in [`BUCKETS`] order.
    pub fn deficits(&self, q: &QuotaParams, now: Duration) -> [Option<u128>; 6] {
        let q = &*self.eff(q);
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

// §18: limits learned from the provider (gate/observed.rs has the types).
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
    /// `q` with every `"auto"` bucket's limit as learned (`None` until then).
    fn eff<'a>(&self, q: &'a QuotaParams) -> Cow<'a, QuotaParams> {
        if q.auto == 0 {
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
        Cow::Owned(e)
    }

    /// §18: a source with an `"auto"` bucket not learned yet admits one call at a
    /// time: the wait while one is in flight (zero otherwise).
    fn unlearned_wait(&self, q: &QuotaParams) -> Duration {
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
    fn track(&mut self, q: &QuotaParams, t: Tokens, add: bool) {
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
        let e = *self.eff(q);
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

#[cfg(test)]
mod provider_tests {
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

    #[test]
    fn burst_capacity_is_floored_and_at_least_one_and_days_ignore_it() {
        let q = QuotaParams {
            tpm: Some(6_000),
            rpm: Some(30),
            tpd: Some(500),
            burst: Duration::from_secs(1),
            ..QuotaParams::default()
        };
        assert_eq!(q.shape(Bucket::Tpm).unwrap().capacity, 100);
        assert_eq!(
            q.shape(Bucket::Rpm).unwrap().capacity,
            1,
            "0.5 → at least 1"
        );
        assert_eq!(q.shape(Bucket::Tpd).unwrap().capacity, 500);
        assert_eq!(q.shape(Bucket::Itpm), None);
        let d = QuotaParams {
            tpm: Some(6_000),
            ..QuotaParams::default()
        };
        assert_eq!(d.shape(Bucket::Tpm).unwrap().capacity, 6_000, "default: §7");
    }

    #[test]
    fn a_total_splits_in_proportion_and_estimate_charging_credits_nothing() {
        let r = Tokens {
            total: 100,
            input: 75,
            output: 25,
        };
        let q = QuotaParams::default();
        let c = q.credits(r, Settlement::charge(40));
        assert_eq!((c.total, c.input, c.output, c.requests), (60, 45, 15, 0));
        let est = QuotaParams {
            charge_estimate: true,
            ..q
        };
        assert_eq!(est.credits(r, Settlement::charge(40)), Credits::default());
        let c = est.credits(r, Settlement::RefundAll);
        assert_eq!((c.total, c.input, c.output, c.requests), (100, 75, 25, 1));
        assert_eq!(
            proportional(
                7,
                Tokens {
                    total: 0,
                    input: 0,
                    output: 0
                }
            ),
            Split {
                input: 7,
                output: 0
            }
        );
    }
}
