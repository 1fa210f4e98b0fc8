//! The quota's vocabulary (§7, §7a): a source's parameters ([`QuotaParams`]: its
//! limits, burst, charging rule and the §18 switches), what a reservation takes
//! ([`Tokens`]), the gate's answer ([`Reserve`]) and how a reservation is settled
//! ([`Settlement`], [`Credits`]). Every backend speaks it, and none of it depends on
//! a backend.
//!
//! Its own module because it is data and the rules that read only data (which
//! limit a bucket has, its shape, what a settlement gives back); the state that
//! applies them is [`super::Quota`].

use std::time::Duration;

use super::bucket::{Bucket, Counts, Shape, BUCKETS, MINUTE};

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
    /// §18 `learn_rate = "aimd"`: the per-minute limits follow a factor learned from
    /// the 429s (`learn.rs`), recovering this many ppm of the limit per second; 0 =
    /// off (the source never reads or writes it).
    pub learn: u32,
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
            learn: 0,
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

#[cfg(test)]
mod tests {
    use super::*;

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
