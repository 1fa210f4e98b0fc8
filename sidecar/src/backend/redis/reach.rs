//! Whether Redis can be reached for each source, and what to do while it cannot
//! (§10, `on_backend_error`). One log line per transition, never one per call.
//!
//! When a call for a source fails as an outage ([`Fault::Unreachable`]):
//! - `on_backend_error = local`: the operation is served by the backend's embedded
//!   memory backend, the source is marked degraded ([`Backend::degraded`]) and one
//!   line is logged. While degraded, Redis is retried at most once per
//!   [`RETRY_INTERVAL`] per source (the other calls go straight to local state), so a
//!   dead Redis does not cost a timeout per admission; the first answer restores the
//!   source (logged once). Local and Redis state are not merged: the local breakers'
//!   epochs start at a random base ≥ 2^62 ([`local_epoch_base`]; Redis epochs count
//!   up from 0), so a permit granted on one side is always fenced on the other across
//!   a degrade/restore; its quota settlement is still applied to the buckets it lands
//!   on (clamped).
//! - `fail_closed`: [`BackendError::Unavailable`] naming the Redis target; within
//!   [`RETRY_INTERVAL`] of a failure the error is returned at once, without waiting
//!   for another timeout.
//!
//! Degrading never forgets what the host knew (§10): every Redis answer updates the
//! source's [`Known`] record (OPEN until when, a probe's turn, the quota refused until
//! when, on the local clock), and the transition to degraded seeds the local fallback
//! from it (`MemoryBackend::seed`): a source last seen OPEN stays refused until that
//! deadline, and the local fallback never grants a probe (the shared state, where the
//! probe's turn is decided, cannot be read). §18 `learn_rate`: the learned factor the
//! last admit or report carried is known too, and the local quota starts from it
//! (recovering from when it was read), not from the whole limit.
//!
//! Admin operations never take the degraded shortcut (they always ask Redis) and
//! never fall back; see [`Route`].
//!
//! [`Fault::Unreachable`]: super::fault::Fault::Unreachable
//! [`Backend::degraded`]: crate::backend::Backend::degraded

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::memory::Seed;
use crate::backend::{BResult, BackendError, State};
use crate::config::OnBackendError;
use crate::gate::quota::PPM_WHOLE;

/// While a source is degraded, Redis is retried at most this often for it.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Redis's reachability for one source.
#[derive(Debug)]
struct Reachability {
    /// The last Redis call for this source failed.
    down: bool,
    /// While down: when Redis may be tried again.
    next_try: Instant,
    /// While down: the last error, for fail_closed's fast refusals.
    last_error: String,
    /// What the last Redis answers said of the source's shared state (§10).
    known: Known,
}

/// What this host last read of a source's shared state, on the local clock (§10):
/// the local fallback starts from it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Known {
    /// The breaker was OPEN until then.
    open_until: Option<Duration>,
    /// The breaker was HALF_OPEN, or OPEN past its deadline: a probe's turn.
    probe_due: bool,
    /// The quota refused until then (a 429 block, or the shared bucket's wait).
    quota_until: Option<Duration>,
    /// When the shared quota last refused (its buckets were spent then).
    quota_refused_at: Option<Duration>,
    /// §18 `learn_rate`: the learned factor the last admit or report read (ppm of
    /// the limit) and when.
    rate: Option<(u32, Duration)>,
}

/// A shared quota seen refusing within this long is taken as spent when the host
/// degrades: its local buckets start empty, not full (§10: a degraded fleet gets its
/// share of the refill, not a fresh burst on top of what it already used).
pub(super) const SPENT_MEMORY: Duration = Duration::from_secs(60);

/// What one Redis answer says of the shared state (nothing, when `None`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Seen {
    /// The breaker's state and §6 retry-after.
    pub breaker: Option<(State, Duration)>,
    /// The quota's wait (zero: it admitted).
    pub quota: Option<Duration>,
}

impl Known {
    /// Take in the learned factor `ppm` an answer carried, read at `now`.
    fn learn_rate(&mut self, ppm: u32, now: Duration) {
        self.rate = Some((ppm, now));
    }

    /// Take in an answer read at `now` (local clock).
    fn learn(&mut self, seen: Seen, now: Duration) {
        if let Some((state, retry_after)) = seen.breaker {
            (self.open_until, self.probe_due) = match state {
                State::Closed => (None, false),
                State::Open if !retry_after.is_zero() => (Some(now + retry_after), false),
                State::Open | State::HalfOpen => (None, true),
            };
        }
        if let Some(wait) = seen.quota {
            self.quota_until = (!wait.is_zero()).then(|| now + wait);
            if !wait.is_zero() {
                self.quota_refused_at = Some(now);
            }
        }
    }

    /// The local fallback's starting state at `now`: OPEN until the known deadline
    /// (a passed one is a probe's turn), the quota's known refusal, and whether the
    /// quota was seen spent lately.
    pub(super) fn seed(&self, now: Duration) -> Seed {
        let open_for = self.open_until.map(|u| u.saturating_sub(now));
        Seed {
            open_for: open_for.filter(|d| !d.is_zero()),
            probe_due: self.probe_due || open_for.is_some_and(|d| d.is_zero()),
            blocked_for: self
                .quota_until
                .map_or(Duration::ZERO, |u| u.saturating_sub(now)),
            quota_spent: self
                .quota_refused_at
                .is_some_and(|t| now.saturating_sub(t) < SPENT_MEMORY),
            rate: self
                .rate
                .filter(|&(ppm, _)| ppm < PPM_WHOLE)
                .map(|(ppm, at)| (ppm, now.saturating_sub(at))),
        }
    }
}

/// Where one operation goes, decided before it is sent.
pub(super) enum Route {
    /// Ask Redis.
    Redis,
    /// Serve it from local state (degraded, not yet time to retry).
    Local,
}

/// Every configured source's [`Reachability`], and the policy applied to it.
pub(super) struct Reach {
    /// Configured sources (others are [`BackendError::UnknownSource`]).
    sources: HashMap<String, Mutex<Reachability>>,
    /// Degrade to local state or refuse.
    on_error: OnBackendError,
    /// The Redis target, for log lines and errors.
    describe: String,
}

impl Reach {
    /// Every source reachable until a call says otherwise.
    pub(super) fn new(sources: &[String], on_error: OnBackendError, describe: &str) -> Self {
        let now = Instant::now();
        let sources = sources
            .iter()
            .map(|s| {
                (
                    s.clone(),
                    Mutex::new(Reachability {
                        down: false,
                        next_try: now,
                        last_error: String::new(),
                        known: Known::default(),
                    }),
                )
            })
            .collect();
        Reach {
            sources,
            on_error,
            describe: describe.to_string(),
        }
    }

    fn of(&self, source: &str) -> BResult<&Mutex<Reachability>> {
        self.sources
            .get(source)
            .ok_or_else(|| BackendError::UnknownSource(crate::limits::echo(source).into_owned()))
    }

    /// Where an operation on `source` goes. An `admin` operation always asks Redis;
    /// any other one, while the source is down and its retry is not due, is served
    /// locally (`local`) or refused at once (`fail_closed`). The caller that finds
    /// the retry due asks Redis; the others keep going local until the next one.
    pub(super) fn route(&self, source: &str, admin: bool) -> BResult<Route> {
        let r = self.of(source)?;
        if admin {
            return Ok(Route::Redis);
        }
        let mut g = r.lock().unwrap_or_else(|e| e.into_inner());
        if g.down {
            let now = Instant::now();
            if now < g.next_try {
                return match self.on_error {
                    OnBackendError::Local => Ok(Route::Local),
                    OnBackendError::FailClosed => Err(self.unavailable(&g.last_error)),
                };
            }
            // This caller probes; the others keep going local until next_try.
            g.next_try = now + RETRY_INTERVAL;
        }
        Ok(Route::Redis)
    }

    /// Redis answered for `source` at `now` (local clock), saying `seen` of its
    /// shared state: remembered, and the source restored if it was down (logged
    /// once).
    pub(super) fn answered(&self, source: &str, seen: Seen, factor: Option<u32>, now: Duration) {
        let Ok(r) = self.of(source) else { return };
        let mut g = r.lock().unwrap_or_else(|e| e.into_inner());
        g.known.learn(seen, now);
        if let Some(ppm) = factor {
            g.known.learn_rate(ppm, now);
        }
        if g.down {
            g.down = false;
            g.last_error.clear();
            match self.on_error {
                OnBackendError::Local => tracing::info!(
                    source,
                    redis = %self.describe,
                    "redis reachable again; source served from redis"
                ),
                OnBackendError::FailClosed => tracing::info!(
                    source,
                    redis = %self.describe,
                    "redis reachable again; source admitting"
                ),
            }
        }
    }

    /// Redis could not be reached for `source` (`why`): the source is down until a
    /// retry answers (logged once, on the transition). On the transition, `seed` is
    /// given what the host last knew of the source, before any call can be routed to
    /// local state (under this source's lock): the local fallback starts from it.
    pub(super) fn unreachable(&self, source: &str, why: &str, seed: impl FnOnce(&Known)) {
        let Ok(r) = self.of(source) else { return };
        let mut g = r.lock().unwrap_or_else(|e| e.into_inner());
        let was_down = g.down;
        if !was_down {
            seed(&g.known);
        }
        g.down = true;
        g.next_try = Instant::now() + RETRY_INTERVAL;
        g.last_error = why.to_string();
        if !was_down {
            match self.on_error {
                OnBackendError::Local => tracing::warn!(
                    source,
                    redis = %self.describe,
                    error = %g.last_error,
                    "redis unreachable; source degraded to local state"
                ),
                OnBackendError::FailClosed => tracing::warn!(
                    source,
                    redis = %self.describe,
                    error = %g.last_error,
                    "redis unreachable; source refused ({})",
                    OnBackendError::FailClosed.as_str()
                ),
            }
        }
    }

    /// What a non-admin operation answers once Redis could not be reached (`why`):
    /// `Ok` to serve it from local state (`local`), or the refusal naming the target
    /// (`fail_closed`).
    pub(super) fn after_outage(&self, why: &str) -> BResult<()> {
        match self.on_error {
            OnBackendError::Local => Ok(()),
            OnBackendError::FailClosed => Err(self.unavailable(why)),
        }
    }

    /// What an admin operation answers once Redis could not be reached (`why`), in
    /// both modes: a local change would be invisible to every other host.
    pub(super) fn admin_not_applied(&self, why: &str) -> BackendError {
        BackendError::Unavailable(format!(
            "admin operation not applied: shared backend unreachable (redis {}: {why}); \
             a local change would be invisible to every other host, so nothing \
             was changed; retry once redis is back",
            self.describe
        ))
    }

    /// `true` while `source` is served from local state (`local` mode only).
    pub(super) fn degraded(&self, source: &str) -> bool {
        self.on_error == OnBackendError::Local
            && self
                .sources
                .get(source)
                .is_some_and(|r| r.lock().unwrap_or_else(|e| e.into_inner()).down)
    }

    fn unavailable(&self, why: &str) -> BackendError {
        BackendError::Unavailable(format!(
            "redis backend {} unreachable: {why} (on_backend_error = {})",
            self.describe,
            OnBackendError::FailClosed.as_str()
        ))
    }
}

/// Epoch base of the local fallback: at least 2^62, random below that, so no local
/// epoch is ever reached by a Redis breaker (which counts up from 0) and two hosts'
/// (or two runs') local epochs differ too.
pub(super) fn local_epoch_base() -> u64 {
    (1u64 << 62) | (rand::random::<u64>() >> 3)
}

/// An epoch of the local fallback ([`local_epoch_base`]), not of a Redis breaker.
pub(super) fn is_local_epoch(epoch: u64) -> bool {
    epoch >= 1 << 62
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn the_seed_is_what_the_last_answers_said() {
        let mut k = Known::default();
        assert_eq!(
            k.seed(s(5)),
            Seed::default(),
            "nothing known: a fresh source"
        );
        k.learn(
            Seen {
                breaker: Some((State::Open, s(60))),
                quota: Some(s(30)),
            },
            s(10),
        );
        let seed = k.seed(s(20));
        assert_eq!(
            (seed.open_for, seed.probe_due, seed.blocked_for),
            (Some(s(50)), false, s(20))
        );
        // The deadline passed before the outage: a probe's turn, not a fresh CLOSED.
        let seed = k.seed(s(80));
        assert_eq!((seed.open_for, seed.probe_due), (None, true));
        // An answer without quota news keeps the quota's; CLOSED forgets the open.
        k.learn(
            Seen {
                breaker: Some((State::Closed, Duration::ZERO)),
                quota: None,
            },
            s(21),
        );
        assert_eq!(
            k.seed(s(25)),
            Seed {
                open_for: None,
                probe_due: false,
                blocked_for: s(15),
                quota_spent: true,
                rate: None,
            }
        );
        // Seen refusing more than SPENT_MEMORY ago: the buckets start full again.
        assert!(!k.seed(s(10) + SPENT_MEMORY).quota_spent);
        for state in [State::HalfOpen, State::Open] {
            k.learn(
                Seen {
                    breaker: Some((state, Duration::ZERO)),
                    quota: Some(Duration::ZERO),
                },
                s(30),
            );
            assert_eq!(
                k.seed(s(31)),
                Seed {
                    open_for: None,
                    probe_due: true,
                    blocked_for: Duration::ZERO,
                    quota_spent: true,
                    rate: None,
                },
                "{state:?}"
            );
        }
    }

    #[test]
    fn the_seed_carries_the_learned_factor_as_read() {
        let mut k = Known::default();
        k.learn_rate(700_000, s(10));
        assert_eq!(k.seed(s(12)).rate, Some((700_000, s(2))), "read 2 s before");
        k.learn_rate(PPM_WHOLE, s(20));
        assert_eq!(k.seed(s(21)).rate, None, "whole: nothing to carry");
    }

    #[test]
    fn local_epoch_base_is_far_from_redis_epochs() {
        for _ in 0..100 {
            let b = local_epoch_base();
            assert!((1 << 62..(1 << 62) + (1 << 61)).contains(&b), "{b}");
        }
        assert_ne!(local_epoch_base(), local_epoch_base());
    }
}
