//! Recent health of a source on this host, for the `health` selector (§4): a success
//! rate and a latency that forget with a half-life (the scope's breaker `window`).
//!
//! Samples are kept as sums whose weights halve every half-life: `weight` (how many
//! samples, recently), `good` (of which usable successes) and `latency` (weighted
//! seconds). One imaginary success of weight [`PRIOR`] never decays, so an unsampled
//! source reads as perfect and a source whose failures have aged reads as perfect
//! again: a source that failed once is tried first again once its failure is a few
//! half-lives old, even if no traffic reached it meanwhile (the selector sent
//! everything to the others). Latency is the weighted mean while the samples still
//! weigh [`MIN_LATENCY_WEIGHT`], and unknown (0, like an untried source) after. A
//! `count_attempt = false` success is a failure here (its result was unusable).

use std::sync::Mutex;
use std::time::Duration;

/// Weight of the never-decaying perfect sample.
const PRIOR: f64 = 1.0;

/// Below this much recent weight a source's latency is unknown (reads as 0, like an
/// untried source): evidence older than a half-life or so no longer ranks it.
const MIN_LATENCY_WEIGHT: f64 = 0.5;

/// Decayed sums, brought up to date at `at`.
#[derive(Debug, Clone, Copy, Default)]
struct Inner {
    /// Σ weight of the samples.
    weight: f64,
    /// Σ weight of the usable successes.
    good: f64,
    /// Σ weight × latency seconds.
    latency: f64,
    /// When the sums were last decayed.
    at: Duration,
}

impl Inner {
    /// Age the sums to `now` with `half_life`.
    fn decay(&mut self, now: Duration, half_life: Duration) {
        let dt = now.saturating_sub(self.at);
        self.at = self.at.max(now);
        if dt.is_zero() || self.weight == 0.0 {
            return;
        }
        let f = if half_life.is_zero() {
            0.0
        } else {
            (-(dt.as_secs_f64() / half_life.as_secs_f64()) * std::f64::consts::LN_2).exp()
        };
        self.weight *= f;
        self.good *= f;
        self.latency *= f;
    }
}

/// One source's health.
#[derive(Debug, Default)]
pub struct Health {
    /// Guarded by a mutex: updates are rare compared to reads and tiny.
    inner: Mutex<Inner>,
}

impl Health {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Feed one outcome at `now` (429s and cancellations are not health samples):
    /// `ok` = a usable success.
    pub fn record(&self, ok: bool, latency: Duration, now: Duration, half_life: Duration) {
        let mut g = self.lock();
        g.decay(now, half_life);
        g.weight += 1.0;
        if ok {
            g.good += 1.0;
        }
        g.latency += latency.as_secs_f64();
    }

    /// (success rate, latency seconds) at `now`.
    pub fn score(&self, now: Duration, half_life: Duration) -> (f64, f64) {
        let mut g = self.lock();
        g.decay(now, half_life);
        let latency = if g.weight >= MIN_LATENCY_WEIGHT {
            g.latency / g.weight
        } else {
            0.0
        };
        ((g.good + PRIOR) / (g.weight + PRIOR), latency)
    }
}

/// Sort key for the health selector: higher success first, then lower latency.
/// Success rates are bucketed to 1% so latency decides between equally healthy
/// sources instead of float noise.
pub fn rank((success, latency): (f64, f64)) -> (i64, u64) {
    (-((success * 100.0).round() as i64), (latency * 1e6) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: Duration = Duration::from_secs(60);

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_failure_ages_out_with_the_half_life() {
        let h = Health::default();
        assert_eq!(h.score(s(0), H), (1.0, 0.0), "unsampled reads as perfect");
        h.record(false, Duration::from_millis(100), s(0), H);
        let (rate, _) = h.score(s(0), H);
        assert!((rate - 0.5).abs() < 1e-9, "{rate}");
        let (rate, _) = h.score(s(60), H);
        assert!(
            (rate - 1.0 / 1.5).abs() < 1e-9,
            "one half-life later: {rate}"
        );
        assert!(
            rank(h.score(s(600), H)).0 == -100,
            "ten half-lives: as good as new"
        );
    }

    #[test]
    fn latency_forgets_too_and_failures_outweigh_the_prior_under_traffic() {
        let h = Health::default();
        for i in 0..100 {
            h.record(i % 2 == 0, s(2), s(i), H);
        }
        let (rate, lat) = h.score(s(100), H);
        assert!(rate < 0.6 && rate > 0.4, "{rate}");
        assert!((lat - 2.0).abs() < 1e-9, "{lat}");
        let (_, lat) = h.score(s(100 + 60 * 7), H);
        assert_eq!(lat, 0.0, "aged latency is unknown again");
    }
}
