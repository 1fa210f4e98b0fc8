//! The §5 quota line of a scope without priority classes ([`QuotaLine`]): its
//! Acquires that wait on quota (or the pacer) queue FIFO per size of estimate, and
//! only the front of each size line polls. A module of its own beside
//! [`super::queue`] (the classed scopes' fair queue): the two orders share nothing
//! but the wake-up rule written in `acquire/wait.rs`'s header.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use super::queue::GONE;

/// §5 quota line of a scope without classes: its Acquires that wait on quota (or on
/// the pacer) queue here, FIFO per [`size_class`] of their estimate, and only the
/// front of each size line — the **poller** — runs a pass every `poll_interval`.
/// The others (followers) sleep with no timer but their stall deadline until the
/// poller leaves (granted, ended, cancelled: it hands the poller turn on, and the
/// next runs a pass at once), a freed unit wakes the pollers ([`QuotaLine::
/// wake_pollers`]), or many may proceed ([`QuotaLine::wake_all`]: every member runs
/// one pass, then followers go back to waiting in their place).
///
/// So the passes of a quota wait cost one per size line per poll interval, not one
/// per waiter: 10,000 waiters of one size on an exhausted quota cost what one does.
/// Size lines exist so a small call is never held back by one more than twice its
/// size ahead of it (it could fit while that one does not); within a size line the
/// order is strictly FIFO. The number of size lines is bounded by the bits of a
/// token count (at most 65, in practice a handful).
///
/// Cancel-safety: a [`Spot`] leaves when dropped; a poller that leaves hands the
/// turn on with a stored permit ([`Notify::notify_one`]), so the hand-off is never
/// lost even if the next one is not sleeping yet.
#[derive(Debug, Default)]
pub(crate) struct QuotaLine {
    /// The size lines in use (empty ones are dropped).
    lines: Mutex<Vec<SizeLine>>,
    /// Members over every size line, written under the lock and read without it:
    /// a new Acquire's one look (§5 "no barging": it joins behind them).
    members: AtomicU32,
}

/// A spot holds the poller turn.
const POLLER: u8 = 1;
/// A spot waits behind the poller.
const FOLLOWER: u8 = 0;

/// One size class's FIFO.
#[derive(Debug)]
struct SizeLine {
    /// The [`size_class`] of its members.
    size: u32,
    /// Members in arrival order; the front is live and is the poller (`GONE`
    /// entries behind it are dropped lazily).
    entries: VecDeque<Arc<Liner>>,
    /// Entries not `GONE`.
    live: u32,
}

/// One member of a size line.
#[derive(Debug)]
struct Liner {
    /// `FOLLOWER` / `POLLER` / `GONE`; written only under the line lock.
    state: AtomicU8,
    /// Woken when made poller or nudged (a stored permit if not sleeping yet).
    notify: Notify,
}

/// The size class of an estimate of `tokens`: calls in one class differ by less
/// than 2× (0 and 1 have classes of their own).
pub(crate) fn size_class(tokens: u64) -> u32 {
    u64::BITS - tokens.leading_zeros()
}

impl QuotaLine {
    fn lock(&self) -> MutexGuard<'_, Vec<SizeLine>> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Join the back of size line `size`; the first member of an empty line is its
    /// poller at once. The spot leaves when dropped.
    pub(crate) fn join(&self, size: u32) -> Spot<'_> {
        let mut lines = self.lock();
        let i = match lines.iter().position(|l| l.size == size) {
            Some(i) => i,
            None => {
                lines.push(SizeLine {
                    size,
                    entries: VecDeque::new(),
                    live: 0,
                });
                lines.len() - 1
            }
        };
        let l = &mut lines[i];
        let state = if l.entries.is_empty() {
            POLLER
        } else {
            FOLLOWER
        };
        let me = Arc::new(Liner {
            state: AtomicU8::new(state),
            notify: Notify::new(),
        });
        l.entries.push_back(me.clone());
        l.live += 1;
        self.members.fetch_add(1, Ordering::Relaxed);
        drop(lines);
        Spot {
            line: self,
            size,
            me,
        }
    }

    /// A freed unit (pacer slot, reservation, probe lease): every size line's
    /// poller runs a pass now (at most one per size line, so a handful).
    pub(crate) fn wake_pollers(&self) {
        for l in self.lock().iter() {
            if let Some(f) = l.entries.front() {
                f.notify.notify_one();
            }
        }
    }

    /// Many may proceed (breaker closed, reset, admin action, reload): every member
    /// runs one pass.
    pub(crate) fn wake_all(&self) {
        for l in self.lock().iter() {
            for m in &l.entries {
                if m.state.load(Ordering::Relaxed) != GONE {
                    m.notify.notify_one();
                }
            }
        }
    }

    /// Members of the line (all size lines), for tests and status.
    #[allow(dead_code)]
    pub(crate) fn len(&self) -> usize {
        self.lock().iter().map(|l| l.live as usize).sum()
    }

    /// Anyone waits in the line (one atomic load, no lock): a new Acquire then
    /// joins behind them instead of running its first pass (§5 "no barging").
    pub(crate) fn has_members(&self) -> bool {
        self.members.load(Ordering::Relaxed) > 0
    }
}

/// An Acquire's place in its scope's [`QuotaLine`]; leaves it when dropped.
pub(crate) struct Spot<'a> {
    /// The scope's line.
    line: &'a QuotaLine,
    /// Its size line.
    size: u32,
    /// Its entry.
    me: Arc<Liner>,
}

impl Spot<'_> {
    /// `true` while this spot holds its size line's poller turn (it polls every
    /// `poll_interval`); `false`: it waits for [`Spot::woken`].
    pub(crate) fn is_poller(&self) -> bool {
        self.me.state.load(Ordering::Relaxed) == POLLER
    }

    /// Made poller, nudged, or a freed unit (as poller).
    pub(crate) async fn woken(&self) {
        self.me.notify.notified().await
    }
}

impl Drop for Spot<'_> {
    fn drop(&mut self) {
        let mut lines = self.line.lock();
        let Some(i) = lines.iter().position(|l| l.size == self.size) else {
            return;
        };
        let l = &mut lines[i];
        self.me.state.store(GONE, Ordering::Relaxed);
        l.live -= 1;
        self.line.members.fetch_sub(1, Ordering::Relaxed);
        let was_front = l.entries.front().is_some_and(|f| Arc::ptr_eq(f, &self.me));
        while l
            .entries
            .front()
            .is_some_and(|f| f.state.load(Ordering::Relaxed) == GONE)
        {
            l.entries.pop_front();
        }
        if l.entries.len() > 2 * l.live as usize + 16 {
            l.entries
                .retain(|m| m.state.load(Ordering::Relaxed) != GONE);
        }
        if was_front {
            // Hand the poller turn on: the next runs a pass at once.
            if let Some(next) = l.entries.front() {
                next.state.store(POLLER, Ordering::Relaxed);
                next.notify.notify_one();
            }
        }
        if l.entries.is_empty() {
            lines.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_split_at_powers_of_two() {
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(1), 1);
        assert_eq!((size_class(2), size_class(3)), (2, 2));
        assert_eq!((size_class(1000), size_class(1023)), (10, 10));
        assert_eq!(size_class(1024), 11);
        assert_eq!(size_class(u64::MAX), 64);
    }

    #[test]
    fn the_front_of_each_size_line_polls_and_hands_on_when_it_leaves() {
        let q = QuotaLine::default();
        let a = q.join(3);
        let b = q.join(3);
        let c = q.join(3);
        let small = q.join(1);
        assert!(a.is_poller() && !b.is_poller() && !c.is_poller());
        assert!(small.is_poller(), "a size line of its own");
        drop(b); // a follower leaves: nothing changes
        assert!(a.is_poller() && !c.is_poller());
        drop(a); // the poller leaves: the next live one polls, and is woken
        assert!(c.is_poller());
        let woke = futures_now(c.woken());
        assert!(woke, "the hand-off left a permit");
        assert_eq!(q.len(), 2);
        drop(c);
        drop(small);
        assert_eq!(q.len(), 0);
        assert!(q.lock().is_empty(), "empty size lines are dropped");
        assert!(q.join(3).is_poller(), "a new line starts with its poller");
    }

    #[test]
    fn wake_pollers_reaches_only_pollers_and_wake_all_everyone() {
        let q = QuotaLine::default();
        let a = q.join(2);
        let b = q.join(2);
        q.wake_pollers();
        assert!(futures_now(a.woken()));
        assert!(!futures_now(b.woken()), "a follower sleeps on");
        q.wake_all();
        assert!(futures_now(a.woken()) && futures_now(b.woken()));
    }

    #[test]
    fn many_leaving_followers_are_compacted() {
        let q = QuotaLine::default();
        let head = q.join(5);
        let rest: Vec<_> = (0..1000).map(|_| q.join(5)).collect();
        drop(rest);
        assert_eq!(q.len(), 1);
        assert!(
            q.lock()[0].entries.len() <= 2 + 16,
            "gone entries are dropped"
        );
        assert!(head.is_poller());
    }

    /// Poll a future once: `true` if it was ready.
    fn futures_now(f: impl std::future::Future<Output = ()>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut f = std::pin::pin!(f);
        f.as_mut().poll(&mut cx).is_ready()
    }
}
