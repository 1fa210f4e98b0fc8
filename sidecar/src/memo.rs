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
