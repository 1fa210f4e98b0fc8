//! In-flight accounting of one connection (§11, bindings/PROTOCOL.md §7 "Limits") and
//! its write buffer.
//!
//! A request is *in flight* from the moment its frame is read until its reply has
//! been written to the socket. It holds one slot of the connection's budget
//! ([`ServerOptions::max_in_flight`](super::ServerOptions::max_in_flight)) all that
//! time, except while an Acquire (or `Start` / `Retry`) waits for a source: waiting
//! calls are bounded by the calls they belong to, and must never keep the frames that
//! would end their wait from being read.
//!
//! Slots live in two places:
//! - the connection's [`Outbox`](super::transport::Outbox): one per reply encoded and not
//!   yet written (the connection task owns it, so no atomics);
//! - [`SlotGuard`]s: one per request still running after its first poll (or being
//!   polled for the first time), counted in [`Budget::tasks`]. The guard gives its slot back
//!   when its Acquire starts waiting, or when the request is dropped unfinished
//!   (aborted by `Cancel` or teardown), and wakes the connection so it can read
//!   again. A request that finishes still holding its slot hands it to its reply.
//!
//! The connection reads a frame only while `outbox.replies() + tasks < max`: a client
//! that sends without reading fills its own socket buffer, never the daemon. The
//! outbox also knows its size in bytes, the one number a global budget of buffered
//! replies (shared by every connection) needs to check before a connection reads on.
//!
//! A status reply (tens of KiB to MiBs) is counted in bytes before it is in the
//! outbox: from the moment its frame is read, a [`Reserved`] holds its expected size
//! against the connection's unsent bytes and the sidecar-wide `max_buffered`, until
//! the reply is buffered (then the outbox counts it) or the request is dropped. So
//! the replies a client that does not read has asked for — being built, waiting for
//! the status pacing, held as finished frames — never exceed its byte budget: past
//! it the connection reads no more frames, and what it did not read stays in its
//! own socket buffer (issue 29 item 2).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Context;

use futures_util::task::AtomicWaker;

use super::Shared;

/// The part of a connection's budget its request tasks share.
#[derive(Debug)]
pub(super) struct Budget {
    /// Most slots in use at once (at least 1).
    pub max: usize,
    /// Slots held by [`SlotGuard`]s.
    tasks: AtomicUsize,
    /// The connection task, woken when a guard gives its slot back.
    waker: AtomicWaker,
    /// Bytes held by [`Reserved`]s: status replies read and not yet buffered,
    /// counted with the outbox against the connection's unsent-bytes bound.
    reserved: AtomicUsize,
}

impl Budget {
    pub fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            max: max.max(1),
            tasks: AtomicUsize::new(0),
            waker: AtomicWaker::new(),
            reserved: AtomicUsize::new(0),
        })
    }

    /// Bytes reserved by status replies not yet in the outbox ([`Reserved`]).
    pub fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Acquire)
    }

    /// Slots held by request tasks right now.
    pub fn tasks(&self) -> usize {
        self.tasks.load(Ordering::Acquire)
    }

    /// A request finished holding its slot ([`SlotGuard::finish`]): the slot leaves
    /// the task count (to the request's reply, or free if the reply is dropped).
    pub fn slot_done(&self) {
        self.tasks.fetch_sub(1, Ordering::AcqRel);
    }

    /// Be woken when a guard gives a slot back. Registered before the connection
    /// checks for room, so a give-back in between is not missed.
    pub fn register(&self, cx: &Context<'_>) {
        self.waker.register(cx.waker());
    }

    fn give_back(&self) {
        self.tasks.fetch_sub(1, Ordering::AcqRel);
        self.waker.wake();
    }
}

/// The slot of one request that runs as a future (kept running by its connection
/// after its first poll). See the module docs.
pub(super) struct SlotGuard {
    budget: Arc<Budget>,
    /// Still holding the slot.
    held: AtomicBool,
}

impl SlotGuard {
    /// Take a slot for a request (the connection checked there is room).
    pub fn new(budget: &Arc<Budget>) -> SlotGuard {
        budget.tasks.fetch_add(1, Ordering::AcqRel);
        SlotGuard {
            budget: budget.clone(),
            held: AtomicBool::new(true),
        }
    }

    /// The request waits (for a source): give the slot back. Idempotent.
    pub fn release(&self) {
        if self.held.swap(false, Ordering::AcqRel) {
            self.budget.give_back();
        }
    }

    /// The request is done: `true` if it still holds its slot, which then belongs to
    /// its reply (the connection calls [`Budget::slot_done`]).
    pub fn finish(self) -> bool {
        self.held.swap(false, Ordering::AcqRel)
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// The bytes one status reply will take in the outbox, counted from when its frame
/// is read until the reply is buffered or dropped (see the module docs): in its
/// connection's [`Budget::reserved`] and in the sidecar-wide [`Shared::buffered`].
pub(super) struct Reserved {
    /// The connection's budget, which counts it.
    budget: Arc<Budget>,
    /// The sidecar-wide count of unsent bytes (`max_buffered`), which counts it too.
    shared: Arc<Shared>,
    /// Bytes held now.
    bytes: usize,
}

impl Reserved {
    /// Reserve `bytes` (the expected size of the reply).
    pub fn new(budget: &Arc<Budget>, shared: &Arc<Shared>, bytes: usize) -> Reserved {
        budget.reserved.fetch_add(bytes, Ordering::AcqRel);
        shared.buffered.fetch_add(bytes as u64, Ordering::Relaxed);
        Reserved {
            budget: budget.clone(),
            shared: shared.clone(),
            bytes,
        }
    }

    /// The reply's real size is known: hold that instead.
    pub fn resize(&mut self, bytes: usize) {
        let (budget, total) = (&self.budget.reserved, &self.shared.buffered);
        if bytes > self.bytes {
            budget.fetch_add(bytes - self.bytes, Ordering::AcqRel);
            total.fetch_add((bytes - self.bytes) as u64, Ordering::Relaxed);
        } else {
            budget.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
            total.fetch_sub((self.bytes - bytes) as u64, Ordering::Relaxed);
        }
        self.bytes = bytes;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.resize(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::AccessPolicy;
    use crate::server::ServerOptions;

    #[test]
    fn a_reservation_counts_in_both_budgets_at_its_latest_size_until_dropped() {
        let opts = ServerOptions::new(65536, AccessPolicy::default());
        let shared = Arc::new(Shared::new(opts));
        let budget = Budget::new(4);
        let held = || (budget.reserved(), shared.buffered.load(Ordering::Relaxed));
        // Bytes the connection's outbox already published stay as they are.
        shared.buffered.fetch_add(7, Ordering::Relaxed);
        let mut a = Reserved::new(&budget, &shared, 65536);
        let b = Reserved::new(&budget, &shared, 1000);
        assert_eq!(held(), (66536, 66543));
        a.resize(45_000);
        assert_eq!(held(), (46_000, 46_007), "the real size, smaller");
        a.resize(2_000_000);
        assert_eq!(held(), (2_001_000, 2_001_007), "the real size, larger");
        drop(a);
        assert_eq!(held(), (1000, 1007));
        drop(b);
        assert_eq!(held(), (0, 7), "nothing left reserved");
    }
}
