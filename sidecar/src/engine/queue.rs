//! §15 waiter order on one host: weighted fair queueing across a scope's priority
//! classes, FIFO within a class. Only scopes that declare classes have a queue; the
//! others keep their plain wake-up channel (today's behaviour exactly).
//!
//! Every Acquire of a classed scope joins its class's queue and then asks for a
//! **turn** before each admission pass. A turn goes to the next waiter in fair order
//! (which need not be the one asking: then that one is woken and the asker naps on).
//! So whatever triggers a pass — a freed pacer slot or reservation ([`WaitQueue::
//! wake_next`]), a nap ending (quota refill, cooldown end), a new arrival — the pass
//! is run by the waiter fair order says is next, and the number of passes stays what
//! it was without classes: one per trigger.
//!
//! Fair order is stride scheduling over virtual time: each class has a `pass` that
//! advances by `1 / weight` for every turn it is given, the queued class with the
//! smallest `pass` goes next, and a class that was idle re-enters at the current
//! virtual time (it cannot bank credit while absent). Over any stretch in which two
//! classes both wait, their turns — and so their grants — are in the ratio of their
//! weights, and no class with weight > 0 starves. A turn whose pass granted nothing is
//! given back ([`WaitQueue::unwake`]), so only grants count.
//!
//! Cost: one short lock per turn; picking is O(classes) (at most 16); entries that left (granted, cancelled) are dropped
//! lazily from the front and compacted when they outnumber the live ones, so every
//! operation is amortised O(1) in the number of waiters — no scan of every waiter
//! except for [`WaitQueue::wake_all`] (an operator action, a closed breaker).
//!
//! Cancel-safety: a waiter's [`Place`] leaves the queue when dropped; a waiter that
//! was given a turn and leaves without a grant passes the turn on, so a cancelled
//! waiter neither keeps its place nor swallows the wake-up meant for the next one.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// Waiting for a turn.
const QUEUED: u8 = 0;
/// Given a turn: running (or about to run) an admission pass.
const WOKEN: u8 = 1;
/// Left the queue (granted, refused, cancelled).
const GONE: u8 = 2;

/// One waiter's entry, shared between its [`Place`] and the queue.
#[derive(Debug)]
pub(crate) struct Waiter {
    /// Index of the waiter's class in the scope's classes.
    class: usize,
    /// `QUEUED` / `WOKEN` / `GONE`; written only under the queue lock.
    state: AtomicU8,
    /// Woken when the waiter is given a turn by someone else (a stored permit if it
    /// is not sleeping yet, so no turn is lost).
    notify: Notify,
}

impl Waiter {
    fn state(&self) -> u8 {
        self.state.load(Ordering::Relaxed)
    }

    fn set(&self, s: u8) {
        self.state.store(s, Ordering::Relaxed)
    }
}

/// One class's queue and its virtual time.
#[derive(Debug)]
struct ClassQ {
    /// `1 / weight`: how far a turn moves the class's `pass`.
    stride: f64,
    /// Virtual finish time of the class's last turn.
    pass: f64,
    /// Entries in arrival order (some may be `WOKEN` or `GONE`).
    entries: VecDeque<Arc<Waiter>>,
    /// Entries not `GONE`.
    live: u32,
    /// Entries `QUEUED`.
    queued: u32,
    /// Turns given and not given back (statistics: the class's waited grants).
    turns: u64,
}

#[derive(Debug)]
struct State {
    /// The scope's classes, config order.
    classes: Vec<ClassQ>,
    /// Start tag of the last turn given: where an idle class re-enters.
    vtime: f64,
    /// Wake-ups that found nobody queued while someone was mid-pass: the next
    /// waiter whose pass fails runs again at once instead of napping (the freed
    /// unit came after it looked).
    pending: u32,
    /// Entries `WOKEN`.
    woken: u32,
}

/// A classed scope's waiters in fair order.
#[derive(Debug)]
pub(crate) struct WaitQueue {
    state: Mutex<State>,
}

/// Per-class figures for status.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct ClassQueueView {
    /// Waiters of the class (queued or mid-pass).
    pub(crate) waiting: u32,
    /// Turns given and not given back.
    #[allow(dead_code)] // kept for debugging; status counts grants itself
    pub(crate) turns: u64,
}

impl WaitQueue {
    /// An empty queue over classes of these weights (each > 0).
    pub(crate) fn new(weights: &[f64]) -> Self {
        WaitQueue {
            state: Mutex::new(State {
                classes: weights
                    .iter()
                    .map(|&w| ClassQ {
                        stride: 1.0 / w.max(f64::MIN_POSITIVE),
                        pass: 0.0,
                        entries: VecDeque::new(),
                        live: 0,
                        queued: 0,
                        turns: 0,
                    })
                    .collect(),
                vtime: 0.0,
                pending: 0,
                woken: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// New weights (SIGHUP; same classes): strides change, places are kept.
    pub(crate) fn reweigh(&self, weights: &[f64]) {
        let mut st = self.lock();
        for (c, &w) in st.classes.iter_mut().zip(weights) {
            c.stride = 1.0 / w.max(f64::MIN_POSITIVE);
        }
    }

    /// Join `class` at the back. The returned place leaves the queue when dropped.
    pub(crate) fn join(&self, class: usize) -> Place<'_> {
        let w = Arc::new(Waiter {
            class,
            state: AtomicU8::new(QUEUED),
            notify: Notify::new(),
        });
        let mut st = self.lock();
        let vtime = st.vtime;
        let c = &mut st.classes[class];
        if c.live == 0 {
            c.pass = c.pass.max(vtime); // an idle class banks no credit
        }
        c.entries.push_back(w.clone());
        c.live += 1;
        c.queued += 1;
        drop(st);
        Place {
            queue: self,
            waiter: w,
        }
    }

    /// A freed unit of capacity: give the turn to the next waiter in fair order.
    /// With nobody queued but someone mid-pass, remember it for them
    /// ([`Place::retry_now`]).
    pub(crate) fn wake_next(&self) {
        let mut st = self.lock();
        match pick(&mut st) {
            Some(w) => w.notify.notify_one(),
            None => st.pending = (st.pending + 1).min(st.woken),
        }
    }

    /// Many may proceed (a breaker closed, an admin action, a reload): nudge every
    /// queued waiter; each asks for a turn, so the passes still run in fair order.
    pub(crate) fn wake_all(&self) {
        let st = self.lock();
        for c in &st.classes {
            for w in &c.entries {
                if w.state() == QUEUED {
                    w.notify.notify_one();
                }
            }
        }
    }

    /// Per-class figures, config order.
    pub(crate) fn view(&self) -> Vec<ClassQueueView> {
        self.lock()
            .classes
            .iter()
            .map(|c| ClassQueueView {
                waiting: c.live,
                turns: c.turns,
            })
            .collect()
    }
}

/// The next waiter in fair order, marked `WOKEN` and its class charged: the head of
/// the class with the smallest `pass` (a head mid-pass counts at the `pass` it was
/// picked at). When that head is already mid-pass, nobody: the turn is its, and a
/// concurrent pass by a lower class could take the freed unit first. Only a class's
/// head ever gets a turn, so within a class the order is strictly FIFO.
fn pick(st: &mut State) -> Option<Arc<Waiter>> {
    for c in &mut st.classes {
        while c.entries.front().is_some_and(|w| w.state() == GONE) {
            c.entries.pop_front();
        }
    }
    let (ci, queued) = st
        .classes
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let head = c.entries.front()?;
            let queued = head.state() == QUEUED;
            let tag = if queued { c.pass } else { c.pass - c.stride };
            Some((i, tag, queued))
        })
        .min_by(|(i, a, _), (j, b, _)| a.total_cmp(b).then(i.cmp(j)))
        .map(|(i, _, q)| (i, q))?;
    if !queued {
        return None;
    }
    charge(st, ci)
}

/// Give class `ci`'s head its turn.
fn charge(st: &mut State, ci: usize) -> Option<Arc<Waiter>> {
    let c = &mut st.classes[ci];
    let w = c.entries.front()?.clone();
    w.set(WOKEN);
    c.queued -= 1;
    c.turns += 1;
    st.vtime = c.pass;
    c.pass += c.stride;
    st.woken += 1;
    Some(w)
}

/// A waiter's place in its scope's queue; leaves it when dropped.
pub(crate) struct Place<'a> {
    /// The queue.
    queue: &'a WaitQueue,
    /// This waiter's entry.
    waiter: Arc<Waiter>,
}

impl Place<'_> {
    /// The first turn of a new arrival: with nobody queued (every other waiter, if
    /// any, mid-pass: no contention yet) it is its own at once, so passes of
    /// unsaturated traffic run side by side; otherwise it asks like everyone
    /// ([`Place::turn`]).
    pub(crate) fn arrive(&self) -> bool {
        let mut st = self.queue.lock();
        let others_queued = st.classes.iter().map(|c| c.queued).sum::<u32>() > 1;
        if others_queued || self.waiter.state() != QUEUED {
            drop(st);
            return self.turn();
        }
        // It may not be its class's head (others of its class mid-pass): it still
        // runs now, as FIFO among passes that all run at once is moot.
        let vtime = st.vtime;
        let c = &mut st.classes[self.waiter.class];
        self.waiter.set(WOKEN);
        c.queued -= 1;
        c.turns += 1;
        let start = c.pass;
        c.pass += c.stride;
        st.vtime = vtime.max(start);
        st.woken += 1;
        true
    }

    /// Ask for a turn: `true` when it is this waiter's (run a pass now), `false` when
    /// it went to the waiter fair order put first (that one was woken; nap on).
    pub(crate) fn turn(&self) -> bool {
        let mut st = self.queue.lock();
        match self.waiter.state() {
            WOKEN => return true,
            GONE => return false,
            _ => {}
        }
        match pick(&mut st) {
            Some(w) if Arc::ptr_eq(&w, &self.waiter) => true,
            Some(w) => {
                w.notify.notify_one();
                false
            }
            None => false,
        }
    }

    /// The pass after a turn granted nothing: give the turn back (the class is not
    /// charged for it) and queue again in the same place. `true` when a wake-up came
    /// while the pass ran and found nobody queued: run the pass again at once.
    pub(crate) fn retry_now(&self) -> bool {
        let mut st = self.queue.lock();
        if self.waiter.state() != WOKEN {
            return false;
        }
        if st.pending > 0 {
            st.pending -= 1;
            return true; // keeps the turn
        }
        self.waiter.set(QUEUED);
        st.woken -= 1;
        let c = &mut st.classes[self.waiter.class];
        c.queued += 1;
        c.turns -= 1;
        c.pass -= c.stride;
        false
    }

    /// Woken by another waiter's hand-off or a freed unit.
    pub(crate) async fn woken(&self) {
        self.waiter.notify.notified().await
    }

    /// Leave with a grant: the turn stays charged to the class.
    pub(crate) fn granted(self) {
        self.leave(true);
    }

    fn leave(&self, granted: bool) {
        let mut st = self.queue.lock();
        let was = self.waiter.state();
        if was == GONE {
            return;
        }
        self.waiter.set(GONE);
        let pass_on = was == WOKEN && !granted;
        if was == WOKEN {
            st.woken -= 1;
            st.pending = st.pending.min(st.woken);
        }
        let c = &mut st.classes[self.waiter.class];
        c.live -= 1;
        if was == QUEUED {
            c.queued -= 1;
        }
        if pass_on {
            // Refused or cancelled mid-turn: the turn was not used, hand it on.
            c.turns -= 1;
            c.pass -= c.stride;
        }
        while c.entries.front().is_some_and(|w| w.state() == GONE) {
            c.entries.pop_front();
        }
        if c.entries.len() > 2 * c.live as usize + 16 {
            c.entries.retain(|w| w.state() != GONE);
        }
        if pass_on {
            if let Some(w) = pick(&mut st) {
                w.notify.notify_one();
            }
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.leave(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Who gets each of `n` turns when every class always has a waiter queued.
    fn shares(weights: &[f64], n: usize) -> Vec<usize> {
        let q = WaitQueue::new(weights);
        let mut places: Vec<VecDeque<Place<'_>>> =
            weights.iter().map(|_| VecDeque::new()).collect();
        for (c, p) in places.iter_mut().enumerate() {
            for _ in 0..3 {
                p.push_back(q.join(c));
            }
        }
        let mut got = vec![0; weights.len()];
        for _ in 0..n {
            let mut st = q.lock();
            let w = pick(&mut st).expect("someone queued");
            drop(st);
            got[w.class] += 1;
            let p = places[w.class].pop_front().unwrap();
            assert!(Arc::ptr_eq(&p.waiter, &w), "FIFO within the class");
            p.granted();
            places[w.class].push_back(q.join(w.class));
        }
        got
    }

    #[test]
    fn turns_follow_the_weights() {
        assert_eq!(shares(&[8.0, 1.0], 900), vec![800, 100]);
        assert_eq!(shares(&[1.0, 1.0], 100), vec![50, 50]);
        let g = shares(&[3.0, 2.0, 1.0], 600);
        assert_eq!(g, vec![300, 200, 100]);
    }

    #[test]
    fn a_turn_given_back_is_not_charged_and_a_cancelled_turn_passes_on() {
        let q = WaitQueue::new(&[1.0, 1.0]);
        let a = q.join(0);
        let b = q.join(1);
        let a2 = q.join(0);
        assert!(a.turn(), "class 0 first on a tie");
        assert!(!a.retry_now());
        assert!(a.turn(), "given back: class 0 still has the smaller pass");
        drop(a); // cancelled mid-turn: the turn goes on to the next in fair order
        assert_eq!(
            a2.waiter.state(),
            WOKEN,
            "a2: class 0 was not charged for a"
        );
        assert_eq!(b.waiter.state(), QUEUED);
        a2.granted();
        assert!(b.turn(), "class 1 is behind now");
    }

    #[test]
    fn a_wake_during_a_pass_is_not_lost() {
        let q = WaitQueue::new(&[1.0]);
        let a = q.join(0);
        assert!(a.turn());
        q.wake_next(); // nobody queued, a is mid-pass
        assert!(a.retry_now(), "the freed unit came after a looked");
        assert!(!a.retry_now());
    }
}
