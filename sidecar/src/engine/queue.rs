//! Waiter order on one host: for a scope with priority classes, §15's weighted fair
//! queueing across classes, FIFO within a class ([`WaitQueue`]); for a scope without,
//! the §5 quota line ([`QuotaLine`]): FIFO per size of estimate, only the front of
//! each size polls. Both keep waiting cheap with many waiters: one waiter per scope
//! (per size line) naps `poll_interval`, the others sleep until handed a turn or to
//! their stall edge (the rule is written in `acquire/wait.rs`'s header).
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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
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
    /// The current turn is part of a **chain**: given when an unknown amount of
    /// capacity may be free (a nap ended, a wake-all, a previous chain grant), so a
    /// grant on it hands a turn on at once. A turn for one freed unit
    /// ([`WaitQueue::wake_next`]) or a newcomer's own is not: its grant used the unit.
    /// Written only under the queue lock.
    chain: AtomicBool,
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
    /// §5 (issue 8): the one waiter that naps `poll_interval` on the queue's behalf
    /// and asks for a turn when its nap ends; every other waiter sleeps until it is
    /// given a turn (or to its stall edge), so a saturated scope's waiting costs one
    /// nap per poll interval, not one per waiter. `None`: nobody has it yet.
    napper: Option<Arc<Waiter>>,
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
                napper: None,
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
            chain: AtomicBool::new(false),
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
            Some(w) => {
                w.chain.store(false, Ordering::Relaxed);
                w.notify.notify_one()
            }
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
        self.waiter.chain.store(false, Ordering::Relaxed);
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
        // Asked after a nap or a wake-all: how much is free is unknown, so the
        // turn starts a chain.
        match pick(&mut st) {
            Some(w) if Arc::ptr_eq(&w, &self.waiter) => {
                w.chain.store(true, Ordering::Relaxed);
                true
            }
            Some(w) => {
                w.chain.store(true, Ordering::Relaxed);
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

    /// Take the queue's nap duty if nobody holds it (`true`: this waiter holds it
    /// and naps `poll_interval`; `false`: another does, sleep until given a turn).
    pub(crate) fn napping(&self) -> bool {
        let mut st = self.queue.lock();
        match &st.napper {
            Some(n) if Arc::ptr_eq(n, &self.waiter) => true,
            Some(n) if n.state() != GONE => false,
            _ => {
                st.napper = Some(self.waiter.clone());
                true
            }
        }
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
        // A grant on a chain turn passes the turn on too: the next waiter looks at
        // once (capacity may be left: a refill, a wake-all); a grant for one freed
        // unit does not (it used the unit). A napper's leaving must not leave the
        // queue without anyone to look.
        let napper = st
            .napper
            .as_ref()
            .is_some_and(|n| Arc::ptr_eq(n, &self.waiter));
        if napper {
            st.napper = None;
        }
        let chain = self.waiter.chain.load(Ordering::Relaxed);
        let pass_on = (was == WOKEN && (!granted || chain)) || napper;
        let uncharge = was == WOKEN && !granted;
        if was == WOKEN {
            st.woken -= 1;
            st.pending = st.pending.min(st.woken);
        }
        let c = &mut st.classes[self.waiter.class];
        c.live -= 1;
        if was == QUEUED {
            c.queued -= 1;
        }
        if uncharge {
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
                w.chain.store(chain || napper, Ordering::Relaxed);
                w.notify.notify_one();
            } else if napper {
                // The head is mid-turn: make its turn a chain, so a grant on it hands
                // on (a refusal claims the nap duty), and the queue keeps a looker.
                for c in &st.classes {
                    if let Some(h) = c.entries.front().filter(|h| h.state() == WOKEN) {
                        h.chain.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.leave(false);
    }
}

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

    /// Who gets each of `n` turns when every class always has a waiter queued (a
    /// grant passes the turn on: the next is the one it woke).
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
        // A napper's ask (a chain: every grant hands the turn on).
        places[0][0].turn();
        for _ in 0..n {
            let woken: Vec<usize> = places
                .iter()
                .enumerate()
                .filter(|(_, p)| p.front().is_some_and(|w| w.waiter.state() == WOKEN))
                .map(|(c, _)| c)
                .collect();
            assert_eq!(
                woken.len(),
                1,
                "one turn handed on, to a class's head (FIFO)"
            );
            let class = woken[0];
            got[class] += 1;
            let p = places[class].pop_front().unwrap();
            p.granted();
            places[class].push_back(q.join(class));
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

    #[test]
    fn a_grant_for_one_freed_unit_does_not_hand_on_but_a_chain_grant_does() {
        let q = WaitQueue::new(&[1.0]);
        let a = q.join(0);
        let b = q.join(0);
        let c = q.join(0);
        q.wake_next(); // one unit: a's turn, not a chain
        assert_eq!(a.waiter.state(), WOKEN);
        a.granted();
        assert_eq!(
            b.waiter.state(),
            QUEUED,
            "the unit is used: nobody else looks"
        );
        // b asks (as a napper does when its nap ends): a chain; its grant hands
        // the turn on to c.
        assert!(b.turn());
        b.granted();
        assert_eq!(c.waiter.state(), WOKEN, "a chain grant hands the turn on");
    }

    #[test]
    fn a_leaving_napper_hands_a_turn_on() {
        let q = WaitQueue::new(&[1.0]);
        let a = q.join(0);
        let b = q.join(0);
        assert!(a.napping(), "the first to ask naps");
        assert!(!b.napping(), "one napper per queue");
        drop(a); // cancelled while napping (queued, no turn)
        assert_eq!(b.waiter.state(), WOKEN, "someone must look");
        assert!(b.napping(), "and the duty is free again");
    }

    /// Poll a future once: `true` if it was ready.
    fn futures_now(f: impl std::future::Future<Output = ()>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut f = std::pin::pin!(f);
        f.as_mut().poll(&mut cx).is_ready()
    }
}
