//! How an Acquire waits (§5, §15) once a pass granted nothing: the cost rule that
//! keeps a host with many waiters from polling per waiter, the sleeps it chooses
//! (the §5 nap, or to the stall edge), and the guards of a waiting Acquire. The
//! loop that decides when to wait is `acquire/mod.rs`; the waiter orders are
//! `engine/queue.rs`.
//!
//! Its own module because a wait is a separate concern from a pass and the §5
//! dispatch: what it costs, how it ends (nap, wake-up, turn, `EndCall`, shutdown)
//! and what it counts (`sidecar.max_waiters`, the scope's waiters, the wait
//! histogram).
//!
//! **The quota wait is polled per scope, not per waiter** (a §5 change, issue 8).
//! §5 had every waiter refused by quota or pacer (`hint = 0`) nap
//! `poll_interval × [0.5, 1]` and run a full pass again: 10,000 waiters cost ~25
//! passes per second each, ~1.4 cores on an idle host. Now, in a scope without
//! priority classes:
//! - An Acquire whose pass is refused on the quota branch joins the scope's **quota
//!   line** ([`crate::engine::queue::QuotaLine`]), FIFO within the size class of its
//!   estimate (estimates within 2× of each other share a class; the estimate is the
//!   largest over the scope's sources). A new Acquire always checks its budgets
//!   first. **No barging** (§5, issue 21): while the scope's line has members, a new
//!   Acquire joins the back of its size line instead of running its first pass, so
//!   capacity freed for the waiters goes to them, oldest first; it runs that pass
//!   when it becomes its size line's poller. With nobody waiting it runs its first
//!   pass at once, as before (so `fail_fast` dispatch is unchanged). A waiter
//!   refused only for circuit reasons leaves the line (no head-of-line blocking:
//!   it naps on its §6 hint, and the next of its size line takes the poller turn).
//! - The front of each size line is its **poller**: it naps and passes exactly as
//!   §5 says (`nap(hint)`; the quota hint still answers most passes without a
//!   backend round trip). The others, **followers**, run no pass and set no timer
//!   but their stall edge: they sleep until made poller, nudged, or
//!   `stall_window − stall + jitter` (the pass run then ends them as `stalled`, so
//!   §5's `stall_window + poll_interval` bound holds for every waiter).
//! - A poller that leaves — granted, refused, stalled, cancelled, disconnected —
//!   hands the turn to the next of its size line, which runs a pass at once: when
//!   tokens return, waiters are granted in arrival order, one hand-off each, as far
//!   as the capacity goes; a cancelled poller never strands the line.
//! - A freed unit (`wake_one`: a report, a refund, a freed pacer slot or lease)
//!   wakes every size line's poller at once; "many may proceed" (`wake_all`: a
//!   closed breaker, reset, force_close, an admin event from another host, a
//!   reload) nudges every member to run one pass, then the refused go back to their
//!   place. Shutdown ends every wait at once.
//! - Cross-host (Redis): another host may free or take tokens unannounced; the
//!   pollers see it within one `poll_interval`, so some polling remains, bounded by
//!   (scopes naming the source) × (size lines), not by waiters.
//!
//! The trade-off chosen for sizes: within a size line a smaller call may wait
//! behind a bigger one (less than 2× bigger) that does not fit yet, which keeps a big
//! call from being starved by a stream of small ones; across size lines a much
//! smaller call goes ahead when it fits.
//!
//! Scopes with classes keep the §15 queue ([`crate::engine::queue::WaitQueue`]), whose
//! turns already order the passes, under the same cost rule: one waiter, the queue's
//! **napper**, keeps the §5 nap (with its hint) and asks for a turn when it ends; every
//! other waiter sleeps until handed a turn or to its stall edge. A waiter leaving a
//! turn unused (refused by an error, cancelled) hands it on, and so does a leaving
//! napper, so the queue always has someone to look. A turn asked after a nap or a
//! wake-all starts a **chain** (an unknown amount may be free): a grant on it hands the
//! next turn on at once, so a refill or a wake-all (closed breaker, reset) releases
//! waiters one hand-off after another in fair order until one is refused; a turn for
//! one freed unit (`wake_one`) is not a chain, as its grant used the unit.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::backend::Backend;
use crate::clock::Clock;
use crate::config::ScopeConfig;
use crate::engine::error::{EngineError, SkipReason};
use crate::engine::pass::nap;
use crate::engine::runtime::bump;
use crate::engine::Engine;
use crate::histogram::Histogram;

impl<B: Backend> Engine<B> {
    /// The Acquire starts sleeping: count it against `sidecar.max_waiters` (past it
    /// [`EngineError::TooManyWaiters`]), let `EndCall` of `call` end the wait
    /// ([`EngineError::CallEnded`] if it already did), and log the one "wait
    /// started" line.
    pub(super) fn start_waiting(
        &self,
        si: usize,
        class: usize,
        call: u64,
        sleep: Duration,
        reasons: &[Option<SkipReason>],
    ) -> Result<WaiterGuard<'_>, EngineError> {
        let sc = &self.scopes[si];
        let max = self.max_waiters.load(Ordering::Relaxed);
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= max {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineError::TooManyWaiters(max));
        }
        let ended = Arc::new(Notify::new());
        if let Err(e) = self.lock().watch_end(call, ended.clone()) {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(e);
        }
        sc.waiters.fetch_add(1, Ordering::Relaxed);
        bump(&sc.counters.waits);
        if let Some(c) = sc.class_counters.get(class) {
            bump(&c.waits);
        }
        if crate::logs::allow(crate::logs::Kind::WaitStarted) {
            tracing::info!(
                scope = %sc.name,
                class = sc.class_names.get(class).map_or("", |c| &**c),
                reasons = ?self.reasons_of(si, reasons),
                sleep_s = sleep.as_secs_f64(),
                "wait started"
            );
        }
        Ok(WaiterGuard {
            scope: &sc.waiters,
            total: &self.waiting,
            ended,
        })
    }

    /// §15: sleep until the nap ends or another waiter hands this one its turn, then
    /// ask for the turn: `true` = run a pass now.
    pub(super) async fn wait_turn(
        &self,
        place: Option<&crate::engine::queue::Place<'_>>,
        sleep: Duration,
        waiting: &Option<WaiterGuard<'_>>,
        call: u64,
    ) -> Result<bool, EngineError> {
        let Some(p) = place else { return Ok(true) };
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = p.woken() => {}
            _ = self.shutdown.cancelled() => return Err(EngineError::ShuttingDown),
            _ = ended(waiting) => return Err(EngineError::CallEnded(call)),
        }
        Ok(p.turn())
    }
}

/// §5's nap under the scope's policy `cfg`: `hint` plus jitter, within what is
/// left of the stall window after `stall`.
pub(super) fn nap_in(cfg: &ScopeConfig, hint: Duration, stall: Duration) -> Duration {
    nap(
        hint,
        cfg.poll_interval,
        cfg.stall_window,
        stall,
        rand::random::<f64>(),
    )
}

/// The sleep of a waiter that does not poll (a quota-line follower, a §15 waiter
/// that is not the napper): to the edge of its stall window, jittered like any nap;
/// the pass it then runs ends it as stalled, so §5's bound holds for it too.
pub(super) fn stall_edge(cfg: &ScopeConfig, stall: Duration) -> Duration {
    nap_in(cfg, cfg.stall_window.saturating_sub(stall), stall)
}

/// Observes an Acquire's time in its scope's wait histogram when it ends (answered,
/// refused or dropped).
pub(super) struct WaitTimer<'a> {
    /// The scope's histogram.
    pub(super) hist: &'a Histogram,
    /// The engine clock.
    pub(super) clock: &'a dyn Clock,
    /// When the Acquire entered the engine.
    pub(super) started: Duration,
}

impl Drop for WaitTimer<'_> {
    fn drop(&mut self) {
        self.hist
            .observe(self.clock.now().saturating_sub(self.started));
    }
}

/// Counts a sleeping Acquire in its scope's `waiters` and the engine's total.
pub(super) struct WaiterGuard<'a> {
    /// The scope's waiter count, decremented on drop.
    scope: &'a AtomicU32,
    /// The engine's count of waiting requests (`sidecar.max_waiters`).
    total: &'a AtomicUsize,
    /// Woken by `EndCall` of the call: the wait ends at once (§12).
    ended: Arc<Notify>,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.scope.fetch_sub(1, Ordering::Relaxed);
        self.total.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Resolves when `EndCall` ended the waiting Acquire's call; never before it waits.
pub(super) async fn ended(waiting: &Option<WaiterGuard<'_>>) {
    match waiting {
        Some(w) => w.ended.notified().await,
        None => std::future::pending().await,
    }
}
