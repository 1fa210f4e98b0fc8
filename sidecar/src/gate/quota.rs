//! The quota gate (§7): continuously refilled buckets per source (tokens per minute,
//! requests per minute) and a 429 block. Plain data; `now` is passed in. The Redis
//! backend implements the same rules in `gate.lua` (see `backend/mod.rs`).
//!
//! A bucket is stored as the instant it would be full again if nothing more were
//! taken (`full_at`, a "theoretical arrival time"), not as a level: the level at `now`
//! is `capacity − (full_at − now) × rate`. Taking `n` moves `full_at` forward by the
//! time `n` takes to refill, giving back moves it back (never before `now`: a bucket
//! holds at most its capacity), and the debt floor of −capacity is `full_at ≤ now +
//! 2 × refill time of a full bucket`. Every quantity is then a time, which is what
//! the Redis script keeps as integer microseconds (no float text), and "how long
//! until `need` fits" is one subtraction. The buckets are a list ([`Quota::buckets`]):
//! a new kind of bucket (§7a) is one more entry with its capacity and its amount.
//!
//! The quota's vocabulary lives here too ([`QuotaParams`], [`Reserve`],
//! [`Settlement`]): every backend speaks it, and none of it depends on a backend.

use std::time::Duration;

/// Quota parameters of a source (§7). `None` disables that bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaParams {
    /// Tokens per minute.
    pub tpm: Option<u64>,
    /// Requests per minute.
    pub rpm: Option<u64>,
}

/// Answer of `reserve` (gate 3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reserve {
    /// Tokens and one request were taken.
    Reserved,
    /// Not enough in a bucket, or blocked by a 429; nothing was taken.
    Denied {
        /// §6: the time until this reservation certainly fits as far as the quota
        /// knows: every bucket holds its share of it (refill after debt) and the 429
        /// block is over, whichever is later. Never zero.
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
    },
    /// The request counted but used no tokens (transient failure, 429): the token
    /// deposit nets to zero.
    RefundTokens,
    /// Nothing was sent: both the tokens and the request go back.
    RefundAll,
}

/// The refill period of every per-minute bucket: its capacity refills in this long.
pub const MINUTE: Duration = Duration::from_secs(60);

/// The longest 429 block any backend keeps (7 days; `gate.lua`'s `QMAX_BLOCK`). The
/// engine already cuts a 429's `retry_after` to `max_rate_limit_block` (§7, default
/// 10 min); this only bounds a backend driven directly.
pub const MAX_QUOTA_BLOCK: Duration = Duration::from_secs(7 * 24 * 3600);

/// What a bucket counts, and so how much of a reservation it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counts {
    /// Tokens (`tpm`): the reservation's token estimate.
    Tokens,
    /// Requests (`rpm`): one per reservation.
    Requests,
}

impl Counts {
    /// This bucket's share of a reservation of `tokens`.
    pub fn amount(self, tokens: u64) -> u64 {
        match self {
            Counts::Tokens => tokens,
            Counts::Requests => 1,
        }
    }
}

impl QuotaParams {
    /// The configured buckets with their capacities, in the order [`Quota`] stores
    /// them (the Redis script lists them in the same order).
    pub fn buckets(&self) -> [(Counts, Option<u64>); 2] {
        [(Counts::Tokens, self.tpm), (Counts::Requests, self.rpm)]
    }
}

/// Nanoseconds `amount` takes to refill in a bucket of `cap` per [`MINUTE`], rounded
/// up (a debit is never smaller than its amount).
fn refill_ns(amount: u64, cap: u64) -> u128 {
    (amount as u128 * MINUTE.as_nanos()).div_ceil(cap.max(1) as u128)
}

/// One bucket: full again at `full_at` (a time on the backend's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bucket {
    /// When the bucket is full again if nothing more is taken; at or before `now`
    /// means full.
    full_at: Duration,
}

fn dur(ns: u128) -> Duration {
    Duration::from_nanos(ns.min(u64::MAX as u128) as u64)
}

impl Bucket {
    /// Taken time: how long until full, at `now`.
    fn deficit(&self, now: Duration) -> u128 {
        self.full_at.saturating_sub(now).as_nanos()
    }

    /// Time until the level reaches `need` (capped at the capacity: a reservation
    /// larger than the bucket fits a full bucket). Never zero while it has not: a
    /// wait that rounds to nothing would let a reservation through below `need`.
    fn wait_for(&self, cap: u64, need: u64, now: Duration) -> Duration {
        let room = refill_ns(cap - need.min(cap), cap); // deficit allowed with `need` fitting
        let wait = self.deficit(now).saturating_sub(room);
        if wait == 0 {
            Duration::ZERO
        } else {
            dur(wait).max(Duration::from_micros(1))
        }
    }

    /// Take `amount`, keeping the level ≥ −capacity.
    fn debit(&mut self, cap: u64, amount: u64, now: Duration) {
        let deficit = (self.deficit(now) + refill_ns(amount, cap)).min(2 * MINUTE.as_nanos());
        self.full_at = now + dur(deficit);
    }

    /// Give back `amount`, keeping the level ≤ capacity.
    fn credit(&mut self, cap: u64, amount: u64, now: Duration) {
        let back = amount as u128 * MINUTE.as_nanos() / cap.max(1) as u128; // rounded down
        self.full_at = now + dur(self.deficit(now).saturating_sub(back));
    }

    /// Add `amount` (negative: debit).
    fn add(&mut self, cap: u64, amount: i128, now: Duration) {
        let n = amount.unsigned_abs().min(u64::MAX as u128) as u64;
        if amount >= 0 {
            self.credit(cap, n, now)
        } else {
            self.debit(cap, n, now)
        }
    }

    /// The level at `now` (negative: debt), for status.
    fn level(&self, cap: u64, now: Duration) -> f64 {
        cap as f64 - self.deficit(now) as f64 * cap as f64 / MINUTE.as_nanos() as f64
    }
}

/// One source's quota state.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    /// One slot per entry of [`QuotaParams::buckets`]; a bucket never used (or
    /// disabled) is `None` and reads as full.
    buckets: [Option<Bucket>; 2],
    /// A 429 `retry_after` blocks reservations until then.
    blocked_until: Duration,
}

/// Quota levels for status.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuotaView {
    /// Token level (negative: debt).
    pub tokens: Option<f64>,
    /// Request level.
    pub requests: Option<f64>,
    /// Remaining block.
    pub blocked: Duration,
}

impl QuotaView {
    /// §6: the time until a reservation of `tokens` fits buckets at these levels and
    /// the block is over (status shows it; zero = now).
    pub fn wait(&self, q: &QuotaParams, tokens: u64) -> Duration {
        let mut wait = self.blocked;
        let levels = [self.tokens, self.requests];
        for ((counts, cap), level) in q.buckets().into_iter().zip(levels) {
            if let (Some(cap), Some(level)) = (cap, level) {
                let need = counts.amount(tokens).min(cap) as f64;
                if level < need {
                    let secs = (need - level) * MINUTE.as_secs_f64() / cap.max(1) as f64;
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
            buckets: [None; 2],
            blocked_until: Duration::ZERO,
        }
    }

    /// §6/§7: the time until a reservation of `tokens` certainly fits; zero = now.
    pub fn wait(&self, q: &QuotaParams, tokens: u64, now: Duration) -> Duration {
        let mut wait = self.blocked_until.saturating_sub(now);
        for (i, (counts, cap)) in q.buckets().into_iter().enumerate() {
            if let (Some(cap), Some(b)) = (cap, &self.buckets[i]) {
                wait = wait.max(b.wait_for(cap, counts.amount(tokens), now));
            }
        }
        wait
    }

    /// Gate 3: take `tokens` and one request, or nothing.
    pub fn reserve(&mut self, q: &QuotaParams, tokens: u64, now: Duration) -> Reserve {
        let wait = self.wait(q, tokens, now);
        if !wait.is_zero() {
            return Reserve::Denied { retry_after: wait };
        }
        for (i, (counts, cap)) in q.buckets().into_iter().enumerate() {
            match cap {
                Some(cap) => self.buckets[i]
                    .get_or_insert(Bucket { full_at: now })
                    .debit(cap, counts.amount(tokens), now),
                None => self.buckets[i] = None,
            }
        }
        Reserve::Reserved
    }

    /// Settle a reservation of `reserved` tokens.
    pub fn settle(&mut self, q: &QuotaParams, reserved: u64, how: Settlement, now: Duration) {
        let (token_credit, request_credit) = match how {
            Settlement::Charge { tokens } => (reserved as i128 - tokens as i128, 0),
            Settlement::RefundTokens => (reserved as i128, 0),
            Settlement::RefundAll => (reserved as i128, 1),
        };
        for (i, (counts, cap)) in q.buckets().into_iter().enumerate() {
            let credit = match counts {
                Counts::Tokens => token_credit,
                Counts::Requests => request_credit,
            };
            match cap {
                Some(cap) if credit != 0 => self.buckets[i]
                    .get_or_insert(Bucket { full_at: now })
                    .add(cap, credit, now),
                Some(_) => {}
                None => self.buckets[i] = None,
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
        let level = |i: usize, cap: Option<u64>| {
            cap.map(|c| self.buckets[i].map_or(c as f64, |b| b.level(c, now)))
        };
        QuotaView {
            tokens: level(0, q.tpm),
            requests: level(1, q.rpm),
            blocked: self.blocked_until.saturating_sub(now),
        }
    }
}

// §15: what the priority classes' reserves and limits read of the buckets
// (gate/classes.rs keeps the per-class side).
impl Quota {
    /// Each configured bucket's deficit at `now` (ns of refill time; 0 = full),
    /// `None` for a disabled bucket, in [`QuotaParams::buckets`] order.
    pub fn deficits(&self, q: &QuotaParams, now: Duration) -> [Option<u128>; 2] {
        let mut d = [None; 2];
        for (i, (_, cap)) in q.buckets().into_iter().enumerate() {
            if cap.is_some() {
                d[i] = Some(self.buckets[i].map_or(0, |b| b.deficit(now)));
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

    const Q: QuotaParams = QuotaParams {
        tpm: Some(60),
        rpm: None,
    };

    #[test]
    fn the_wait_covers_debt_and_the_block_whichever_is_later() {
        let mut q = Quota::new();
        assert_eq!(q.reserve(&Q, 50, s(0)), Reserve::Reserved);
        q.settle(&Q, 50, Settlement::Charge { tokens: 90 }, s(0)); // level −30
        assert_eq!(q.view(&Q, s(0)).tokens, Some(-30.0));
        // 10 tokens need 40 more: 40 s at one token per second.
        assert_eq!(q.wait(&Q, 10, s(0)), s(40));
        q.block(s(5), s(0));
        assert_eq!(q.wait(&Q, 10, s(0)), s(40), "refill is the later");
        q.block(s(100), s(0));
        assert_eq!(q.wait(&Q, 10, s(0)), s(100), "the block is the later");
        assert_eq!(
            q.reserve(&Q, 10, s(1)),
            Reserve::Denied { retry_after: s(99) }
        );
    }

    #[test]
    fn levels_stay_within_plus_minus_capacity_and_refill_continuously() {
        let mut q = Quota::new();
        assert_eq!(
            q.reserve(&Q, 100, s(0)),
            Reserve::Reserved,
            "oversized fits a full bucket"
        );
        assert_eq!(q.view(&Q, s(0)).tokens, Some(-40.0));
        q.settle(&Q, 0, Settlement::Charge { tokens: u64::MAX }, s(0));
        assert_eq!(q.view(&Q, s(0)).tokens, Some(-60.0), "debt floor");
        assert_eq!(q.view(&Q, s(90)).tokens, Some(30.0));
        q.settle(&Q, 1_000, Settlement::RefundTokens, s(90));
        assert_eq!(q.view(&Q, s(90)).tokens, Some(60.0), "capacity cap");
    }
}
