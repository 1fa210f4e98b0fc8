//! Fair turns among tenants inside one priority class (§19): the waiters of a class
//! of a scope with tenants, one **lane** per tenant, and the order the class's head is
//! taken from. Used by [`super::queue::WaitQueue`] in place of its plain FIFO.
//!
//! The order is the virtual token counter of VTC ("Fairness in Serving Large Language
//! Models", OSDI 2024): every tenant has a counter of the service it received on this
//! host, tokens ÷ its weight — charged with the estimate when a call of it is
//! granted, corrected to the usage when the permit settles — and the class's next
//! turn goes to the front of the lane whose tenant has the smallest counter (ties: the
//! front that arrived first, so with one tenant, or none, the class is exactly FIFO).
//! A tenant whose last call left the queue keeps its counter, and one that comes back
//! is lifted to at least the **floor** — the counter of the last tenant given a grant
//! — so being idle banks no credit; a tenant sending 10× the others cannot push their
//! waits up, since every grant of its raises its counter above theirs.
//!
//! Host-local: the counters are this host's service. Across hosts each host orders
//! its own waiters, and the tenants' shared ledgers (limits and budgets, §19) are what
//! holds fleet-wide. Cost: a lane lookup and a B-tree re-key per join, grant and
//! leave (O(log tenants waiting)); counters of tenants that are neither waiting nor
//! above the floor are forgotten, so memory stays proportional to the waiters.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use super::queue::Waiter;

/// A tenant's lane id: its id (`None`: the anonymous tenant).
pub(crate) type LaneId = Option<Arc<str>>;

/// A counter, ordered totally (`f64::total_cmp`).
#[derive(Debug, Clone, Copy)]
struct Vt(f64);

impl PartialEq for Vt {
    fn eq(&self, o: &Self) -> bool {
        self.0.total_cmp(&o.0).is_eq()
    }
}
impl Eq for Vt {}
impl PartialOrd for Vt {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Vt {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// One tenant's waiters of one class, in arrival order.
#[derive(Debug, Default)]
struct Lane {
    /// Entries in arrival order (some may have left: dropped lazily from the front).
    q: VecDeque<Arc<Waiter>>,
    /// The lane's place in the order: (counter, arrival number of its front), as
    /// inserted into [`Fair::order`]; `None` while empty.
    key: Option<(Vt, u64)>,
}

/// The scope's tenants' counters (shared by its classes' lanes).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Tenant → its counter, for tenants waiting or above the floor.
    vt: HashMap<LaneId, f64>,
    /// The counter of the last tenant given a grant: where one that was idle
    /// re-enters.
    floor: f64,
}

impl Counters {
    /// The counter of `id` (an unknown tenant is at the floor).
    pub(crate) fn of(&self, id: &LaneId) -> f64 {
        self.vt.get(id).copied().unwrap_or(self.floor)
    }

    /// `id` gets a call of it granted, `cost` tokens ÷ weight: the floor rises to its
    /// counter before the charge.
    pub(crate) fn grant(&mut self, id: &LaneId, cost: f64) {
        let v = self.of(id);
        self.floor = self.floor.max(v);
        self.vt.insert(id.clone(), v + cost.max(0.0));
    }

    /// A settlement corrects `id`'s counter by `delta` (usage − estimate, ÷ weight).
    pub(crate) fn correct(&mut self, id: &LaneId, delta: f64) {
        if let Some(v) = self.vt.get_mut(id) {
            *v += delta;
        }
    }

    /// `id` starts waiting after an idle spell: lifted to the floor.
    fn lift(&mut self, id: &LaneId) {
        let floor = self.floor;
        let v = self.vt.entry(id.clone()).or_insert(floor);
        *v = v.max(floor);
    }

    /// Forget counters at or below the floor of tenants `waiting` says are not
    /// waiting (they would be lifted to the floor anyway), once there are more than
    /// `2 × keep + 1024` of them.
    pub(crate) fn prune(&mut self, keep: usize, waiting: impl Fn(&LaneId) -> bool) {
        if self.vt.len() > 2 * keep + 1024 {
            let floor = self.floor;
            self.vt.retain(|id, v| *v > floor || waiting(id));
        }
    }

    /// Tenants with a counter (tests: bounded).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.vt.len()
    }
}

/// A class's waiters: plain FIFO, or fair lanes per tenant.
#[derive(Debug)]
pub(crate) enum Lanes {
    /// Arrival order (a scope without tenants, or `fairness = "fifo"`).
    Fifo(VecDeque<Arc<Waiter>>),
    /// One lane per tenant, taken in counter order.
    Fair(Fair),
}

/// The fair form of [`Lanes`].
#[derive(Debug, Default)]
pub(crate) struct Fair {
    /// Tenant → its lane (present while it has entries).
    lanes: HashMap<LaneId, Lane>,
    /// Non-empty lanes by (counter, front's arrival number).
    order: BTreeSet<(Vt, u64, LaneId)>,
    /// Entries over every lane (those that left included, until dropped).
    len: usize,
}

impl Lanes {
    /// Empty; `fair` = lanes per tenant.
    pub(crate) fn new(fair: bool) -> Self {
        if fair {
            Lanes::Fair(Fair::default())
        } else {
            Lanes::Fifo(VecDeque::new())
        }
    }

    /// Entries held (those that left included, until dropped).
    pub(crate) fn len(&self) -> usize {
        match self {
            Lanes::Fifo(q) => q.len(),
            Lanes::Fair(f) => f.len,
        }
    }

    /// Join at the back of its tenant's lane; a tenant with no waiter in this class
    /// yet (`idle`: none in any class) is lifted to the floor first.
    pub(crate) fn push(&mut self, w: Arc<Waiter>, c: &mut Counters, idle: bool) {
        match self {
            Lanes::Fifo(q) => q.push_back(w),
            Lanes::Fair(f) => {
                let id = w.lane.clone();
                if idle {
                    c.lift(&id);
                }
                f.len += 1;
                let lane = f.lanes.entry(id.clone()).or_default();
                lane.q.push_back(w);
                if lane.key.is_none() {
                    let key = (Vt(c.of(&id)), lane.q[0].seq);
                    lane.key = Some(key);
                    f.order.insert((key.0, key.1, id));
                }
            }
        }
    }

    /// The class's head: the front of the lane first in counter order, entries that
    /// left dropped on the way.
    pub(crate) fn front(
        &mut self,
        c: &Counters,
        gone: impl Fn(&Waiter) -> bool,
    ) -> Option<Arc<Waiter>> {
        match self {
            Lanes::Fifo(q) => {
                while q.front().is_some_and(|w| gone(w)) {
                    q.pop_front();
                }
                q.front().cloned()
            }
            Lanes::Fair(f) => loop {
                let (_, _, id) = f.order.first()?.clone();
                f.rekey(&id, c, &gone);
                let lane = f.lanes.get(&id);
                if let Some(w) = lane.and_then(|l| l.q.front()) {
                    if f.order.first().is_some_and(|(_, _, first)| *first == id) {
                        return Some(w.clone());
                    }
                }
            },
        }
    }

    /// `id`'s counter or front changed (a grant, a settlement, a leaving waiter):
    /// its lane takes its new place.
    pub(crate) fn rekey(&mut self, id: &LaneId, c: &Counters, gone: impl Fn(&Waiter) -> bool) {
        match self {
            Lanes::Fifo(q) => {
                while q.front().is_some_and(|w| gone(w)) {
                    q.pop_front();
                }
            }
            Lanes::Fair(f) => f.rekey(id, c, &gone),
        }
    }

    /// Every entry (a wake-all).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&Arc<Waiter>)) {
        match self {
            Lanes::Fifo(q) => q.iter().for_each(f),
            Lanes::Fair(fair) => fair
                .lanes
                .values()
                .flat_map(|l| l.q.iter())
                .for_each(&mut f),
        }
    }

    /// Drop every entry that left (when they outnumber the live ones).
    pub(crate) fn compact(&mut self, c: &Counters, gone: impl Fn(&Waiter) -> bool) {
        match self {
            Lanes::Fifo(q) => q.retain(|w| !gone(w)),
            Lanes::Fair(f) => {
                for l in f.lanes.values_mut() {
                    l.q.retain(|w| !gone(w));
                }
                let ids: Vec<LaneId> = f.lanes.keys().cloned().collect();
                f.len = f.lanes.values().map(|l| l.q.len()).sum();
                for id in ids {
                    f.rekey(&id, c, &gone);
                }
            }
        }
    }

    /// Whether `id` has an entry here (waiting or mid-pass).
    pub(crate) fn has(&self, id: &LaneId) -> bool {
        match self {
            Lanes::Fifo(_) => false,
            Lanes::Fair(f) => f.lanes.contains_key(id),
        }
    }

    #[cfg(test)]
    /// Tenants with a lane here now.
    pub(crate) fn tenants(&self) -> usize {
        match self {
            Lanes::Fifo(_) => 0,
            Lanes::Fair(f) => f.lanes.len(),
        }
    }
}

impl Fair {
    /// Put `id`'s lane in its place: fronts that left dropped, an empty lane removed,
    /// else keyed by its tenant's counter and its front's arrival.
    fn rekey(&mut self, id: &LaneId, c: &Counters, gone: &impl Fn(&Waiter) -> bool) {
        let Some(lane) = self.lanes.get_mut(id) else {
            return;
        };
        while lane.q.front().is_some_and(|w| gone(w)) {
            lane.q.pop_front();
            self.len -= 1;
        }
        let new = lane.q.front().map(|w| (Vt(c.of(id)), w.seq));
        if new == lane.key {
            return;
        }
        if let Some((v, s)) = lane.key.take() {
            self.order.remove(&(v, s, id.clone()));
        }
        match new {
            Some(k) => {
                lane.key = Some(k);
                self.order.insert((k.0, k.1, id.clone()));
            }
            None => {
                self.lanes.remove(id);
            }
        }
    }
}
