//! The circuit breaker state machine (§6), as plain data plus transitions.
//!
//! No clock and no locking here: every operation takes `now` (time since the
//! backend's clock origin), so the memory backend can drive it under a mutex with an
//! injected clock and tests can walk it step by step. The Redis backend implements the
//! same rules in Lua; `backend/mod.rs` documents them, the contract suite pins them.
//!
//! The breaker's vocabulary lives here too ([`State`], [`BreakerParams`], [`Entry`],
//! [`Applied`]): every backend speaks it, and none of it depends on a backend.

use std::time::Duration;

/// Breaker parameters, taken from the scope doing the operation (§6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerParams {
    /// Streak channel threshold.
    pub failure_threshold: u32,
    /// Rate channel threshold, a fraction.
    pub failure_rate: f64,
    /// Window samples needed before the rate channel / healthy-window veto apply.
    pub min_calls: u32,
    /// Whole window (two buckets of half each).
    pub window: Duration,
    /// Base open duration.
    pub cooldown: Duration,
    /// Cap of the open duration, and the decay period of the cooldown level.
    pub max_cooldown: Duration,
    /// Probe lease: 2 × the slowest source timeout of the scope.
    pub probe_ttl: Duration,
}

impl BreakerParams {
    /// §6 `k_max`: the smallest cooldown level at which `cooldown × 2^k` reaches
    /// `max_cooldown` (0 when the base cooldown already does). A longer outage adds
    /// nothing to the open duration, so it must add nothing to the level either: a
    /// level above this would keep later opens at the cap for extra decay periods.
    pub fn k_max(&self) -> u32 {
        let (cd, max) = (self.cooldown.as_nanos(), self.max_cooldown.as_nanos());
        if cd == 0 {
            return 0;
        }
        let mut k = 0;
        while k < 64 && cd.saturating_mul(1u128 << k) < max {
            k += 1;
        }
        k
    }
}

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Calls flow.
    Closed,
    /// Calls refused until the cooldown ends.
    Open,
    /// One probe may run.
    HalfOpen,
}

/// Answer of `try_enter` (gate 4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    /// The caller may proceed.
    pub granted: bool,
    /// The caller holds the half-open probe lease.
    pub is_probe: bool,
    /// Epoch the grant (or refusal) was made under.
    pub epoch: u64,
    /// State after the operation.
    pub state: State,
    /// §6 retry-after: OPEN → until − now, else 0.
    pub retry_after: Duration,
}

/// Which §6 channel opened a CLOSED breaker (the transition log says why).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trip {
    /// `failure_threshold` consecutive failures.
    Streak,
    /// The window's failure rate reached `failure_rate` over `min_calls`.
    FailureRate,
}

/// Answer of an outcome operation (`record_*`, `release_probe`, `report`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Applied {
    /// `false` when fenced out (epoch mismatch): nothing changed.
    pub applied: bool,
    /// State after the operation.
    pub state: State,
    /// Current epoch after the operation.
    pub epoch: u64,
    /// §6 retry-after: OPEN → until − now, else 0.
    pub retry_after: Duration,
    /// Cooldown level k after the operation (for the transition log).
    pub level: u32,
    /// Set when this very operation opened a CLOSED breaker: by which channel.
    pub trip: Option<Trip>,
}

/// Success/failure counts of one window bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Bucket {
    /// Successes counted.
    ok: u64,
    /// Failures counted.
    fail: u64,
}

/// One source's breaker.
#[derive(Debug, Clone, PartialEq)]
pub struct Breaker {
    /// Current state.
    state: State,
    /// Bumped by every transition and every probe grant (fencing token).
    epoch: u64,
    /// OPEN: when the cooldown ends.
    until: Duration,
    /// HALF_OPEN: when the probe lease expires; `None` after a release.
    lease_until: Option<Duration>,
    /// Consecutive failures in CLOSED.
    streak: u32,
    /// Cooldown level k.
    level: u32,
    /// Since when the breaker has been CLOSED (for the level decay).
    closed_since: Duration,
    /// Index (start / half-window) of the current window bucket.
    bucket_idx: u64,
    /// Current bucket.
    cur: Bucket,
    /// The bucket before (only meaningful when adjacent to `cur`).
    prev: Bucket,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: State::Closed,
            epoch: 0,
            until: Duration::ZERO,
            lease_until: None,
            streak: 0,
            level: 0,
            closed_since: Duration::ZERO,
            bucket_idx: 0,
            cur: Bucket::default(),
            prev: Bucket::default(),
        }
    }
}

/// The breaker as a read sees it, changing nothing (the memo's re-check, §9/§10).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Peek {
    /// State.
    pub state: State,
    /// Epoch.
    pub epoch: u64,
    /// §6 retry-after: OPEN → until − now (0 once passed), else 0.
    pub retry_after: Duration,
}

/// Read-only view for status.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerView {
    /// State.
    pub state: State,
    /// Epoch.
    pub epoch: u64,
    /// §6 retry-after.
    pub retry_after: Duration,
    /// Cooldown level.
    pub level: u32,
    /// Window successes.
    pub successes: u64,
    /// Window failures.
    pub failures: u64,
    /// Streak.
    pub streak: u32,
}

fn half(p: &BreakerParams) -> u128 {
    (p.window.as_nanos() / 2).max(1)
}

impl Breaker {
    /// A closed breaker whose decay clock starts at `now`.
    pub fn new(now: Duration) -> Self {
        Self::with_epoch(now, 0)
    }

    /// A closed breaker whose epoch starts at `epoch`.
    pub fn with_epoch(now: Duration, epoch: u64) -> Self {
        Breaker {
            closed_since: now,
            epoch,
            ..Breaker::default()
        }
    }

    /// Current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Current state (OPEN stays OPEN past `until` until someone enters).
    pub fn state(&self) -> State {
        self.state
    }

    /// §6: OPEN → until − now (0 once passed); HALF_OPEN / CLOSED → 0.
    pub fn retry_after(&self, now: Duration) -> Duration {
        match self.state {
            State::Open => self.until.saturating_sub(now),
            _ => Duration::ZERO,
        }
    }

    fn applied(&self, applied: bool, now: Duration) -> Applied {
        Applied {
            applied,
            state: self.state,
            epoch: self.epoch,
            retry_after: self.retry_after(now),
            level: self.level,
            trip: None,
        }
    }

    /// What a read sees (no decay, no roll: neither changes state or epoch).
    pub fn peek(&self, now: Duration) -> Peek {
        Peek {
            state: self.state,
            epoch: self.epoch,
            retry_after: self.retry_after(now),
        }
    }

    /// Level bound and decay, before every operation that carries parameters: k is
    /// clamped to `k_max` (a reload may have lowered it), then each whole
    /// `max_cooldown` spent CLOSED takes one off k.
    fn decay(&mut self, now: Duration, p: &BreakerParams) {
        // Level 0 (every healthy source, nearly every call) needs neither the clamp
        // nor the decay: k_max's loop of u128 products was ~2 % of a call (§16).
        if self.level == 0 {
            return;
        }
        self.level = self.level.min(p.k_max());
        if self.state != State::Closed || self.level == 0 || p.max_cooldown.is_zero() {
            return;
        }
        let period = p.max_cooldown.as_nanos();
        let periods = (now.saturating_sub(self.closed_since).as_nanos() / period) as u64;
        if periods > 0 {
            let take = periods.min(self.level as u64) as u32;
            self.level -= take;
            self.closed_since += Duration::from_nanos((periods as u128 * period) as u64);
        }
    }

    /// Move the window so `cur` is the bucket containing `now`.
    fn roll(&mut self, now: Duration, p: &BreakerParams) {
        let (now, half) = (now.as_nanos(), half(p));
        // u64 division when both fit (always, for 584 years of uptime and windows
        // under that): a u128 division is a library call, twice per call (§16).
        let idx = match (u64::try_from(now), u64::try_from(half)) {
            (Ok(n), Ok(h)) => n / h,
            _ => (now / half) as u64,
        };
        if idx == self.bucket_idx {
            return;
        }
        self.prev = if idx == self.bucket_idx + 1 {
            self.cur
        } else {
            Bucket::default()
        };
        self.cur = Bucket::default();
        self.bucket_idx = idx;
    }

    /// (successes, failures) in the window at `now`.
    fn window(&mut self, now: Duration, p: &BreakerParams) -> (u64, u64) {
        self.roll(now, p);
        (self.cur.ok + self.prev.ok, self.cur.fail + self.prev.fail)
    }

    fn clear_counts(&mut self) {
        self.streak = 0;
        self.cur = Bucket::default();
        self.prev = Bucket::default();
    }

    fn open(&mut self, now: Duration, p: &BreakerParams, grow: bool) {
        if grow {
            self.level = (self.level + 1).min(p.k_max());
        }
        let factor = 2u128.saturating_pow(self.level.min(64));
        let dur = p
            .cooldown
            .as_nanos()
            .saturating_mul(factor)
            .min(p.max_cooldown.as_nanos());
        self.state = State::Open;
        self.epoch += 1;
        self.until = now + Duration::from_nanos(dur as u64);
        self.lease_until = None;
        self.clear_counts();
    }

    fn close(&mut self, now: Duration) {
        self.state = State::Closed;
        self.epoch += 1;
        self.lease_until = None;
        self.closed_since = now;
        self.clear_counts();
    }

    fn grant_probe(&mut self, now: Duration, p: &BreakerParams) -> Entry {
        self.state = State::HalfOpen;
        self.epoch += 1;
        self.lease_until = Some(now + p.probe_ttl);
        Entry {
            granted: true,
            is_probe: true,
            epoch: self.epoch,
            state: State::HalfOpen,
            retry_after: Duration::ZERO,
        }
    }

    /// Gate 4 (§6 `try_enter`).
    pub fn try_enter(&mut self, now: Duration, p: &BreakerParams) -> Entry {
        self.decay(now, p);
        match self.state {
            State::Closed => Entry {
                granted: true,
                is_probe: false,
                epoch: self.epoch,
                state: State::Closed,
                retry_after: Duration::ZERO,
            },
            State::Open if now < self.until => Entry {
                granted: false,
                is_probe: false,
                epoch: self.epoch,
                state: State::Open,
                retry_after: self.until - now,
            },
            State::Open => self.grant_probe(now, p),
            State::HalfOpen => match self.lease_until {
                Some(lease) if now < lease => Entry {
                    granted: false,
                    is_probe: false,
                    epoch: self.epoch,
                    state: State::HalfOpen,
                    retry_after: Duration::ZERO,
                },
                _ => self.grant_probe(now, p),
            },
        }
    }

    /// A success under `epoch`.
    pub fn record_success(
        &mut self,
        now: Duration,
        epoch: u64,
        count: bool,
        p: &BreakerParams,
    ) -> Applied {
        self.decay(now, p);
        if epoch != self.epoch {
            return self.applied(false, now);
        }
        match self.state {
            State::Closed => {
                self.streak = 0;
                if count {
                    self.roll(now, p);
                    self.cur.ok += 1;
                }
            }
            State::HalfOpen => self.close(now),
            // Unreachable with a matching epoch (entering OPEN bumps it), but harmless.
            State::Open => return self.applied(false, now),
        }
        self.applied(true, now)
    }

    /// A failure under `epoch`.
    pub fn record_failure(&mut self, now: Duration, epoch: u64, p: &BreakerParams) -> Applied {
        self.decay(now, p);
        if epoch != self.epoch {
            return self.applied(false, now);
        }
        match self.state {
            State::Closed => {
                self.streak = self.streak.saturating_add(1);
                self.roll(now, p);
                self.cur.fail += 1;
                let (ok, fail) = self.window(now, p);
                let samples = ok + fail;
                let enough = samples >= p.min_calls as u64;
                let rate = if samples == 0 {
                    0.0
                } else {
                    fail as f64 / samples as f64
                };
                if enough && rate >= p.failure_rate {
                    self.open(now, p, true);
                    return Applied {
                        trip: Some(Trip::FailureRate),
                        ..self.applied(true, now)
                    };
                } else if self.streak >= p.failure_threshold && !(enough && rate < p.failure_rate) {
                    self.open(now, p, false);
                    return Applied {
                        trip: Some(Trip::Streak),
                        ..self.applied(true, now)
                    };
                }
            }
            State::HalfOpen => self.open(now, p, true),
            State::Open => return self.applied(false, now),
        }
        self.applied(true, now)
    }

    /// Release the probe lease held under `epoch` (no verdict).
    pub fn release_probe(&mut self, now: Duration, epoch: u64) -> Applied {
        if epoch != self.epoch || self.state != State::HalfOpen {
            return self.applied(false, now);
        }
        self.lease_until = None;
        self.applied(true, now)
    }

    /// A verdict-less outcome (429, cancel) of a permit.
    pub fn neutral(&mut self, now: Duration, epoch: u64, is_probe: bool) -> Applied {
        if is_probe {
            self.release_probe(now, epoch)
        } else {
            let ok = epoch == self.epoch;
            self.applied(ok, now)
        }
    }

    /// Admin: OPEN for `d`.
    pub fn force_open(&mut self, now: Duration, d: Duration) -> Applied {
        self.state = State::Open;
        self.epoch += 1;
        self.until = now.saturating_add(d);
        self.lease_until = None;
        self.applied(true, now)
    }

    /// Admin: CLOSED now.
    pub fn force_close(&mut self, now: Duration) -> Applied {
        self.close(now);
        self.applied(true, now)
    }

    /// Admin: forget everything but the epoch (bumped).
    pub fn reset(&mut self, now: Duration) -> Applied {
        let epoch = self.epoch + 1;
        *self = Breaker::new(now);
        self.epoch = epoch;
        self.applied(true, now)
    }

    /// Status view (applies decay and window roll first).
    pub fn view(&mut self, now: Duration, p: &BreakerParams) -> BreakerView {
        self.decay(now, p);
        let (successes, failures) = self.window(now, p);
        BreakerView {
            state: self.state,
            epoch: self.epoch,
            retry_after: self.retry_after(now),
            level: self.level,
            successes,
            failures,
            streak: self.streak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> BreakerParams {
        BreakerParams {
            failure_threshold: 3,
            failure_rate: 0.5,
            min_calls: 10,
            window: Duration::from_secs(60),
            cooldown: Duration::from_secs(10),
            max_cooldown: Duration::from_secs(80),
            probe_ttl: Duration::from_secs(4),
        }
    }

    #[test]
    fn window_rolls_into_previous_then_drops() {
        let p = p();
        let mut b = Breaker::new(Duration::ZERO);
        let e = b.epoch();
        b.record_success(Duration::from_secs(1), e, true, &p);
        b.record_success(Duration::from_secs(31), e, true, &p);
        assert_eq!(b.view(Duration::from_secs(31), &p).successes, 2);
        // Bucket 2 starts at 60 s: bucket 0 falls out.
        assert_eq!(b.view(Duration::from_secs(61), &p).successes, 1);
        // A gap of more than one bucket clears both.
        assert_eq!(b.view(Duration::from_secs(200), &p).successes, 0);
    }

    #[test]
    fn k_max_is_the_first_level_reaching_the_cap() {
        let with = |cd: u64, max: u64| BreakerParams {
            cooldown: Duration::from_secs(cd),
            max_cooldown: Duration::from_secs(max),
            ..p()
        };
        assert_eq!(with(10, 80).k_max(), 3, "10 × 2^3 = 80");
        assert_eq!(with(60, 600).k_max(), 4, "60 × 8 < 600 ≤ 60 × 16");
        assert_eq!(with(60, 60).k_max(), 0);
        assert_eq!(with(60, 30).k_max(), 0, "cooldown above the cap");
        assert_eq!(with(1, u64::MAX / 2).k_max(), 63);
    }

    #[test]
    fn reopens_stop_growing_the_level_at_k_max() {
        let p = p(); // k_max 3
        let mut b = Breaker::new(Duration::ZERO);
        let mut now = Duration::ZERO;
        let e = b.epoch();
        for _ in 0..3 {
            b.record_failure(now, b.epoch(), &p);
        }
        assert!(b.epoch() > e);
        for _ in 0..6 {
            now += Duration::from_secs(100);
            let probe = b.try_enter(now, &p);
            assert!(probe.is_probe);
            b.record_failure(now, probe.epoch, &p);
        }
        assert_eq!(b.view(now, &p).level, 3, "capped at k_max");
        // A reload that lowers the cap lowers the level with it.
        let lower = BreakerParams {
            max_cooldown: Duration::from_secs(20),
            ..p
        };
        assert_eq!(b.view(now, &lower).level, 1);
    }

    #[test]
    fn level_decays_one_per_max_cooldown_closed() {
        let p = p();
        let mut b = Breaker::new(Duration::ZERO);
        b.level = 3;
        b.closed_since = Duration::ZERO;
        assert_eq!(b.view(Duration::from_secs(79), &p).level, 3);
        assert_eq!(b.view(Duration::from_secs(81), &p).level, 2);
        assert_eq!(b.view(Duration::from_secs(170), &p).level, 1);
        assert_eq!(b.view(Duration::from_secs(1000), &p).level, 0);
    }
}
