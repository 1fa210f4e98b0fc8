//! Buffering a connection's replies (§11, §12): into its outbox, each under the
//! in-flight slot its request held or one it waits for; a status reply as the frame
//! its snapshot encoded, its byte reservation (`budget::Reserved`) ending once the
//! outbox counts the bytes; and the counts the budgets read (requests in flight,
//! unsent bytes). Apart from the request loop ([`super`]) because every path that
//! answers ends here.

use std::sync::atomic::Ordering;

use ipc_protocol::{ErrorKind, Reply};

use super::{dispatch, Conn};
use crate::backend::Backend;
use crate::server::dispatch::{Answer, Done, Encoded};
use crate::server::guard::Unsent;

impl<B: Backend> Conn<B> {
    /// Buffer a reply (its slot is already counted by the caller's rules).
    pub(super) fn reply(&mut self, id: u64, mut reply: Reply) {
        if self.version.is_some_and(|v| v < 3) {
            // §19: a tenant refusal (the anonymous tenant's limits) is protocol 3's.
            crate::server::convert::downgrade_tenant(&mut reply);
        }
        if self.version.is_some_and(|v| v < 2) {
            // §11b: `Overloaded` (an engine refusal: `max_waiters`) is protocol 2's;
            // a version-1 client gets `Busy`.
            if let Reply::Error(e) = &mut reply {
                if e.kind == ErrorKind::Overloaded {
                    e.kind = ErrorKind::Busy;
                }
            }
        }
        dispatch::log_error(self.id(), id, &reply);
        self.out.push(self.id(), id, reply);
        self.count_peak();
    }

    /// Buffer a status reply encoded already (its slot handed over by the caller);
    /// its reservation ends once the outbox counts its bytes.
    pub(super) fn reply_encoded(&mut self, id: u64, reply: Encoded) {
        self.out.push_frame(id, &reply.frame);
        self.count_peak();
        self.publish_bytes(self.out.bytes() as u64);
        drop(reply.held);
    }

    /// A reply was buffered: keep the peak of requests in flight.
    pub(super) fn count_peak(&mut self) {
        let n = self.in_flight();
        if n > self.peak {
            self.peak = n;
            let stats = &self.ctx.shared.opts.stats;
            stats.peak_in_flight.fetch_max(n, Ordering::Relaxed);
        }
    }

    /// A reply that needs a slot of its own: buffered if there is room, else it waits.
    pub(super) fn reply_when_room(&mut self, id: u64, reply: Reply) {
        if self.overflow.is_empty() && self.room() {
            self.reply(id, reply);
        } else {
            self.overflow.push_back((id, reply));
        }
    }

    /// Bring the server's in-flight count up to date with this connection's.
    pub(super) fn publish(&mut self, now: usize) {
        let stats = &self.ctx.shared.opts.stats;
        if now > self.published {
            stats
                .in_flight
                .fetch_add(now - self.published, Ordering::Relaxed);
        } else if now < self.published {
            stats
                .in_flight
                .fetch_sub(self.published - now, Ordering::Relaxed);
        }
        self.published = now;
    }

    /// Bring the sidecar-wide count of unsent bytes up to date.
    pub(super) fn publish_bytes(&mut self, now: u64) {
        self.unsent.publish(&self.ctx.shared.buffered, now);
    }

    /// Reading is held back by bytes ([`Unsent::over`]).
    pub(super) fn over_bytes(&self) -> bool {
        Unsent::over(&self.out, self.ctx.budget.reserved(), &self.ctx.shared)
    }

    /// A request's reply is ready (inline, or its task ended and owned the reply).
    pub(super) fn finished(&mut self, id: u64, done: Done) {
        match (done.reply, done.holds_slot) {
            (Answer::Reply(reply), true) => {
                self.ctx.budget.slot_done();
                self.reply(id, reply);
            }
            (Answer::Reply(reply), false) => self.reply_when_room(id, reply),
            // A status request keeps its slot to the end (it never waits for a
            // source), so its reply always has one.
            (Answer::Status(reply), holds_slot) => {
                if holds_slot {
                    self.ctx.budget.slot_done();
                }
                self.reply_encoded(id, reply);
            }
        }
    }
}
