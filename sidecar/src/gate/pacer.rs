//! AIMD concurrency pacer (§8), per source, host-local.
//!
//! `try_take` checks and takes a slot in one step under the lock (admit and enter are
//! one atomic step — the check-then-act race of Netflix concurrency-limits #234 cannot
//! happen), and every taken slot is given back exactly once by `release`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::config::PacerConfig;
use crate::gate::classes::{ClassTag, PPM};

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
    /// §15: of those, per priority class (classed scopes only).
    by_class: HashMap<Arc<str>, u32>,
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
                by_class: HashMap::new(),
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
            class: None,
        })
    }

    /// Give a slot back and apply the outcome's signal.
    pub fn release(&self, signal: Signal) {
        self.release_as(signal, None)
    }

    /// [`Pacer::release`] of a slot taken by [`Pacer::try_slot_class`] for `class`.
    pub fn release_as(&self, signal: Signal, class: Option<&str>) {
        let mut g = self.lock();
        if let Some(n) = class.and_then(|c| g.by_class.get_mut(c)) {
            *n = n.saturating_sub(1);
        }
        debug_assert!(g.in_flight > 0, "pacer slot released twice");
        g.in_flight = g.in_flight.saturating_sub(1);
        let cfg = g.cfg;
        match signal {
            Signal::Increase => g.ceiling = (g.ceiling + cfg.increase / g.ceiling).min(cfg.max),
            Signal::Decrease => g.ceiling = (g.ceiling * cfg.decrease).max(cfg.min),
            Signal::Hold => {}
        }
    }

    /// §15: [`Pacer::try_slot`] for a call of priority class `tag`, under the same
    /// rules as the quota's reserves and limits, counted in slots of this host: a
    /// class holding `floor(limit × ceiling)` slots (and at least one) takes no more;
    /// once taking a slot would put more than `saturation × ceiling` in flight, a
    /// class may not take the slots other classes' unused reserves
    /// (`floor(reserve × ceiling)` each) hold.
    pub fn try_slot_class(&self, tag: &ClassTag) -> Option<Slot<'_>> {
        let name = &tag.share().name;
        let mut g = self.lock();
        let slots = g.ceiling.floor();
        if (g.in_flight as f64) >= slots {
            return None;
        }
        let of = |ppm: u64| (slots * ppm as f64 / PPM as f64).floor();
        let mine = g.by_class.get(name).copied().unwrap_or(0);
        let me = tag.share();
        if me.limit_ppm < PPM && mine > 0 && f64::from(mine + 1) > of(me.limit_ppm) {
            return None;
        }
        let after = f64::from(g.in_flight + 1);
        if after > slots * tag.shares.saturation_ppm as f64 / PPM as f64 {
            let held: f64 = tag
                .shares
                .classes
                .iter()
                .enumerate()
                .filter(|(j, o)| *j != tag.index && o.reserve_ppm > 0)
                .map(|(_, o)| {
                    let used = g.by_class.get(&o.name).copied().unwrap_or(0);
                    (of(o.reserve_ppm) - f64::from(used)).max(0.0)
                })
                .sum();
            if held > 0.0 && slots - after < held {
                return None;
            }
        }
        g.in_flight += 1;
        *g.by_class.entry(name.clone()).or_insert(0) += 1;
        Some(Slot {
            pacer: self,
            armed: true,
            class: Some(name.clone()),
        })
    }

    /// New parameters (SIGHUP): the learned ceiling is kept, clamped into the new
    /// `[min, max]`; permits in flight stay valid.
    pub fn reconfigure(&self, cfg: PacerConfig) {
        let mut g = self.lock();
        g.cfg = cfg;
        g.ceiling = g.ceiling.clamp(cfg.min, cfg.max);
    }

    /// §15: slots `class` holds.
    pub fn class_in_flight(&self, class: &str) -> u32 {
        self.lock().by_class.get(class).copied().unwrap_or(0)
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
    /// §15: the class it was taken for (`None`: no classes).
    class: Option<Arc<str>>,
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
            self.pacer.release_as(Signal::Hold, self.class.as_deref());
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
    fn class_slots_follow_reserves_and_limits() {
        use crate::gate::classes::{ClassShares, Share};
        let p = Pacer::new(PacerConfig {
            initial: 10.0,
            max: 10.0,
            ..cfg()
        });
        let shares = Arc::new(ClassShares {
            saturation_ppm: 500_000,
            classes: vec![
                Share {
                    name: "interactive".into(),
                    reserve_ppm: 300_000,
                    limit_ppm: PPM,
                },
                Share {
                    name: "batch".into(),
                    reserve_ppm: 0,
                    limit_ppm: 800_000,
                },
            ],
        });
        let tag = |index| ClassTag {
            shares: shares.clone(),
            index,
        };
        let mut held = Vec::new();
        while let Some(s) = p.try_slot_class(&tag(1)) {
            held.push(s);
        }
        assert_eq!(
            held.len(),
            7,
            "batch stops where 3 slots stay for interactive"
        );
        let mut mine = Vec::new();
        while let Some(s) = p.try_slot_class(&tag(0)) {
            mine.push(s);
        }
        assert_eq!(mine.len(), 3, "interactive gets its reserve");
        drop(mine);
        drop(held);
        assert_eq!(p.view().1, 0, "every class slot given back");
        // The limit holds below saturation too: 8 of 10 for batch.
        let shares2 = Arc::new(ClassShares {
            saturation_ppm: PPM,
            ..(*shares).clone()
        });
        let t = ClassTag {
            shares: shares2,
            index: 1,
        };
        let n = std::iter::from_fn(|| p.try_slot_class(&t).map(|s| s.keep())).count();
        assert_eq!(n, 8);
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
