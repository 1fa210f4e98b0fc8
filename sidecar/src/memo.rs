//! The cooldown memo (§9): source → deadline, host-local.
//!
//! When the breaker refuses a source because it is OPEN, the deadline (`until`) is
//! written here so this host skips the source without asking the backend until then
//! (no Redis traffic for an OPEN source, §10). Deadlines only move forward
//! (LiteLLM #40130: a re-cooldown kept the earlier, shorter deadline). A HALF_OPEN
//! refusal writes nothing: once the probe succeeds the source must be selectable at
//! once. `clear` is for force_close / reset (also when broadcast from another host).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One source's memo entry: deadline in nanoseconds on the engine clock; 0 = none.
#[derive(Debug, Default)]
pub struct Memo {
    /// Deadline (nanos since the clock's origin).
    until: AtomicU64,
}

impl Memo {
    /// Skip the source until `deadline` unless a later deadline is already set.
    pub fn set_until(&self, deadline: Duration) {
        // Saturate: a deadline past u64 nanoseconds (~584 years) must not wrap.
        let nanos = deadline.as_nanos().min(u64::MAX as u128) as u64;
        self.until.fetch_max(nanos, Ordering::AcqRel);
    }

    /// Forget the deadline.
    pub fn clear(&self) {
        self.until.store(0, Ordering::Release);
    }

    /// Time the source is still skipped at `now` (zero = not skipped).
    pub fn remaining(&self, now: Duration) -> Duration {
        Duration::from_nanos(self.until.load(Ordering::Acquire)).saturating_sub(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_moves_forward_and_clears() {
        let m = Memo::default();
        let s = Duration::from_secs;
        assert_eq!(m.remaining(s(0)), s(0));
        m.set_until(s(10));
        m.set_until(s(5));
        assert_eq!(
            m.remaining(s(1)),
            s(9),
            "a shorter deadline never replaces a longer one"
        );
        m.set_until(s(20));
        assert_eq!(m.remaining(s(1)), s(19));
        m.clear();
        assert_eq!(m.remaining(s(1)), s(0));
        m.set_until(Duration::MAX);
        assert!(
            m.remaining(s(1)) > s(500 * 365 * 86_400),
            "saturates, never wraps"
        );
    }
}

/// Host-local hint that a source's quota just refused (gate 3): until `until`, an
/// admission needing at least `need` tokens skips the backend and counts as
/// `rate_limited`. The engine caps `until` at one `poll_interval` ahead, so however
/// many calls wait on a rate-limited source, this host asks the backend about it at
/// most about once per tick (the waiters share one re-evaluation). Anything this host
/// frees for the source (a report, a released grant) clears the hint at once.
#[derive(Debug, Default)]
pub struct QuotaHint {
    /// (until, need); `until` zero = no hint.
    inner: std::sync::Mutex<(Duration, u64)>,
}

impl QuotaHint {
    /// Remember a refusal of `need` tokens, valid until `until`.
    pub fn set(&self, until: Duration, need: u64) {
        *self.inner.lock().unwrap_or_else(|e| e.into_inner()) = (until, need);
    }

    /// Forget the hint (something was freed; the next admission asks the backend).
    pub fn clear(&self) {
        *self.inner.lock().unwrap_or_else(|e| e.into_inner()) = (Duration::ZERO, 0);
    }

    /// Would an admission of `tokens` at `now` surely be refused?
    pub fn blocks(&self, now: Duration, tokens: u64) -> bool {
        let (until, need) = *self.inner.lock().unwrap_or_else(|e| e.into_inner());
        now < until && tokens >= need
    }
}

#[cfg(test)]
mod quota_hint_tests {
    use super::*;

    #[test]
    fn blocks_only_as_large_requests_until_expiry_or_clear() {
        let h = QuotaHint::default();
        let s = Duration::from_millis;
        assert!(!h.blocks(s(0), 10));
        h.set(s(50), 10);
        assert!(h.blocks(s(10), 10));
        assert!(h.blocks(s(10), 20), "a larger need is refused too");
        assert!(!h.blocks(s(10), 5), "a smaller estimate may still fit: ask");
        assert!(!h.blocks(s(50), 10), "expired");
        h.set(s(50), 10);
        h.clear();
        assert!(!h.blocks(s(10), 10));
    }
}
