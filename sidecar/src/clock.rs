//! Injectable clocks.
//!
//! Every host-local time reading in the engine and the memory backend goes through a
//! [`Clock`], so tests can drive time deterministically: [`ManualClock`] is advanced by
//! hand (backend contract tests), [`TokioClock`] follows `tokio::time`, which tests can
//! pause and auto-advance (`#[tokio::test(start_paused = true)]`) so engine waits cost
//! no real time, and the daemon runs on [`MonotonicClock`], the same time read at the
//! least cost. Redis never uses these: its clock is its own `TIME` (§10).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A monotonic clock: time since an arbitrary origin fixed at construction.
pub trait Clock: Send + Sync + 'static {
    /// Time elapsed since the clock's origin.
    fn now(&self) -> Duration;
}

/// Production clock: `tokio::time::Instant`, so paused-time tests see the same time
/// the engine's sleeps use.
#[derive(Debug, Clone)]
pub struct TokioClock {
    /// The instant that reads as zero.
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        tokio::time::Instant::now().saturating_duration_since(self.origin)
    }
}

/// The daemon's clock: `CLOCK_MONOTONIC` read straight into nanoseconds. The same
/// clock `std::time::Instant` — and so tokio's timers, outside paused-time tests —
/// reads on Linux, without `Instant`'s normalised-timespec subtraction: a call reads
/// the clock about ten times, and that subtraction was most of the ~5 % of a call's
/// instructions spent on time (§16). Tests that pause tokio's time use
/// [`TokioClock`].
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    /// `CLOCK_MONOTONIC` in nanoseconds at the clock's zero.
    origin: u64,
}

impl MonotonicClock {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        MonotonicClock {
            origin: monotonic_nanos(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

/// `CLOCK_MONOTONIC` now, in nanoseconds (u64 lasts 584 years of uptime).
pub(crate) fn monotonic_nanos() -> u64 {
    use nix::time::{clock_gettime, ClockId};
    // CLOCK_MONOTONIC cannot fail on Linux (it is always present and the argument
    // is valid); a zero reading would only make time stand still, never panic.
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC)
        .unwrap_or_else(|_| nix::sys::time::TimeSpec::new(0, 0));
    (t.tv_sec() as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec() as u64)
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(monotonic_nanos().saturating_sub(self.origin))
    }
}

/// A clock that only moves when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    /// Current reading in nanoseconds.
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock reading zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Move the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.nanos.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_follows_the_clock_instant_reads() {
        let c = MonotonicClock::new();
        let t0 = std::time::Instant::now();
        let a = c.now();
        std::thread::sleep(Duration::from_millis(20));
        let b = c.now();
        let real = t0.elapsed();
        assert!(b >= a + Duration::from_millis(20), "{a:?} -> {b:?}");
        // The same clock as Instant: the two elapsed times agree closely.
        let diff = b.abs_diff(real);
        assert!(
            diff < Duration::from_millis(5),
            "clock {b:?} vs Instant {real:?}"
        );
        // Starts near zero and never goes back.
        assert!(a < Duration::from_millis(5), "{a:?}");
        assert!(c.now() >= b);
    }
}
