//! Lock-free latency histograms for the hot path (§12, §16): one relaxed atomic add
//! for the bucket and one for the sum per observation, no lock, no allocation.
//!
//! prometheus-client 0.26's own `Histogram` keeps its buckets behind a mutex; every
//! request of every connection records one observation, so the recording side is
//! kept here and only the encoding is the crate's ([`MetricEncoder::encode_histogram`]).
//!
//! A top-level module, below both `engine` (the scopes' wait histograms, observed
//! as an Acquire ends) and `metrics` (the request histograms, and the encoding of
//! every histogram in `/metrics`), so the engine never imports the metrics layer
//! above it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{MetricEncoder, NoLabelSet};

/// Bucket upper bounds (seconds) for the sidecar's time per request: from a few
/// microseconds (a Ping, a memory-backend Report) to the seconds an Acquire that
/// waits may take.
pub const REQUEST_BUCKETS: &[f64] = &[
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Bucket upper bounds (seconds) for acquire wait time: an immediate grant (well
/// under a millisecond) up to the default five-minute stall window.
pub const WAIT_BUCKETS: &[f64] = &[
    1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// The longest duration one observation adds to the sum (about 11.6 days).
pub const MAX_OBSERVATION: Duration = Duration::from_secs(1_000_000);

/// A fixed-bucket histogram of durations.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds in seconds, ascending (what the exposition prints as `le`).
    bounds: &'static [f64],
    /// The same bounds in nanoseconds, so an observation compares integers.
    bounds_ns: Box<[u64]>,
    /// Observations per bucket (not cumulative); one more than `bounds`: `+Inf`.
    buckets: Box<[AtomicU64]>,
    /// Sum of all observations, in nanoseconds (584 years before it wraps).
    sum_ns: AtomicU64,
}

impl Histogram {
    /// A histogram with the given ascending upper bounds (seconds).
    pub fn new(bounds: &'static [f64]) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]), "ascending bounds");
        Histogram {
            bounds,
            bounds_ns: bounds.iter().map(|b| (b * 1e9) as u64).collect(),
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    /// Record one duration (counted in the sum as at most [`MAX_OBSERVATION`], so
    /// the sum cannot wrap).
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.min(MAX_OBSERVATION).as_nanos()).unwrap_or(u64::MAX);
        let i = self
            .bounds_ns
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(self.bounds_ns.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// Write this histogram (`_sum`, `_count`, `_bucket{le=…}`) with `encoder`.
    pub fn encode(&self, mut encoder: MetricEncoder<'_>) -> std::fmt::Result {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(counts.iter().copied())
            .collect();
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, counts.iter().sum(), &buckets, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_bucket() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(1000)); // on the bound: le="0.001"
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(3));
        h.observe(Duration::MAX);
        let counts: Vec<u64> = h
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        assert_eq!(counts, vec![1, 1, 2]);
        assert_eq!(h.count(), 4);
    }
}
