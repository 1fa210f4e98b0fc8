//! The end of a connection (§12): running requests are stopped or allowed to finish
//! (bounded), everything the connection held goes back to the engine, and the last
//! replies are written (bounded). Apart from the request loop ([`super`]) because it
//! is the one place that may wait after the peer is gone, and each of its waits has
//! a limit of its own.

use std::time::Duration;

use futures_util::StreamExt;
use tracing::{debug, warn};

use super::{dispatch, Conn, End};
use crate::backend::Backend;
use crate::server::dispatch::Answer;

/// How long teardown waits for the last replies to be written (after a protocol
/// violation too: a peer that does not read cannot hold the connection open).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// The same after the shutdown grace ran out: the peer had its chance.
const HARD_STOP_FLUSH: Duration = Duration::from_millis(100);
/// How long teardown lets non-abortable requests (Report, EndCall, admin) finish.
const FINISH_TIMEOUT: Duration = Duration::from_secs(2);

impl<B: Backend> Conn<B> {
    /// Abort the waits (dropping their engine futures ends them), let the short
    /// state-changing requests finish (bounded), release everything the connection
    /// held, and write what is left to write (bounded).
    pub(super) async fn teardown(&mut self, end: End) {
        for p in self.pending.values() {
            p.cancel();
        }
        let finish = async {
            while let Some(r) = self.tasks.next().await {
                let (id, seq, Some(done)) = r else { continue };
                if self.pending.get(&id).is_some_and(|p| p.seq == seq) {
                    self.pending.remove(&id);
                    if done.holds_slot {
                        self.ctx.budget.slot_done();
                    }
                    match done.reply {
                        Answer::Reply(reply) => self.out.push(self.ctx.owner, id, reply),
                        Answer::Status(reply) => self.out.push_frame(id, &reply.frame),
                    }
                } else {
                    if done.holds_slot {
                        self.ctx.budget.slot_done();
                    }
                    dispatch::give_back(&self.ctx.engine, self.ctx.owner, done);
                }
            }
        };
        if tokio::time::timeout(FINISH_TIMEOUT, finish).await.is_err() {
            warn!(
                conn = self.id(),
                "requests still running at close; aborting them"
            );
            // Dropping a request's future ends it (the engine's futures are
            // cancel-safe; a dropped remote Work finishes in a task of its own).
            self.tasks.clear();
        }
        self.pending.clear();
        while let Some((id, reply)) = self.overflow.pop_front() {
            self.out.push(self.ctx.owner, id, reply);
        }
        self.ctx.engine.release_owner(self.id()).await;
        // What it held is free: a status snapshot from before is stale.
        self.ctx.shared.status.changed();
        let limit = if self.ctx.shared.is_stopped() {
            HARD_STOP_FLUSH
        } else {
            FLUSH_TIMEOUT
        };
        if self.out.bytes() > 0 {
            let _ = tokio::time::timeout(limit, self.out.flush(&self.stream)).await;
        }
        self.publish(0);
        self.publish_bytes(0);
        let why = match end {
            End::Closed => "closed by peer",
            End::Violation => "closed after a protocol error",
            End::Shutdown => "closed for shutdown",
        };
        debug!(conn = self.id(), "disconnected: {why}");
    }
}
