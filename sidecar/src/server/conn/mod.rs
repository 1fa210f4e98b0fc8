//! One client connection: handshake, the request loop, teardown (§11, §11a, §12, §16).
//!
//! The connection is one task that owns its socket. Each time it runs it reads
//! everything the socket has (as far as its in-flight budget allows), answers every
//! frame it can right there — decode, one poll of the engine, encode into the write
//! buffer — and writes all the replies of the batch with one `write`. Requests still
//! pending after that first poll (waiting Acquires; on Redis, every round trip) go
//! into the connection's set of running requests ([`dispatch::Running`]), which this
//! same task polls whenever one of them is woken; their replies go out with the next
//! batch. So a call costs no task and no channel, on the memory backend no
//! allocation for framing either; the shutdown signals are registered once and read
//! as flags.
//!
//! `Cancel` (bindings/PROTOCOL.md §7, §14) reaches requests that are still running,
//! which are exactly those in the set: one answered inline was answered before the
//! next frame was even decoded, so its normal reply is the one the client gets.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use ipc_protocol::{ClientFrame, ErrorKind, FrameError, Reply, Request};
use tokio::net::UnixStream;
use tracing::{debug, warn};

use super::budget::Budget;
use super::dispatch::{self, panicked, Ctx, Done, Job, Pending, Running, Step, Timer};
use super::guard::{self, Idle, IdleWatch, Unsent};
use super::transport::{self, Filled, Inbox, Outbox, Socket};
use super::{convert, ConnSlot};
use crate::backend::Backend;
use crate::engine::{Engine, OwnerId};
use crate::logs::{self, Kind};
use crate::peer::peer_of;

mod teardown;

/// While draining, how often an open connection checks whether it is idle.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// Frames answered in one run of the task before it yields to the others.
const FRAMES_PER_RUN: usize = 256;

/// Why the request loop stopped.
enum End {
    /// The client closed (or the socket failed).
    Closed,
    /// We close after a protocol error (already answered).
    Violation,
    /// Shutdown: drained, or the grace ran out.
    Shutdown,
}

/// Why [`Conn::read_frames`] stopped.
enum Read {
    /// The connection must close.
    End(End),
    /// No in-flight slot free (or replies waiting for one).
    NoRoom,
    /// The socket has nothing more for now (a wake-up is registered).
    Waiting,
    /// This run answered its share of frames.
    Yield,
}

/// One connection's state; only its own task touches it.
struct Conn<B: Backend> {
    ctx: Ctx<B>,
    stream: Socket,
    /// Frames read and not yet decoded.
    inbox: Inbox,
    /// Replies not yet written.
    out: Outbox,
    /// Requests still running, by request id. Whoever removes an entry (the future's
    /// completion, a `Cancel`) owns the request's reply.
    pending: HashMap<u64, Pending>,
    /// Those requests' futures, polled by this task (no spawn per request, §16);
    /// each yields its request id and what it answered (`None`: aborted).
    tasks: FuturesUnordered<Running>,
    /// Replies waiting for an in-flight slot (a waiting Acquire's answer, a
    /// `Cancelled`): the connection reads nothing while this is not empty.
    overflow: VecDeque<(u64, Reply)>,
    /// The protocol version of the handshake; `None` until `Hello`.
    version: Option<u32>,
    /// Shutdown began: close once idle.
    draining: bool,
    /// In-flight count last added to the server's stats.
    published: usize,
    /// The most requests this connection has had in flight.
    peak: usize,
    /// The idle check's memory (`sidecar.idle_timeout`, [`guard::IdleWatch`]).
    idle: IdleWatch,
    /// Unsent reply bytes against [`guard::MAX_UNSENT`] and `max_buffered`.
    unsent: Unsent,
    /// Sequence number of the last request kept running.
    seq: u64,
}

/// Serve one accepted connection to the end, then release what it held. `reserved`:
/// it was accepted past `max_connections`, into the reserve for admins (any other
/// peer is refused `Overloaded` there).
pub(super) async fn serve<B: Backend>(
    stream: UnixStream,
    id: OwnerId,
    engine: Arc<Engine<B>>,
    slot: ConnSlot,
    reserved: bool,
) {
    let shared = slot.0.clone();
    let max_frame = shared.opts.max_frame as usize;
    let peer = match peer_of(&stream) {
        Ok(p) => p,
        Err(e) => {
            warn!(conn = id, error = %e, "cannot read peer credentials; closing");
            return;
        }
    };
    if !shared.opts.access.may_connect(peer.uid, peer.gid) {
        if logs::allow(Kind::PermissionDenied) {
            warn!(
                conn = id,
                uid = peer.uid,
                gid = peer.gid,
                "peer may not connect; refused"
            );
        }
        let message = format!(
            "uid {} / gid {} may not connect to this sidecar",
            peer.uid, peer.gid
        );
        guard::write_refusal(stream, id, max_frame, ErrorKind::PermissionDenied, message).await;
        return;
    }
    // §12: the reserve past `max_connections` is the admins' (decided here, from
    // the peer's credentials, before anything is read or served).
    if reserved && !shared.opts.access.may_admin(peer.uid) {
        drop(slot); // a refusal holds no connection's place
        guard::refuse_reserve(stream, id, &shared, peer.uid).await;
        return;
    }
    let stream = match transport::socket(stream) {
        Ok(s) => s,
        Err(e) => {
            warn!(conn = id, error = %e, "cannot register the socket; closing");
            return;
        }
    };
    debug!(conn = id, uid = peer.uid, gid = peer.gid, pid = ?peer.pid, "connected");
    let shared_changes = shared.status.changes();
    let budget = Budget::new(shared.opts.max_in_flight);
    let mut conn = Conn {
        ctx: Ctx {
            engine,
            owner: id,
            uid: peer.uid,
            shared,
            budget,
            seen: std::sync::atomic::AtomicU64::new(shared_changes),
        },
        stream,
        inbox: Inbox::new(max_frame),
        out: Outbox::new(max_frame),
        pending: HashMap::new(),
        tasks: FuturesUnordered::new(),
        overflow: VecDeque::new(),
        version: None,
        draining: false,
        published: 0,
        peak: 0,
        idle: IdleWatch::default(),
        unsent: Unsent::default(),
        seq: 0,
    };
    let end = conn.run().await;
    conn.teardown(end).await;
}

impl<B: Backend> Conn<B> {
    fn id(&self) -> OwnerId {
        self.ctx.owner
    }

    /// Slots in use: buffered replies and running requests.
    fn in_flight(&self) -> usize {
        self.out.replies() + self.ctx.budget.tasks()
    }

    fn room(&self) -> bool {
        self.in_flight() < self.ctx.budget.max
    }

    /// Buffer a reply (its slot is already counted by the caller's rules).
    fn reply(&mut self, id: u64, mut reply: Reply) {
        if self.version.is_some_and(|v| v < 3) {
            // §19: a tenant refusal (the anonymous tenant's limits) is protocol 3's.
            convert::downgrade_tenant(&mut reply);
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
        let n = self.in_flight();
        if n > self.peak {
            self.peak = n;
            let stats = &self.ctx.shared.opts.stats;
            stats.peak_in_flight.fetch_max(n, Ordering::Relaxed);
        }
    }

    /// A reply that needs a slot of its own: buffered if there is room, else it waits.
    fn reply_when_room(&mut self, id: u64, reply: Reply) {
        if self.overflow.is_empty() && self.room() {
            self.reply(id, reply);
        } else {
            self.overflow.push_back((id, reply));
        }
    }

    /// Bring the server's in-flight count up to date with this connection's.
    fn publish(&mut self, now: usize) {
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
    fn publish_bytes(&mut self, now: u64) {
        self.unsent.publish(&self.ctx.shared.buffered, now);
    }

    /// Reading is held back by bytes ([`Unsent::over`]).
    fn over_bytes(&self) -> bool {
        Unsent::over(&self.out, &self.ctx.shared)
    }

    /// The request loop, handshake included.
    async fn run(&mut self) -> End {
        let shared = self.ctx.shared.clone();
        // The shutdown signals are registered once (their first poll) and read as
        // flags afterwards: this task's waker does not change, and a registered
        // future wakes it when the token is cancelled.
        let mut hard_stop = std::pin::pin!(shared.hard_stop.cancelled());
        let mut draining = std::pin::pin!(shared.draining.cancelled());
        let mut hello_by = std::pin::pin!(tokio::time::sleep(shared.opts.handshake_timeout));
        let mut drain_tick: Option<tokio::time::Interval> = None;
        // The idle check runs every `idle_timeout` (no timer is touched per frame):
        // a connection idle at a check with no frame since the previous one has been
        // idle for at least `idle_timeout`, at most twice that.
        let idle_every = shared.opts.idle_timeout.max(Duration::from_millis(1));
        let mut idle_tick = std::pin::pin!(tokio::time::sleep(idle_every));
        // The idle timer is polled until it is registered (a poll with coop budget
        // left), then read as a flag (`is_elapsed`, one atomic load) until it fires:
        // polling it on every pass was ~2 % of a frame's instructions (§16).
        let mut idle_armed = false;
        let mut first = true;
        std::future::poll_fn(|cx| {
            if std::mem::take(&mut first) {
                let _ = hard_stop.as_mut().poll(cx);
                let _ = draining.as_mut().poll(cx);
            }
            if shared.is_stopped() {
                return Poll::Ready(End::Shutdown);
            }
            if self.version.is_none() && hello_by.as_mut().poll(cx).is_ready() {
                let timeout = shared.opts.handshake_timeout;
                return Poll::Ready(self.violation(0, format!("no Hello within {timeout:?}")));
            }
            if !self.draining && shared.is_draining() {
                self.draining = true;
                drain_tick = Some(tokio::time::interval(DRAIN_POLL));
            }
            while !idle_armed || idle_tick.is_elapsed() {
                let registers = tokio::task::coop::has_budget_remaining();
                match idle_tick.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        if let Some(end) = self.idle_check() {
                            return Poll::Ready(end);
                        }
                        let next = tokio::time::Instant::now() + idle_every;
                        idle_tick.as_mut().reset(next);
                        idle_armed = false;
                    }
                    Poll::Pending => {
                        idle_armed = registers;
                        if !registers {
                            break;
                        }
                    }
                }
            }
            if let Some(tick) = &mut drain_tick {
                while tick.poll_tick(cx).is_ready() {
                    if self.idle() {
                        return Poll::Ready(End::Shutdown);
                    }
                }
            }
            let r = self.poll_batch(cx);
            let now = self.in_flight();
            self.publish(now);
            self.publish_bytes(self.out.bytes() as u64);
            if r.is_pending() {
                let shared = &self.ctx.shared;
                if self
                    .unsent
                    .poll_stall(cx, self.ctx.owner, &self.out, shared)
                {
                    return Poll::Ready(End::Closed);
                }
            }
            r
        })
        .await
    }

    /// The periodic idle check (`sidecar.idle_timeout`): close a connection that held
    /// nothing since the previous check, or whose partial frame has not completed
    /// since then.
    fn idle_check(&mut self) -> Option<End> {
        let partial = self.inbox.buffered() > 0;
        let timeout = self.ctx.shared.opts.idle_timeout;
        let verdict = self.idle.check(partial);
        if let Idle::Stuck = verdict {
            self.overloaded(format!(
                "a partial frame did not complete within {timeout:?} (sidecar.idle_timeout)"
            ));
            return Some(End::Violation);
        }
        if matches!(verdict, Idle::Quiet)
            && self.version.is_some()
            && self.pending.is_empty()
            && self.overflow.is_empty()
            && self.out.bytes() == 0
            && self.ctx.engine.owner_holds_nothing(self.id())
        {
            debug!(conn = self.id(), ?timeout, "closing an idle connection");
            return Some(End::Closed);
        }
        None
    }

    /// Close the connection for a sidecar-wide limit: an `Overloaded` error (id 0),
    /// `Busy` on a version-1 connection, logged summarised.
    fn overloaded(&mut self, message: String) {
        if logs::allow(Kind::Overloaded) {
            warn!(conn = self.id(), "{}; closing the connection", message);
        }
        let reply = guard::overloaded_reply(self.version, message);
        self.out.push(self.id(), 0, reply);
    }

    /// No request running and no unreported permit: a draining connection may close.
    fn idle(&self) -> bool {
        self.pending.is_empty() && self.ctx.engine.owner_is_idle(self.id())
    }

    /// Collect finished tasks, read and answer frames, write the replies.
    fn poll_batch(&mut self, cx: &mut Context<'_>) -> Poll<End> {
        let mut answered = 0;
        loop {
            if self.ctx.budget.tasks() > 0 {
                self.ctx.budget.register(cx);
            }
            while !self.tasks.is_empty() {
                match self.tasks.poll_next_unpin(cx) {
                    Poll::Ready(Some(r)) => self.task_done(r),
                    _ => break,
                }
            }
            while self.room() {
                let Some((id, reply)) = self.overflow.pop_front() else {
                    break;
                };
                self.reply(id, reply);
            }
            let stopped = match self.read_frames(cx, &mut answered) {
                Read::End(end) => return Poll::Ready(end),
                r => r,
            };
            let had = self.out.replies();
            if let Poll::Ready(Err(e)) = self.out.poll_flush(cx, &self.stream) {
                debug!(conn = self.id(), error = %e, "write failed");
                return Poll::Ready(End::Closed);
            }
            // Jobs that began running in this batch: be woken when they finish (the
            // set registers its waker only when polled), or take what finished.
            if !self.tasks.is_empty() {
                if let Poll::Ready(Some(r)) = self.tasks.poll_next_unpin(cx) {
                    self.task_done(r);
                    continue;
                }
            }
            match stopped {
                // Writing freed the slots the reader was waiting for: read on.
                Read::NoRoom if self.out.replies() < had && !self.over_bytes() => continue,
                Read::Yield => cx.waker().wake_by_ref(),
                _ => {}
            }
            return Poll::Pending;
        }
    }

    /// Decode and answer frames while there is room; read the socket when the buffer
    /// holds no complete frame.
    fn read_frames(&mut self, cx: &mut Context<'_>, answered: &mut usize) -> Read {
        loop {
            if !self.overflow.is_empty() || !self.room() || self.over_bytes() {
                return Read::NoRoom;
            }
            if *answered >= FRAMES_PER_RUN {
                return Read::Yield;
            }
            match self.inbox.next_frame() {
                Ok(Some(frame)) => {
                    *answered += 1;
                    self.idle.frame();
                    if let Some(end) = self.on_frame(frame, cx) {
                        return Read::End(end);
                    }
                    continue;
                }
                Ok(None) if self.inbox.eof => return Read::End(End::Closed),
                Ok(None) => {}
                Err(e) => return Read::End(self.frame_error(e)),
            }
            match self.inbox.poll_fill(cx, &self.stream) {
                Poll::Ready(Ok(Filled::Some)) => {}
                Poll::Ready(Ok(Filled::Pending)) | Poll::Pending => return Read::Waiting,
                Poll::Ready(Err(e)) => {
                    debug!(conn = self.id(), error = %e, "read failed");
                    return Read::End(End::Closed);
                }
            }
        }
    }

    /// Answer a frame that could not be read, where that is possible; then close.
    fn frame_error(&mut self, e: FrameError) -> End {
        let (id, kind) = match &e {
            FrameError::FrameTooLarge { .. } => (0, ErrorKind::FrameTooLarge),
            FrameError::Malformed { id, .. } => (id.unwrap_or(0), ErrorKind::Malformed),
            FrameError::Io(_) => {
                debug!(conn = self.id(), error = %e, "read failed");
                return End::Closed;
            }
        };
        if logs::allow(Kind::BadFrame) {
            warn!(conn = self.id(), error = %e, "bad frame; closing the connection");
        }
        self.reply(id, Reply::Error(convert::error(kind, e.to_string())));
        End::Violation
    }

    fn violation(&mut self, id: u64, message: String) -> End {
        debug!(conn = self.id(), "{message}");
        let e = convert::error(ErrorKind::ProtocolViolation, message);
        self.reply(id, Reply::Error(e));
        End::Violation
    }

    /// One decoded frame (there is room for its reply).
    fn on_frame(&mut self, frame: ClientFrame, cx: &mut Context<'_>) -> Option<End> {
        let ClientFrame { id, request } = frame;
        let Some(version) = self.version else {
            return self.hello(id, request);
        };
        if request.min_version() > version {
            let message = format!(
                "{} needs protocol version {}; this connection said {version} in Hello",
                dispatch::request_name(&request),
                request.min_version()
            );
            self.reply(
                id,
                Reply::Error(convert::error(ErrorKind::InvalidArgument, message)),
            );
            return None;
        }
        match request {
            Request::Hello { .. } => {
                Some(self.violation(id, "Hello may only be the first frame".into()))
            }
            Request::Cancel { target } => {
                self.cancel(target);
                self.reply(id, Reply::Ok);
                None
            }
            _ if self.pending.contains_key(&id) => {
                let message = format!("request id {id} is already in flight on this connection");
                self.reply(
                    id,
                    Reply::Error(convert::error(ErrorKind::InvalidArgument, message)),
                );
                None
            }
            request => {
                let timer = Timer {
                    ty: crate::metrics::request_type(&request),
                    started: crate::clock::monotonic_nanos(),
                };
                let step = dispatch::dispatch(&self.ctx, request);
                match step {
                    Step::Now(reply) => {
                        self.observe(timer);
                        self.reply(id, reply)
                    }
                    Step::Later(job) => self.start(id, job, cx, timer),
                }
                None
            }
        }
    }

    /// The first frame: it must be a `Hello` of a version this sidecar speaks.
    fn hello(&mut self, id: u64, request: Request) -> Option<End> {
        let max_frame = self.ctx.shared.opts.max_frame;
        match dispatch::handshake(self.id(), request, max_frame) {
            Ok((version, welcome)) => {
                self.version = Some(version);
                self.reply(id, welcome);
                None
            }
            Err(message) => Some(self.violation(id, message)),
        }
    }

    /// Count a change for the status snapshots, as this connection's own (its next
    /// status is built after it).
    fn changed(&self) {
        let n = self.ctx.shared.status.changed();
        self.ctx.seen.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// A request is answered: record its time in the sidecar (`/metrics`), and
    /// count a change for the status snapshots unless it was a status request or
    /// a `Ping` (before the reply goes out: whoever saw it and then asks for status
    /// gets a report that includes it).
    fn observe(&self, timer: Timer) {
        if !crate::metrics::is_read_only(timer.ty) {
            self.changed();
        }
        let metrics = &self.ctx.shared.opts.metrics;
        let ns = crate::clock::monotonic_nanos().saturating_sub(timer.started);
        metrics.observe(timer.ty, Duration::from_nanos(ns));
    }

    /// Poll a job once here; keep it running (in `tasks`) only if it has to wait.
    fn start(&mut self, id: u64, mut job: Job, cx: &mut Context<'_>, timer: Timer) {
        match std::panic::catch_unwind(AssertUnwindSafe(|| job.fut.as_mut().poll(cx))) {
            Ok(Poll::Ready(done)) => {
                self.observe(timer);
                self.finished(id, done)
            }
            Ok(Poll::Pending) => {
                self.seq += 1;
                let seq = self.seq;
                let (running, task) = Running::new(self.id(), id, seq, job.fut);
                self.tasks.push(running);
                let cancel = job.cancel;
                self.pending.insert(
                    id,
                    Pending {
                        seq,
                        task,
                        cancel,
                        timer,
                    },
                );
            }
            Err(_) => {
                // The job (and its slot guard) is gone with the panic.
                drop(job);
                self.reply_when_room(id, panicked(self.id(), id));
            }
        }
    }

    /// A request's reply is ready (inline, or its task ended and owned the reply).
    fn finished(&mut self, id: u64, done: Done) {
        if done.holds_slot {
            self.ctx.budget.slot_done();
            self.reply(id, done.reply);
        } else {
            self.reply_when_room(id, done.reply);
        }
    }

    fn task_done(&mut self, r: (u64, u64, Option<Done>)) {
        // Aborted requests (cancelled, teardown) answer nothing; their slot guard
        // gave the slot back when the future was dropped.
        let (id, seq, Some(done)) = r else { return };
        if self.pending.get(&id).is_some_and(|p| p.seq == seq) {
            let p = self.pending.remove(&id).expect("checked");
            self.observe(p.timer);
            self.finished(id, done);
            return;
        }
        // Cancelled after the engine answered: the client was told `Cancelled`.
        if done.holds_slot {
            self.ctx.budget.slot_done();
        }
        dispatch::give_back(&self.ctx.engine, self.id(), done);
    }

    /// `Cancel{target}`: stop a running request that may be stopped, and answer it
    /// `Cancelled` (bindings/PROTOCOL.md §7).
    fn cancel(&mut self, target: u64) {
        if !self
            .pending
            .get(&target)
            .is_some_and(|p| p.cancel.cancellable())
        {
            return;
        }
        let p = self.pending.remove(&target).expect("checked");
        p.cancel();
        // A wait left (status shows one waiter fewer): a change for the snapshots.
        self.changed();
        debug!(conn = self.id(), request = target, "cancelled");
        let e = convert::error(
            ErrorKind::Cancelled,
            format!("request {target} was cancelled"),
        );
        self.reply_when_room(target, Reply::Error(e));
    }
}
