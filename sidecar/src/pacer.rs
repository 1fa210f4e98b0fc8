//! AIMD concurrency pacer (§8), per source, host-local.
//!
//! `try_take` checks and takes a slot in one step under the lock (admit and enter are
//! one atomic step — the check-then-act race of Netflix concurrency-limits #234 cannot
//! happen), and every taken slot is given back exactly once by `release`.

use std::sync::Mutex;

use crate::config::PacerConfig;

/// How a finished attempt moves the ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Success: ceiling += increase / ceiling.
    Increase,
    /// 429 or timeout: ceiling × decrease.
    Decrease,
    /// Other failures, cancellations, reclaims: unchanged.
    Hold,
}

#[derive(Debug)]
struct Inner {
    /// Float ceiling in [min, max].
    ceiling: f64,
    /// Slots taken and not yet released.
    in_flight: u32,
}

/// One source's pacer.
#[derive(Debug)]
pub struct Pacer {
    /// Parameters.
    cfg: PacerConfig,
    /// Mutable state.
    inner: Mutex<Inner>,
}

impl Pacer {
    /// A pacer at `initial`.
    pub fn new(cfg: PacerConfig) -> Self {
        Pacer {
            cfg,
            inner: Mutex::new(Inner {
                ceiling: cfg.initial,
                in_flight: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take a slot if in-flight < floor(ceiling).
    pub fn try_take(&self) -> bool {
        let mut g = self.lock();
        if (g.in_flight as f64) < g.ceiling.floor() {
            g.in_flight += 1;
            true
        } else {
            false
        }
    }

    /// Give a slot back and apply the outcome's signal.
    pub fn release(&self, signal: Signal) {
        let mut g = self.lock();
        debug_assert!(g.in_flight > 0, "pacer slot released twice");
        g.in_flight = g.in_flight.saturating_sub(1);
        match signal {
            Signal::Increase => {
                g.ceiling = (g.ceiling + self.cfg.increase / g.ceiling).min(self.cfg.max)
            }
            Signal::Decrease => g.ceiling = (g.ceiling * self.cfg.decrease).max(self.cfg.min),
            Signal::Hold => {}
        }
    }

    /// (ceiling, in_flight).
    pub fn view(&self) -> (f64, u32) {
        let g = self.lock();
        (g.ceiling, g.in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PacerConfig {
        PacerConfig {
            initial: 2.0,
            min: 1.0,
            max: 3.0,
            increase: 1.0,
            decrease: 0.5,
        }
    }

    #[test]
    fn admits_up_to_floor_of_ceiling() {
        let p = Pacer::new(PacerConfig {
            initial: 2.9,
            ..cfg()
        });
        assert!(p.try_take());
        assert!(p.try_take());
        assert!(!p.try_take(), "floor(2.9) = 2");
        p.release(Signal::Hold);
        assert!(p.try_take());
    }

    #[test]
    fn aimd_moves_within_bounds() {
        let p = Pacer::new(cfg());
        assert!(p.try_take());
        p.release(Signal::Increase);
        assert_eq!(p.view(), (2.5, 0), "2 + 1/2");
        for _ in 0..10 {
            assert!(p.try_take());
            p.release(Signal::Increase);
        }
        assert_eq!(p.view().0, 3.0, "capped at max");
        for _ in 0..5 {
            assert!(p.try_take());
            p.release(Signal::Decrease);
        }
        assert_eq!(p.view().0, 1.0, "floored at min");
        assert!(p.try_take());
        p.release(Signal::Hold);
        assert_eq!(p.view(), (1.0, 0));
    }
}
