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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Context;

use futures_util::task::AtomicWaker;

/// The part of a connection's budget its request tasks share.
#[derive(Debug)]
pub(super) struct Budget {
    /// Most slots in use at once (at least 1).
    pub max: usize,
    /// Slots held by [`SlotGuard`]s.
    tasks: AtomicUsize,
    /// The connection task, woken when a guard gives its slot back.
    waker: AtomicWaker,
}

impl Budget {
    pub fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            max: max.max(1),
            tasks: AtomicUsize::new(0),
            waker: AtomicWaker::new(),
        })
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
