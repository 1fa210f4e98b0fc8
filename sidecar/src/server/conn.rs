//! One client connection: handshake, request tasks, the writer, teardown.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, SinkExt, StreamExt};
use ipc_protocol::{ClientFrame, ErrorKind, ErrorReply, Reply, Request, ServerFrame};
use ipc_protocol::{FrameError, ServerCodec};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::convert;
use super::{ServerOptions, ServerStats};
use crate::backend::{Backend, Outcome};
use crate::engine::{Engine, EngineError, Grant, OwnerId};
use crate::peer::peer_of;

/// State every connection shares with the accept loop.
pub(super) struct Shared {
    pub opts: ServerOptions,
    /// Shutdown began: connections close once they hold nothing.
    pub draining: CancellationToken,
    /// The grace is over: connections close now.
    pub hard_stop: CancellationToken,
}

/// Replies queued for the writer before request tasks wait on it.
const REPLY_QUEUE: usize = 256;
/// While draining, how often an open connection checks whether it is idle.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// How long teardown waits for the writer to flush the last replies; also how long
/// the reader tries to queue the error reply of a protocol violation before closing.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
/// The same after the shutdown grace ran out: the peer had its chance.
const HARD_STOP_FLUSH: Duration = Duration::from_millis(100);
/// How long teardown lets non-abortable requests (Report, EndCall, admin) finish.
const FINISH_TIMEOUT: Duration = Duration::from_secs(2);

/// Per-connection state the request tasks share.
struct Conn<B: Backend> {
    id: OwnerId,
    uid: u32,
    engine: Arc<Engine<B>>,
    shared: Arc<Shared>,
    /// Requests still running, by request id. Whoever removes an entry (the task when
    /// it finishes, or a `Cancel`) owns the request's reply.
    pending: Mutex<HashMap<u64, Pending>>,
    /// Permits granted and not yet reported, to the call they belong to. Only used to
    /// tell when a draining connection holds nothing any more.
    permits: Mutex<HashMap<u64, u64>>,
    /// The in-flight cap (`ServerOptions::max_in_flight`).
    budget: Arc<Budget>,
    /// The protocol version agreed in the handshake (1 or 2): version-2 requests are
    /// refused on a version-1 connection, so an old client never sees a reply it
    /// cannot decode.
    version: AtomicU32,
}

/// A connection's in-flight slots: the reader takes one before it reads a frame, a
/// request task holds it until its reply is queued (or it ends). A waiting Acquire
/// holds none while it waits, and takes one again once it has its answer.
struct Budget {
    slots: Arc<Semaphore>,
    /// Slots held by request tasks.
    held: AtomicUsize,
    stats: Arc<ServerStats>,
}

impl Budget {
    fn new(max: usize, stats: Arc<ServerStats>) -> Arc<Self> {
        Arc::new(Budget {
            slots: Arc::new(Semaphore::new(max.max(1))),
            held: AtomicUsize::new(0),
            stats,
        })
    }
}

/// One request in progress: its slot of the connection's budget.
struct InFlight {
    _slot: OwnedSemaphorePermit,
    budget: Arc<Budget>,
}

impl InFlight {
    fn new(slot: OwnedSemaphorePermit, budget: &Arc<Budget>) -> Self {
        let held = budget.held.fetch_add(1, Ordering::Relaxed) + 1;
        budget.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        budget
            .stats
            .peak_in_flight
            .fetch_max(held, Ordering::Relaxed);
        InFlight {
            _slot: slot,
            budget: budget.clone(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(1, Ordering::Relaxed);
        self.budget.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running request.
struct Pending {
    task: AbortHandle,
    /// How a `Cancel` (or teardown) stops it.
    cancel: CancelBy,
}

/// How a running request can be stopped early.
enum CancelBy {
    /// Safe to abort at any await point: `Acquire`, `Start` (their engine futures are
    /// cancel-safe, and a `Start` ends its call when dropped) and the read-only status
    /// requests. These are where a request can wait for long.
    Abort,
    /// `Retry`: its report must finish (several engine steps), its acquire may wait
    /// for long; the token ends the acquire and the task ends the call.
    Token(CancellationToken),
    /// Short requests that change engine state in several steps: they finish.
    Never,
}

impl Pending {
    fn cancellable(&self) -> bool {
        !matches!(self.cancel, CancelBy::Never)
    }

    fn cancel(&self) {
        match &self.cancel {
            CancelBy::Abort => self.task.abort(),
            CancelBy::Token(t) => t.cancel(),
            CancelBy::Never => {}
        }
    }
}

/// Ends a call whose `Start` was dropped (cancelled, connection gone) before it could
/// answer: a `Start` that does not answer `Started` leaves no call behind.
struct CallGuard<B: Backend> {
    engine: Arc<Engine<B>>,
    owner: OwnerId,
    call: Option<u64>,
}

impl<B: Backend> Drop for CallGuard<B> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let (engine, owner) = (self.engine.clone(), self.owner);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = engine.end_call(owner, call).await;
                });
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<B: Backend> Conn<B> {
    fn idle(&self) -> bool {
        lock(&self.pending).is_empty() && lock(&self.permits).is_empty()
    }
}

/// Why the request loop stopped.
enum End {
    /// The client closed (or the socket failed).
    Closed,
    /// We closed after a protocol error (already answered).
    Violation,
    /// Shutdown: drained, or the grace ran out.
    Shutdown,
}

/// Serve one accepted connection to the end, then release what it held.
pub(super) async fn serve<B: Backend>(
    stream: UnixStream,
    id: OwnerId,
    engine: Arc<Engine<B>>,
    shared: Arc<Shared>,
) {
    let max_frame = shared.opts.max_frame;
    let peer = match peer_of(&stream) {
        Ok(p) => p,
        Err(e) => {
            warn!(conn = id, error = %e, "cannot read peer credentials; closing");
            return;
        }
    };
    let (read, write) = stream.into_split();
    let mut writer = FramedWrite::new(write, ServerCodec::new(max_frame as usize));
    if !shared.opts.access.may_connect(peer.uid, peer.gid) {
        warn!(
            conn = id,
            uid = peer.uid,
            gid = peer.gid,
            "peer may not connect; refused"
        );
        let reply = Reply::Error(convert::error(
            ErrorKind::PermissionDenied,
            format!(
                "uid {} / gid {} may not connect to this sidecar",
                peer.uid, peer.gid
            ),
        ));
        let send = writer.send(ServerFrame { id: 0, reply });
        let _ = tokio::time::timeout(FLUSH_TIMEOUT, send).await;
        return;
    }
    debug!(conn = id, uid = peer.uid, gid = peer.gid, pid = ?peer.pid, "connected");

    let (tx, rx) = mpsc::channel(REPLY_QUEUE);
    let writer_task = tokio::spawn(write_loop(writer, rx, id));
    let conn = Arc::new(Conn {
        id,
        uid: peer.uid,
        engine,
        pending: Mutex::new(HashMap::new()),
        permits: Mutex::new(HashMap::new()),
        budget: Budget::new(shared.opts.max_in_flight, shared.opts.stats.clone()),
        shared,
        version: AtomicU32::new(ipc_protocol::MIN_PROTOCOL_VERSION),
    });
    let reader = FramedRead::new(read, ServerCodec::new(max_frame as usize));
    let mut tasks = JoinSet::new();
    let end = serve_frames(&conn, reader, &tx, &mut tasks).await;

    // Teardown: abort the waits (dropping their engine futures ends them), let the
    // short state-changing requests finish (bounded), then release everything the
    // connection held.
    for p in lock(&conn.pending).values() {
        p.cancel();
    }
    let finish = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(FINISH_TIMEOUT, finish).await.is_err() {
        warn!(conn = id, "requests still running at close; aborting them");
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    lock(&conn.pending).clear();
    drop(tx);
    conn.engine.release_owner(id).await;
    let mut writer_task = writer_task;
    let flush = if conn.shared.hard_stop.is_cancelled() {
        HARD_STOP_FLUSH
    } else {
        FLUSH_TIMEOUT
    };
    if tokio::time::timeout(flush, &mut writer_task).await.is_err() {
        writer_task.abort();
    }
    let why = match end {
        End::Closed => "closed by peer",
        End::Violation => "closed after a protocol error",
        End::Shutdown => "closed for shutdown",
    };
    debug!(conn = id, "disconnected: {why}");
}

/// Queue a reply for the writer. Backpressure: this waits while the reply queue is
/// full, but never past the hard stop (false: the connection must end now).
async fn queue_reply(
    tx: &mpsc::Sender<ServerFrame>,
    hard_stop: &CancellationToken,
    id: u64,
    reply: Reply,
) -> bool {
    tokio::select! {
        biased;
        r = tx.send(ServerFrame { id, reply }) => {
            // Only fails once the writer is gone; the next read then sees the close.
            let _ = r;
            true
        }
        () = hard_stop.cancelled() => false,
    }
}

/// Handshake, then the request loop.
async fn serve_frames<B: Backend>(
    conn: &Arc<Conn<B>>,
    mut reader: FramedRead<OwnedReadHalf, ServerCodec>,
    tx: &mpsc::Sender<ServerFrame>,
    tasks: &mut JoinSet<()>,
) -> End {
    let shared = conn.shared.clone();
    let opts = &shared.opts;
    let send = |id: u64, reply: Reply| queue_reply(tx, &shared.hard_stop, id, reply);
    // The connection closes after a violation whatever happens: its error reply gets a
    // bounded chance to be queued, so a peer that does not read cannot hold it open.
    let closing = |id: u64, reply: Reply| async move {
        let _ = tokio::time::timeout(FLUSH_TIMEOUT, send(id, reply)).await;
    };
    let violation = |id: u64, message: String| {
        debug!(conn = conn.id, "{message}");
        closing(
            id,
            Reply::Error(convert::error(ErrorKind::ProtocolViolation, message)),
        )
    };

    // ---- handshake ----
    let first = tokio::select! {
        () = shared.hard_stop.cancelled() => return End::Shutdown,
        r = tokio::time::timeout(opts.handshake_timeout, reader.next()) => r,
    };
    match first {
        Err(_) => {
            violation(0, format!("no Hello within {:?}", opts.handshake_timeout)).await;
            return End::Violation;
        }
        Ok(None) => return End::Closed,
        Ok(Some(Err(e))) => return frame_error(conn.id, e, &closing).await,
        Ok(Some(Ok(ClientFrame {
            id,
            request:
                Request::Hello {
                    protocol_version,
                    client_name,
                    pid,
                },
        }))) => {
            let supported = ipc_protocol::MIN_PROTOCOL_VERSION..=ipc_protocol::PROTOCOL_VERSION;
            if !supported.contains(&protocol_version) {
                violation(
                    id,
                    format!(
                        "protocol version mismatch: client {client_name:?} speaks version \
                         {protocol_version}, this sidecar speaks versions {} to {}",
                        supported.start(),
                        supported.end()
                    ),
                )
                .await;
                return End::Violation;
            }
            conn.version.store(protocol_version, Ordering::Relaxed);
            debug!(conn = conn.id, client = %client_name, client_pid = pid, protocol_version, "hello");
            let welcome = Reply::Welcome {
                protocol_version,
                sidecar_version: env!("CARGO_PKG_VERSION").to_string(),
                max_frame: opts.max_frame,
            };
            if !send(id, welcome).await {
                return End::Shutdown;
            }
        }
        Ok(Some(Ok(ClientFrame { id, request }))) => {
            violation(
                id,
                format!(
                    "the first frame must be Hello, got {}",
                    request_name(&request)
                ),
            )
            .await;
            return End::Violation;
        }
    }

    // ---- requests ----
    let mut draining = false;
    // The in-flight slot the next request will use: no frame is read without one, so
    // at the cap the socket fills up and the client feels the backpressure.
    let mut slot: Option<OwnedSemaphorePermit> = None;
    loop {
        while tasks.try_join_next().is_some() {}
        let frame = tokio::select! {
            biased;
            () = shared.hard_stop.cancelled() => return End::Shutdown,
            () = shared.draining.cancelled(), if !draining => {
                draining = true;
                continue;
            }
            () = tokio::time::sleep(DRAIN_POLL), if draining => {
                if conn.idle() {
                    return End::Shutdown;
                }
                continue;
            }
            s = conn.budget.slots.clone().acquire_owned(), if slot.is_none() => {
                slot = Some(s.expect("the in-flight semaphore is never closed"));
                continue;
            }
            f = reader.next(), if slot.is_some() => f,
        };
        let ClientFrame { id, request } = match frame {
            None => return End::Closed,
            Some(Err(e)) => return frame_error(conn.id, e, &closing).await,
            Some(Ok(f)) => f,
        };
        let version = conn.version.load(Ordering::Relaxed);
        if request.min_version() > version {
            let e = convert::error(
                ErrorKind::InvalidArgument,
                format!(
                    "{} needs protocol version {}; this connection said {version} in Hello",
                    request_name(&request),
                    request.min_version()
                ),
            );
            if !send(id, Reply::Error(e)).await {
                return End::Shutdown;
            }
            continue;
        }
        match request {
            Request::Hello { .. } => {
                violation(id, "Hello may only be the first frame".into()).await;
                return End::Violation;
            }
            Request::Cancel { target } => {
                let cancelled = {
                    let mut pending = lock(&conn.pending);
                    match pending.get(&target) {
                        Some(p) if p.cancellable() => pending.remove(&target),
                        _ => None,
                    }
                };
                if let Some(p) = cancelled {
                    p.cancel();
                    debug!(conn = conn.id, request = target, "cancelled");
                    let e = convert::error(
                        ErrorKind::Cancelled,
                        format!("request {target} was cancelled"),
                    );
                    if !send(target, Reply::Error(e)).await {
                        return End::Shutdown;
                    }
                }
                if !send(id, Reply::Ok).await {
                    return End::Shutdown;
                }
            }
            request => {
                // Spawned under the lock, so the task cannot finish (and look for its
                // entry) before the entry exists.
                let duplicate = match lock(&conn.pending).entry(id) {
                    Entry::Occupied(_) => true,
                    Entry::Vacant(entry) => {
                        let token = CancellationToken::new();
                        let cancel = match request {
                            Request::Acquire { .. }
                            | Request::Start(_)
                            | Request::Status
                            | Request::StatusJson => CancelBy::Abort,
                            Request::Retry { .. } => CancelBy::Token(token.clone()),
                            _ => CancelBy::Never,
                        };
                        let s = slot.take().expect("a frame is only read with a slot");
                        let in_flight = InFlight::new(s, &conn.budget);
                        let task = tasks.spawn(request_task(
                            conn.clone(),
                            tx.clone(),
                            id,
                            request,
                            in_flight,
                            token,
                        ));
                        entry.insert(Pending { task, cancel });
                        false
                    }
                };
                if duplicate {
                    let e = convert::error(
                        ErrorKind::InvalidArgument,
                        format!("request id {id} is already in flight on this connection"),
                    );
                    if !send(id, Reply::Error(e)).await {
                        return End::Shutdown;
                    }
                }
            }
        }
    }
}

/// Answer a frame that could not be read, where that is possible; the caller closes.
async fn frame_error<Fut>(conn: OwnerId, e: FrameError, send: impl Fn(u64, Reply) -> Fut) -> End
where
    Fut: Future<Output = ()>,
{
    let (id, kind) = match &e {
        FrameError::FrameTooLarge { .. } => (0, ErrorKind::FrameTooLarge),
        FrameError::Malformed { id, .. } => (id.unwrap_or(0), ErrorKind::Malformed),
        FrameError::Io(_) => {
            debug!(conn, error = %e, "read failed");
            return End::Closed;
        }
    };
    warn!(conn, error = %e, "bad frame; closing the connection");
    send(id, Reply::Error(convert::error(kind, e.to_string()))).await;
    End::Violation
}

/// Run one request and queue its reply, unless it was cancelled meanwhile. `in_flight`
/// is held until the reply is queued (a waiting `Acquire` lets it go while it waits and
/// takes a slot again before queuing its reply).
async fn request_task<B: Backend>(
    conn: Arc<Conn<B>>,
    tx: mpsc::Sender<ServerFrame>,
    id: u64,
    request: Request,
    in_flight: InFlight,
    cancelled: CancellationToken,
) {
    let mut in_flight = Some(in_flight);
    let (timed, started) = (crate::metrics::request_type(&request), Instant::now());
    // A Start or Retry the client cancelled must not leave its call behind.
    let ends_call = matches!(request, Request::Start(_) | Request::Retry { .. });
    let reply = AssertUnwindSafe(handle(&conn, request, &mut in_flight, &cancelled))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| {
            warn!(conn = conn.id, request = id, "request handler panicked");
            Reply::Error(convert::error(
                ErrorKind::Internal,
                "internal error while handling the request",
            ))
        });
    if lock(&conn.pending).remove(&id).is_none() {
        // Cancelled after the engine answered: the client was told `Cancelled`, so a
        // permit it will never learn of goes straight back (and the call of a
        // cancelled Start or Retry ends).
        if let Reply::Granted { permit, .. } | Reply::Started { permit, .. } = reply {
            let call = lock(&conn.permits).remove(&permit);
            let engine = conn.engine.clone();
            let owner = conn.id;
            tokio::spawn(async move {
                let _ = engine.report(owner, permit, Outcome::Cancelled).await;
                if let Some(call) = call.filter(|_| ends_call) {
                    let _ = engine.end_call(owner, call).await;
                }
            });
        }
        return;
    }
    if let Reply::Error(e) = &reply {
        log_error(conn.id, id, e);
    }
    // An Acquire that waited gave its slot back: it takes one again before its reply
    // may wait on the queue, so a connection never has more than `max_in_flight`
    // answered requests whose replies are not queued yet. (On a remote backend every
    // Acquire waits for its round trip, fail-fast errors included: without this, a
    // client pipelining Acquires it never reads would grow the daemon without bound.)
    // Done only once the request left `pending`: a Cancel cannot strand a grant here.
    if in_flight.is_none() {
        let slots = conn.budget.slots.clone();
        in_flight = tokio::select! {
            biased;
            () = conn.shared.hard_stop.cancelled() => return,
            s = slots.acquire_owned() => Some(InFlight::new(
                s.expect("the in-flight semaphore is never closed"),
                &conn.budget,
            )),
        };
    }
    // Past the hard stop the reply is dropped: the connection is going away, and what
    // it held is released by teardown.
    conn.shared.opts.metrics.observe(timed, started.elapsed());
    queue_reply(&tx, &conn.shared.hard_stop, id, reply).await;
    drop(in_flight);
}

fn log_error(conn: OwnerId, request: u64, e: &ErrorReply) {
    match e.kind {
        // Expected outcomes of admission, not faults.
        ErrorKind::CircuitOpen
        | ErrorKind::AllSourcesExhausted
        | ErrorKind::ShuttingDown
        | ErrorKind::Cancelled => {
            debug!(conn, request, kind = ?e.kind, "{}", e.message)
        }
        _ => warn!(conn, request, kind = ?e.kind, "{}", e.message),
    }
}

/// Map one request onto the engine. An `Acquire` the engine keeps waiting drops
/// `in_flight` (see [`ServerOptions::max_in_flight`]).
async fn handle<B: Backend>(
    conn: &Conn<B>,
    request: Request,
    in_flight: &mut Option<InFlight>,
    cancelled: &CancellationToken,
) -> Reply {
    let engine = &conn.engine;
    let owner = conn.id;
    let finish = matches!(request, Request::Finish { .. });
    let fail = |e: &EngineError| Reply::Error(convert::engine_error(e));
    let invalid = |e: convert::ArgumentError| {
        Reply::Error(convert::error(ErrorKind::InvalidArgument, e.to_string()))
    };
    let admin_denied = |what: &str| {
        (!conn.shared.opts.access.may_admin(conn.uid)).then(|| {
            Reply::Error(convert::error(
                ErrorKind::PermissionDenied,
                format!("uid {} may not {what} (not in admin_uids)", conn.uid),
            ))
        })
    };
    match request {
        Request::BeginCall { scope, est_tokens } => {
            if let Some(Err(e)) = est_tokens.map(|t| convert::tokens("est_tokens", t)) {
                return invalid(e);
            }
            match engine.begin_call(owner, &scope, est_tokens) {
                Ok(call) => Reply::CallBegun { call },
                Err(e) => fail(&e),
            }
        }
        Request::Acquire { call } => match acquire(engine, owner, call, in_flight).await {
            Ok(grant) => {
                lock(&conn.permits).insert(grant.permit, call);
                convert::granted(&grant)
            }
            Err(e) => fail(&e),
        },
        Request::Report { permit, outcome } => {
            let outcome = match convert::outcome(outcome) {
                Ok(o) => o,
                Err(e) => return invalid(e),
            };
            let r = engine.report(owner, permit, outcome).await;
            // The engine no longer holds the permit: reported, already gone (reclaimed,
            // ended with its call), or taken out before the backend failed.
            if matches!(
                r,
                Ok(_) | Err(EngineError::UnknownPermit(_) | EngineError::BackendUnavailable { .. })
            ) {
                lock(&conn.permits).remove(&permit);
            }
            match r {
                Ok(applied) => convert::reported(&applied),
                Err(e) => fail(&e),
            }
        }
        Request::EndCall { call } => {
            let r = engine.end_call(owner, call).await;
            lock(&conn.permits).retain(|_, c| *c != call);
            match r {
                Ok(()) => Reply::Ok,
                Err(e) => fail(&e),
            }
        }
        Request::Status => {
            let scopes = engine.status().await;
            Reply::Status(convert::status_report(engine.backend_name(), scopes))
        }
        Request::StatusJson => {
            let scopes = engine.status().await;
            Reply::StatusJson(convert::status_json(engine.backend_name(), &scopes))
        }
        Request::Begin(spec) => {
            let args = match convert::call_spec(spec) {
                Ok(a) => a,
                Err(e) => return invalid(e),
            };
            match engine.begin_call(owner, &args.scope, args.est_tokens) {
                Ok(call) => Reply::CallBegun { call },
                Err(e) => fail(&e),
            }
        }
        Request::Start(spec) => {
            let args = match convert::call_spec(spec) {
                Ok(a) => a,
                Err(e) => return invalid(e),
            };
            let call = match engine.begin_call(owner, &args.scope, args.est_tokens) {
                Ok(call) => call,
                Err(e) => return fail(&e),
            };
            let mut guard = CallGuard {
                engine: engine.clone(),
                owner,
                call: Some(call),
            };
            let r = acquire(engine, owner, call, in_flight).await;
            guard.call = None;
            match r {
                Ok(grant) => {
                    lock(&conn.permits).insert(grant.permit, call);
                    convert::started(call, &grant)
                }
                Err(e) => {
                    let _ = engine.end_call(owner, call).await;
                    fail(&e)
                }
            }
        }
        Request::Retry { permit, outcome } | Request::Finish { permit, outcome } => {
            let outcome = match convert::outcome(outcome) {
                Ok(o) => o,
                Err(e) => return invalid(e),
            };
            let Some(call) = lock(&conn.permits).get(&permit).copied() else {
                return fail(&EngineError::UnknownPermit(permit));
            };
            let r = engine.report(owner, permit, outcome).await;
            match r {
                // Refused: nothing changed (a reclaimed permit is gone either way).
                Err(EngineError::UnknownPermit(_)) => {
                    lock(&conn.permits).remove(&permit);
                    return fail(&EngineError::UnknownPermit(permit));
                }
                Err(e @ EngineError::InvalidArgument(_)) => return fail(&e),
                _ => {
                    lock(&conn.permits).remove(&permit);
                }
            }
            let end = |reply: Reply| async move {
                let _ = engine.end_call(owner, call).await;
                lock(&conn.permits).retain(|_, c| *c != call);
                reply
            };
            if finish {
                return end(match r {
                    Ok(applied) => convert::reported(&applied),
                    Err(e) => fail(&e),
                })
                .await;
            }
            let r = tokio::select! {
                biased;
                () = cancelled.cancelled() => None,
                r = acquire(engine, owner, call, in_flight) => Some(r),
            };
            match r {
                Some(Ok(grant)) => {
                    lock(&conn.permits).insert(grant.permit, call);
                    convert::granted(&grant)
                }
                Some(Err(e)) => end(fail(&e)).await,
                // The client was told `Cancelled` already; this reply is dropped.
                None => {
                    end(Reply::Error(convert::error(
                        ErrorKind::Cancelled,
                        "cancelled",
                    )))
                    .await
                }
            }
        }
        Request::ForceOpen { source, seconds } => {
            if let Some(denied) = admin_denied("force-open a source") {
                return denied;
            }
            let d = match convert::seconds("seconds", seconds, true) {
                Ok(d) => d,
                Err(e) => return invalid(e),
            };
            admin_result(
                owner,
                "force_open",
                &source,
                engine.force_open(&source, d).await,
            )
        }
        Request::ForceClose { source } => {
            if let Some(denied) = admin_denied("force-close a source") {
                return denied;
            }
            admin_result(
                owner,
                "force_close",
                &source,
                engine.force_close(&source).await,
            )
        }
        Request::Reset { source } => {
            if let Some(denied) = admin_denied("reset a source") {
                return denied;
            }
            admin_result(owner, "reset", &source, engine.reset(&source).await)
        }
        Request::Ping => Reply::Pong,
        // Both are handled by the connection loop and never reach a task.
        Request::Hello { .. } | Request::Cancel { .. } => Reply::Error(convert::error(
            ErrorKind::Internal,
            "request routed to the wrong handler",
        )),
    }
}

/// `Engine::acquire`, letting go of the in-flight slot if it has to wait: a waiting
/// Acquire is bounded by its call (one per call), and holding slots while waiting
/// could keep the `Report`s that would end the wait from being read.
async fn acquire<B: Backend>(
    engine: &Engine<B>,
    owner: OwnerId,
    call: u64,
    in_flight: &mut Option<InFlight>,
) -> Result<Grant, EngineError> {
    let mut fut = pin!(engine.acquire(owner, call));
    if let Poll::Ready(r) = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        return r;
    }
    *in_flight = None;
    fut.await
}

fn admin_result(
    conn: OwnerId,
    op: &str,
    source: &str,
    r: Result<crate::backend::Applied, EngineError>,
) -> Reply {
    match r {
        Ok(a) => {
            tracing::info!(conn, source, state = ?a.state, epoch = a.epoch, "admin {op}");
            Reply::Ok
        }
        Err(e) => Reply::Error(convert::engine_error(&e)),
    }
}

fn request_name(r: &Request) -> &'static str {
    match r {
        Request::Hello { .. } => "Hello",
        Request::BeginCall { .. } => "BeginCall",
        Request::Acquire { .. } => "Acquire",
        Request::Report { .. } => "Report",
        Request::EndCall { .. } => "EndCall",
        Request::Status => "Status",
        Request::ForceOpen { .. } => "ForceOpen",
        Request::ForceClose { .. } => "ForceClose",
        Request::Reset { .. } => "Reset",
        Request::Ping => "Ping",
        Request::Cancel { .. } => "Cancel",
        Request::Start(_) => "Start",
        Request::Retry { .. } => "Retry",
        Request::Finish { .. } => "Finish",
        Request::Begin(_) => "Begin",
        Request::StatusJson => "StatusJson",
    }
}

/// The one writer of a connection: frames from every request task, in queue order.
async fn write_loop(
    mut sink: FramedWrite<OwnedWriteHalf, ServerCodec>,
    mut rx: mpsc::Receiver<ServerFrame>,
    conn: OwnerId,
) {
    while let Some(frame) = rx.recv().await {
        let id = frame.id;
        match sink.feed(frame).await {
            Ok(()) => {}
            Err(FrameError::Io(e)) => {
                debug!(conn, error = %e, "write failed");
                return;
            }
            Err(e) => {
                // The reply could not be framed (e.g. a status larger than max_frame):
                // the client still gets an answer for its id.
                warn!(conn, request = id, error = %e, "reply could not be sent");
                let reply = Reply::Error(convert::error(
                    ErrorKind::Internal,
                    format!("the reply could not be sent: {e}"),
                ));
                if sink.feed(ServerFrame { id, reply }).await.is_err() {
                    return;
                }
            }
        }
        if rx.is_empty() && sink.flush().await.is_err() {
            return;
        }
    }
    let _ = sink.close().await;
}
