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
    /// Parameters (replaced on reload).
    cfg: PacerConfig,
    /// Float ceiling in [min, max].
    ceiling: f64,
    /// Slots taken and not yet released.
    in_flight: u32,
}

/// One source's pacer.
#[derive(Debug)]
pub struct Pacer {
    /// Mutable state.
    inner: Mutex<Inner>,
}

impl Pacer {
    /// A pacer at `initial`.
    pub fn new(cfg: PacerConfig) -> Self {
        Pacer {
            inner: Mutex::new(Inner {
                cfg,
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

    /// Take a slot as a guard that gives it back when dropped, unless `keep` hands
    /// the responsibility on (to a permit). An admission pass holds its slot this way
    /// across the backend round trip, so a cancelled Acquire or a panic cannot leak it.
    pub fn try_slot(&self) -> Option<Slot<'_>> {
        // `then`, not `then_some`: an eagerly built guard would be dropped when no
        // slot is free, releasing a slot it never took.
        self.try_take().then(|| Slot {
            pacer: self,
            armed: true,
        })
    }

    /// Give a slot back and apply the outcome's signal.
    pub fn release(&self, signal: Signal) {
        let mut g = self.lock();
        debug_assert!(g.in_flight > 0, "pacer slot released twice");
        g.in_flight = g.in_flight.saturating_sub(1);
        let cfg = g.cfg;
        match signal {
            Signal::Increase => g.ceiling = (g.ceiling + cfg.increase / g.ceiling).min(cfg.max),
            Signal::Decrease => g.ceiling = (g.ceiling * cfg.decrease).max(cfg.min),
            Signal::Hold => {}
        }
    }

    /// New parameters (SIGHUP): the learned ceiling is kept, clamped into the new
    /// `[min, max]`; permits in flight stay valid.
    pub fn reconfigure(&self, cfg: PacerConfig) {
        let mut g = self.lock();
        g.cfg = cfg;
        g.ceiling = g.ceiling.clamp(cfg.min, cfg.max);
    }

    /// (ceiling, in_flight).
    pub fn view(&self) -> (f64, u32) {
        let g = self.lock();
        (g.ceiling, g.in_flight)
    }
}

/// A pacer slot taken by [`Pacer::try_slot`]; released on drop unless kept.
#[derive(Debug)]
pub struct Slot<'a> {
    /// The pacer the slot belongs to.
    pacer: &'a Pacer,
    /// Still ours to release.
    armed: bool,
}

impl Slot<'_> {
    /// The slot now belongs to a permit, which releases it when reported or reclaimed.
    pub fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.pacer.release(Signal::Hold);
        }
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
    fn slot_guard_releases_unless_kept() {
        let p = Pacer::new(cfg());
        {
            let _s = p.try_slot().unwrap();
            assert_eq!(p.view().1, 1);
        }
        assert_eq!(p.view().1, 0, "dropped: released");
        p.try_slot().unwrap().keep();
        assert_eq!(p.view().1, 1, "kept: still taken");
    }

    #[test]
    fn reconfigure_clamps_the_learned_ceiling() {
        let p = Pacer::new(cfg());
        p.reconfigure(PacerConfig { max: 1.5, ..cfg() });
        assert_eq!(p.view().0, 1.5);
        assert!(p.try_take());
        assert!(!p.try_take(), "floor(1.5) = 1");
        p.release(Signal::Increase);
        assert_eq!(p.view().0, 1.5, "capped by the new max");
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
