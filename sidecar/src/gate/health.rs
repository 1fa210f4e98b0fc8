//! Recent health of a source on this host, for the `health` selector (§4): an
//! exponentially weighted success rate and latency of reported outcomes.

use std::sync::Mutex;
use std::time::Duration;

/// Weight of the newest sample.
const ALPHA: f64 = 0.2;

#[derive(Debug, Clone, Copy)]
struct Inner {
    /// EWMA of 1.0 (success) / 0.0 (failure); starts optimistic.
    success: f64,
    /// EWMA of attempt latency in seconds; 0 until the first sample.
    latency: f64,
}

/// One source's health.
#[derive(Debug)]
pub struct Health {
    /// Guarded by a mutex: updates are rare compared to reads and tiny.
    inner: Mutex<Inner>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            inner: Mutex::new(Inner {
                success: 1.0,
                latency: 0.0,
            }),
        }
    }
}

impl Health {
    /// Feed one outcome (429s and cancellations are not health samples).
    pub fn record(&self, ok: bool, latency: Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let x = if ok { 1.0 } else { 0.0 };
        g.success = ALPHA * x + (1.0 - ALPHA) * g.success;
        let l = latency.as_secs_f64();
        g.latency = if g.latency == 0.0 {
            l
        } else {
            ALPHA * l + (1.0 - ALPHA) * g.latency
        };
    }

    /// (success rate, latency seconds).
    pub fn score(&self) -> (f64, f64) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (g.success, g.latency)
    }
}

/// Sort key for the health selector: higher success first, then lower latency.
/// Success rates are bucketed to 1% so latency decides between equally healthy
/// sources instead of float noise.
pub fn rank((success, latency): (f64, f64)) -> (i64, u64) {
    (-((success * 100.0).round() as i64), (latency * 1e6) as u64)
}
