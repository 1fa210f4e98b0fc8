//! Injectable clocks.
//!
//! Every host-local time reading in the engine and the memory backend goes through a
//! [`Clock`], so tests can drive time deterministically: [`ManualClock`] is advanced by
//! hand (backend contract tests), [`TokioClock`] follows `tokio::time`, which tests can
//! pause and auto-advance (`#[tokio::test(start_paused = true)]`) so engine waits cost
//! no real time. Redis never uses these: its clock is its own `TIME` (§10).

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
