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
    /// The breaker epoch of the OPEN state the deadline came from (the largest seen
    /// since the last clear). A shared backend that later answers a *lower* epoch has
    /// lost its state (§10): the entry is then wrong and is dropped.
    epoch: AtomicU64,
    /// When the entry was last re-checked against a shared backend (nanos + 1; 0 =
    /// never), so a host re-checks at most once per interval however many calls
    /// meet the entry.
    checked: AtomicU64,
}

fn nanos(d: Duration) -> u64 {
    // Saturate: a deadline past u64 nanoseconds (~584 years) must not wrap.
    d.as_nanos().min(u64::MAX as u128) as u64
}

impl Memo {
    /// Skip the source until `deadline` unless a later deadline is already set;
    /// `epoch` is the epoch of the OPEN state that set it, learnt from the backend at
    /// `now` (which counts as a check: the next re-check is due an interval later).
    pub fn set_until(&self, deadline: Duration, epoch: u64, now: Duration) {
        self.epoch.fetch_max(epoch, Ordering::AcqRel);
        self.until.fetch_max(nanos(deadline), Ordering::AcqRel);
        self.checked
            .store(nanos(now).saturating_add(1), Ordering::Release);
    }

    /// Forget the deadline (and its epoch).
    pub fn clear(&self) {
        self.until.store(0, Ordering::Release);
        self.epoch.store(0, Ordering::Release);
    }

    /// Time the source is still skipped at `now` (zero = not skipped).
    pub fn remaining(&self, now: Duration) -> Duration {
        Duration::from_nanos(self.until.load(Ordering::Acquire)).saturating_sub(now)
    }

    /// The epoch the current deadline was set under.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// `true` for exactly one caller per `every` (at `now`): that caller re-checks
    /// the entry against the shared backend, the others trust it meanwhile.
    pub fn recheck_due(&self, now: Duration, every: Duration) -> bool {
        let last = self.checked.load(Ordering::Acquire);
        let now_n = nanos(now).saturating_add(1);
        (last == 0 || now_n.saturating_sub(last) >= nanos(every))
            && self
                .checked
                .compare_exchange(last, now_n, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
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
        m.set_until(s(10), 3, s(0));
        m.set_until(s(5), 2, s(0));
        assert_eq!(
            m.remaining(s(1)),
            s(9),
            "a shorter deadline never replaces a longer one"
        );
        assert_eq!(m.epoch(), 3, "the largest epoch seen");
        m.set_until(s(20), 4, s(0));
        assert_eq!(m.remaining(s(1)), s(19));
        m.clear();
        assert_eq!((m.remaining(s(1)), m.epoch()), (s(0), 0));
        m.set_until(Duration::MAX, 1, s(0));
        assert!(
            m.remaining(s(1)) > s(500 * 365 * 86_400),
            "saturates, never wraps"
        );
    }

    #[test]
    fn one_recheck_per_interval() {
        let m = Memo::default();
        let s = Duration::from_millis;
        assert!(m.recheck_due(s(0), s(1000)), "never checked: due");
        assert!(!m.recheck_due(s(10), s(1000)));
        assert!(!m.recheck_due(s(999), s(1000)));
        assert!(m.recheck_due(s(1000), s(1000)));
        assert!(!m.recheck_due(s(1001), s(1000)));
        m.set_until(s(9000), 1, s(1500));
        assert!(!m.recheck_due(s(2400), s(1000)), "setting it was a check");
        assert!(m.recheck_due(s(2500), s(1000)));
    }
}

/// Host-local hint that a source's quota just refused (gate 3): an admission needing
/// at least `need` tokens skips the backend and counts as `rate_limited` until
/// `set_at + min(retry_after, poll)`, where `poll` is the *reader's* scope poll
/// interval (a source shared by a batch scope with a 5 s poll must not hide freed
/// quota from a 50 ms scope). However many calls wait on a rate-limited source, this
/// host then asks the backend about it about once per tick: the waiters share one
/// re-evaluation. Anything this host frees for the source clears the hint, and a
/// generation counter keeps a refusal that was in flight during the clear from
/// re-setting it (the wake-up that the clear caused must not be turned away).
#[derive(Debug, Default)]
pub struct QuotaHint {
    /// The current hint, if any.
    inner: std::sync::Mutex<Hint>,
}

/// State of a [`QuotaHint`].
#[derive(Debug, Default, Clone, Copy)]
struct Hint {
    /// When the refusal was seen; `None` = no hint.
    set_at: Option<Duration>,
    /// The backend's estimate of when the refused amount fits.
    retry_after: Duration,
    /// The refused amount of tokens.
    need: u64,
    /// Bumped by every `clear`.
    generation: u64,
}

impl QuotaHint {
    fn lock(&self) -> std::sync::MutexGuard<'_, Hint> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Read before asking the backend; pass to [`QuotaHint::set`].
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Remember a refusal of `need` tokens seen at `at`, unless the hint was cleared
    /// since `generation` was read.
    pub fn set(&self, generation: u64, at: Duration, retry_after: Duration, need: u64) {
        let mut h = self.lock();
        if h.generation == generation {
            h.set_at = Some(at);
            h.retry_after = retry_after;
            h.need = need;
        }
    }

    /// Forget the hint (something was freed; the next admission asks the backend).
    pub fn clear(&self) {
        let mut h = self.lock();
        h.set_at = None;
        h.generation = h.generation.wrapping_add(1);
    }

    /// While the hint applies to an admission of `tokens` at `now` (polling every
    /// `poll`): the backend's estimate of how long until it fits, counted from `now`
    /// (§6: a call ending on this refusal reports it).
    pub fn wait(&self, now: Duration, tokens: u64, poll: Duration) -> Option<Duration> {
        let h = *self.lock();
        let at = h.set_at?;
        (now < at + h.retry_after.min(poll) && tokens >= h.need)
            .then(|| (at + h.retry_after).saturating_sub(now))
    }

    /// Would an admission of `tokens` at `now`, polling every `poll`, surely be refused?
    pub fn blocks(&self, now: Duration, tokens: u64, poll: Duration) -> bool {
        let h = *self.lock();
        match h.set_at {
            Some(at) => now < at + h.retry_after.min(poll) && tokens >= h.need,
            None => false,
        }
    }
}

#[cfg(test)]
mod quota_hint_tests {
    use super::*;

    #[test]
    fn blocks_only_as_large_requests_until_expiry_or_clear() {
        let h = QuotaHint::default();
        let s = Duration::from_millis;
        let poll = s(50);
        assert!(!h.blocks(s(0), 10, poll));
        h.set(h.generation(), s(0), s(5_000), 10);
        assert!(h.blocks(s(10), 10, poll));
        assert!(h.blocks(s(10), 20, poll), "a larger need is refused too");
        assert!(
            !h.blocks(s(10), 5, poll),
            "a smaller estimate may still fit: ask"
        );
        assert!(
            !h.blocks(s(50), 10, poll),
            "one tick of the reader's poll at most"
        );
        assert!(
            h.blocks(s(50), 10, s(5_000)),
            "a slower reader keeps it longer"
        );
        assert!(!h.blocks(s(10), 10, s(5)), "a faster reader asks sooner");
        h.clear();
        assert!(!h.blocks(s(10), 10, poll));
    }

    #[test]
    fn a_refusal_in_flight_during_a_clear_does_not_reinstate_the_hint() {
        let h = QuotaHint::default();
        let s = Duration::from_millis;
        let before = h.generation(); // a pass asks the backend...
        h.clear(); // ...meanwhile this host frees quota...
        h.set(before, s(0), s(1_000), 1); // ...and the stale refusal arrives.
        assert!(!h.blocks(s(1), 1, s(50)));
    }
}
