//! Breaker transitions as this host observes them (§12: one log line per state
//! change, and the `polygate_breaker_transitions` counter family).
//!
//! On the memory backend the host sees every transition it causes; on Redis a
//! transition happens inside `gate.lua` and the host sees the state and epoch the
//! script answers: its own reports' verdicts (with the channel that tripped the
//! breaker), its admissions' answers (a probe granted, an OPEN refusal), its admin
//! actions. A change another host caused shows up on this host's next admission
//! with the reason `observed`. Epochs order the observations: an answer older than
//! the last one seen is ignored.
//!
//! Bounded: at most [`LOG_BURST`] lines per source per [`LOG_PERIOD`]; the rest are
//! only counted, and the next logged line says how many were not (`unlogged`). A
//! 429 block is logged once when it starts, not once per 429 during it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::gate::breaker::{State, Trip};

/// Lines per source per [`LOG_PERIOD`] before the rest are only counted.
pub(crate) const LOG_BURST: u32 = 10;
/// The period of [`LOG_BURST`].
pub(crate) const LOG_PERIOD: Duration = Duration::from_secs(60);

/// Why the state changed, as the log and the metric's `reason` label say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reason {
    /// `failure_threshold` consecutive failures opened it.
    Streak,
    /// The window's failure rate opened it.
    FailureRate,
    /// The half-open probe failed: open again, one level longer.
    ProbeFailure,
    /// The half-open probe succeeded: closed.
    ProbeSuccess,
    /// The cooldown ended and this host was granted the probe.
    CooldownOver,
    /// An operator's force_open or force_close on this host.
    Force,
    /// An operator's reset on this host.
    Reset,
    /// An upstream 429 with a retry-after blocked the source's quota.
    QuotaBlock,
    /// The backend answered with a state this host had not seen (another host's
    /// doing, on a shared backend).
    Observed,
}

impl Reason {
    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Streak => "streak",
            Reason::FailureRate => "failure_rate",
            Reason::ProbeFailure => "probe_failure",
            Reason::ProbeSuccess => "probe_success",
            Reason::CooldownOver => "cooldown_over",
            Reason::Force => "force",
            Reason::Reset => "reset",
            Reason::QuotaBlock => "429_block",
            Reason::Observed => "observed",
        }
    }
}

impl From<Trip> for Reason {
    fn from(t: Trip) -> Self {
        match t {
            Trip::Streak => Reason::Streak,
            Trip::FailureRate => Reason::FailureRate,
        }
    }
}

/// A state as the log and the metric name it: the breaker's three, `unknown`
/// before the first sighting, and `blocked` for a 429 block of the quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Seen {
    /// Nothing seen yet (a shared breaker may be in any state when this host starts).
    Unknown,
    /// A breaker state.
    Breaker(u8),
    /// The quota blocked by an upstream 429 (the `to` of a [`Reason::QuotaBlock`]).
    Blocked,
}

fn code(s: State) -> u8 {
    match s {
        State::Closed => 0,
        State::Open => 1,
        State::HalfOpen => 2,
    }
}

impl Seen {
    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Seen::Unknown => "unknown",
            Seen::Breaker(0) => "closed",
            Seen::Breaker(1) => "open",
            Seen::Breaker(_) => "half_open",
            Seen::Blocked => "blocked",
        }
    }
}

/// One observation to record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Observation {
    /// The state the backend answered.
    pub(crate) state: State,
    /// Its epoch.
    pub(crate) epoch: u64,
    /// Why, if the change is this host's doing; `Observed` otherwise.
    pub(crate) reason: Reason,
    /// OPEN: the cooldown left; else zero.
    pub(crate) cooldown: Duration,
    /// The cooldown level, when the answer carried it.
    pub(crate) level: Option<u32>,
}

impl Observation {
    /// A state without cooldown or level.
    pub(crate) fn of(state: State, epoch: u64, reason: Reason) -> Self {
        Observation {
            state,
            epoch,
            reason,
            cooldown: Duration::ZERO,
            level: None,
        }
    }
}

/// Key of one counter: (scope index, from, to, reason).
type Key = (usize, Seen, Seen, Reason);

/// What the source's log and counters remember.
#[derive(Debug)]
struct Inner {
    /// The last state seen.
    state: Seen,
    /// Its epoch.
    epoch: u64,
    /// When a 429 block seen by this host ends (engine clock).
    blocked_until: Duration,
    /// Start of the current log period (engine clock).
    period_start: Duration,
    /// Lines logged in the current period.
    logged: u32,
    /// Transitions not logged since the last line (over the burst).
    unlogged: u64,
    /// Counters for `/metrics`.
    counts: BTreeMap<Key, u64>,
}

/// One source's observed transitions.
#[derive(Debug)]
pub(crate) struct Transitions {
    /// The last state seen, lock-free: the hot path (every admission answers a
    /// state) only locks when the state differs.
    fast: AtomicU8,
    /// The rest, under a lock taken only on a change.
    inner: Mutex<Inner>,
}

/// `fast` before the first sighting.
const FAST_UNKNOWN: u8 = u8::MAX;

impl Default for Transitions {
    fn default() -> Self {
        Transitions {
            fast: AtomicU8::new(FAST_UNKNOWN),
            inner: Mutex::new(Inner {
                state: Seen::Unknown,
                epoch: 0,
                blocked_until: Duration::ZERO,
                period_start: Duration::ZERO,
                logged: 0,
                unlogged: 0,
                counts: BTreeMap::new(),
            }),
        }
    }
}

/// The names a log line carries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Names<'a> {
    /// Index of the scope the observation came through (the metric's label).
    pub(crate) scope_idx: usize,
    /// Its name.
    pub(crate) scope: &'a str,
    /// The source.
    pub(crate) source: &'a str,
}

impl Transitions {
    /// Record what the backend answered; logs and counts a change (`now` is read
    /// only then: the hot path reads no clock).
    pub(crate) fn observe(&self, now: impl FnOnce() -> Duration, names: Names<'_>, o: Observation) {
        let to = code(o.state);
        if self.fast.load(Ordering::Relaxed) == to {
            return;
        }
        let now = now();
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if o.epoch < g.epoch {
            return; // an answer older than one already seen
        }
        g.epoch = o.epoch;
        let from = g.state;
        let to_seen = Seen::Breaker(to);
        self.fast.store(to, Ordering::Relaxed);
        g.state = to_seen;
        if from == to_seen || (from == Seen::Unknown && o.state == State::Closed) {
            return; // no change, or the start every breaker has
        }
        self.record(&mut g, now, names, from, to_seen, o);
    }

    /// An upstream 429 blocked the quota for `d`: one line when a block starts.
    pub(crate) fn quota_block(&self, now: Duration, names: Names<'_>, d: Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let starts = now >= g.blocked_until;
        g.blocked_until = g.blocked_until.max(now.saturating_add(d));
        if !starts {
            return;
        }
        let from = g.state;
        let o = Observation {
            state: State::Closed, // unused for a block
            epoch: g.epoch,
            reason: Reason::QuotaBlock,
            cooldown: d,
            level: None,
        };
        self.record(&mut g, now, names, from, Seen::Blocked, o);
    }

    fn record(
        &self,
        g: &mut Inner,
        now: Duration,
        names: Names<'_>,
        from: Seen,
        to: Seen,
        o: Observation,
    ) {
        *g.counts
            .entry((names.scope_idx, from, to, o.reason))
            .or_insert(0) += 1;
        if now.saturating_sub(g.period_start) >= LOG_PERIOD || g.period_start.is_zero() {
            g.period_start = now.max(Duration::from_nanos(1));
            g.logged = 0;
        }
        if g.logged >= LOG_BURST {
            g.unlogged += 1;
            return;
        }
        g.logged += 1;
        let unlogged = std::mem::take(&mut g.unlogged);
        let (from, to, reason) = (from.as_str(), to.as_str(), o.reason.as_str());
        let cooldown_s = o.cooldown.as_secs_f64();
        tracing::info!(
            scope = names.scope,
            source = names.source,
            from,
            to,
            reason,
            cooldown_s,
            level = o.level,
            epoch = o.epoch,
            unlogged,
            "breaker {}: {from} -> {to} ({reason})",
            names.source
        );
    }

    /// Every counter: (scope index, from, to, reason, count).
    pub(crate) fn counts(&self) -> Vec<(usize, &'static str, &'static str, &'static str, u64)> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.counts
            .iter()
            .map(|(&(s, f, t, r), &n)| (s, f.as_str(), t.as_str(), r.as_str(), n))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Names<'static> {
        Names {
            scope_idx: 0,
            scope: "chat",
            source: "primary",
        }
    }

    fn obs(state: State, epoch: u64, reason: Reason) -> Observation {
        Observation {
            state,
            epoch,
            reason,
            cooldown: Duration::from_secs(1),
            level: Some(0),
        }
    }

    #[test]
    fn counts_each_change_once_and_ignores_older_answers() {
        let t = Transitions::default();
        let now = Duration::from_secs(5);
        t.observe(|| now, names(), obs(State::Closed, 0, Reason::Observed));
        t.observe(|| now, names(), obs(State::Open, 1, Reason::Streak));
        t.observe(|| now, names(), obs(State::Open, 1, Reason::Observed));
        // An admission answered before the open (epoch 0) changes nothing.
        t.observe(|| now, names(), obs(State::Closed, 0, Reason::Observed));
        t.observe(
            || now,
            names(),
            obs(State::HalfOpen, 2, Reason::CooldownOver),
        );
        t.observe(|| now, names(), obs(State::Closed, 3, Reason::ProbeSuccess));
        assert_eq!(
            t.counts(),
            vec![
                (0, "closed", "open", "streak", 1),
                (0, "open", "half_open", "cooldown_over", 1),
                (0, "half_open", "closed", "probe_success", 1),
            ]
        );
    }

    #[test]
    fn a_429_block_counts_once_while_it_lasts() {
        let t = Transitions::default();
        let d = Duration::from_secs(10);
        t.quota_block(Duration::from_secs(1), names(), d);
        t.quota_block(Duration::from_secs(2), names(), d);
        t.quota_block(Duration::from_secs(30), names(), d);
        assert_eq!(t.counts(), vec![(0, "unknown", "blocked", "429_block", 2)]);
    }

    #[test]
    fn logging_is_bounded_per_period_but_counting_is_not() {
        let t = Transitions::default();
        let now = Duration::from_secs(1);
        for e in 1..=40u64 {
            let s = if e % 2 == 1 {
                State::Open
            } else {
                State::Closed
            };
            t.observe(|| now, names(), obs(s, e, Reason::Force));
        }
        let g = t.inner.lock().unwrap();
        assert_eq!(g.logged, LOG_BURST);
        assert_eq!(g.unlogged, 40 - LOG_BURST as u64);
        let total: u64 = g.counts.values().sum();
        assert_eq!(total, 40);
    }
}
