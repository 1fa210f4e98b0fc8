//! The quota gate (§7): two continuously refilled token buckets per source (tokens
//! per minute, requests per minute) and a 429 block. Plain data; `now` is passed in.
//! The Redis backend implements the same rules in Lua (see `backend/mod.rs`).
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
        /// Estimated time until the reservation could succeed.
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

/// One bucket: capacity = one minute's worth, refill capacity/60 per second.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bucket {
    /// Current level; negative means debt.
    level: f64,
    /// When `level` was last brought up to date.
    at: Duration,
}

impl Bucket {
    fn full(cap: u64, now: Duration) -> Self {
        Bucket {
            level: cap as f64,
            at: now,
        }
    }

    fn refill(&mut self, cap: u64, now: Duration) {
        let dt = now.saturating_sub(self.at).as_secs_f64();
        // Clamped both ways, like every credit: after a reload lowers the capacity, old
        // debt deeper than the new −capacity is cut too (as the Redis script does).
        self.level = (self.level + dt * cap as f64 / 60.0).clamp(-(cap as f64), cap as f64);
        self.at = self.at.max(now);
    }

    /// Time until the level reaches `need`; never zero while it has not (a wait
    /// that rounds to nothing would let a reservation through below `need`).
    fn wait_for(&self, cap: u64, need: f64) -> Duration {
        if self.level >= need || cap == 0 {
            return Duration::ZERO;
        }
        let secs = (need - self.level) * 60.0 / cap as f64;
        Duration::try_from_secs_f64(secs)
            .unwrap_or(Duration::MAX)
            .max(Duration::from_micros(1))
    }

    /// Add `amount` (negative: debit), keeping the level within [−capacity, capacity].
    fn credit(&mut self, cap: u64, amount: f64) {
        self.level = (self.level + amount).clamp(-(cap as f64), cap as f64);
    }
}

/// One source's quota state.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    /// Token bucket (lazily created when `tpm` is set).
    tokens: Option<Bucket>,
    /// Request bucket (lazily created when `rpm` is set).
    requests: Option<Bucket>,
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

impl Quota {
    /// Full buckets, no block.
    pub fn new() -> Self {
        Quota {
            tokens: None,
            requests: None,
            blocked_until: Duration::ZERO,
        }
    }

    fn refill(&mut self, q: &QuotaParams, now: Duration) {
        match q.tpm {
            Some(cap) => self
                .tokens
                .get_or_insert_with(|| Bucket::full(cap, now))
                .refill(cap, now),
            None => self.tokens = None,
        }
        match q.rpm {
            Some(cap) => self
                .requests
                .get_or_insert_with(|| Bucket::full(cap, now))
                .refill(cap, now),
            None => self.requests = None,
        }
    }

    /// Gate 3: take `tokens` and one request, or nothing.
    pub fn reserve(&mut self, q: &QuotaParams, tokens: u64, now: Duration) -> Reserve {
        if now < self.blocked_until {
            return Reserve::Denied {
                retry_after: self.blocked_until - now,
            };
        }
        self.refill(q, now);
        let mut wait = Duration::ZERO;
        if let (Some(cap), Some(b)) = (q.tpm, &self.tokens) {
            let need = tokens.min(cap) as f64;
            wait = wait.max(b.wait_for(cap, need));
        }
        if let (Some(cap), Some(b)) = (q.rpm, &self.requests) {
            wait = wait.max(b.wait_for(cap, 1.0));
        }
        if !wait.is_zero() {
            return Reserve::Denied { retry_after: wait };
        }
        if let (Some(cap), Some(b)) = (q.tpm, &mut self.tokens) {
            b.credit(cap, -(tokens as f64));
        }
        if let (Some(cap), Some(b)) = (q.rpm, &mut self.requests) {
            b.credit(cap, -1.0);
        }
        Reserve::Reserved
    }

    /// Settle a reservation of `reserved` tokens.
    pub fn settle(&mut self, q: &QuotaParams, reserved: u64, how: Settlement, now: Duration) {
        self.refill(q, now);
        let (token_credit, request_credit) = match how {
            Settlement::Charge { tokens } => (reserved as f64 - tokens as f64, 0.0),
            Settlement::RefundTokens => (reserved as f64, 0.0),
            Settlement::RefundAll => (reserved as f64, 1.0),
        };
        if let (Some(cap), Some(b)) = (q.tpm, &mut self.tokens) {
            b.credit(cap, token_credit);
        }
        if let (Some(cap), Some(b)) = (q.rpm, &mut self.requests) {
            b.credit(cap, request_credit);
        }
    }

    /// 429: block until `now + d` (only moves forward).
    pub fn block(&mut self, d: Duration, now: Duration) {
        self.blocked_until = self.blocked_until.max(now + d);
    }

    /// Levels for status.
    pub fn view(&mut self, q: &QuotaParams, now: Duration) -> QuotaView {
        self.refill(q, now);
        QuotaView {
            tokens: self.tokens.map(|b| b.level),
            requests: self.requests.map(|b| b.level),
            blocked: self.blocked_until.saturating_sub(now),
        }
    }
}

impl Default for Quota {
    fn default() -> Self {
        Self::new()
    }
}
