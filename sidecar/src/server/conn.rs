//! One client connection: handshake, request tasks, the writer, teardown.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::{FutureExt, SinkExt, StreamExt};
use ipc_protocol::{ClientFrame, ErrorKind, ErrorReply, Reply, Request, ServerFrame};
use ipc_protocol::{FrameError, ServerCodec};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::convert;
use super::ServerOptions;
use crate::backend::{Backend, Outcome};
use crate::engine::{Engine, OwnerId};
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
/// How long teardown waits for the writer to flush the last replies.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);
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
}

/// A running request.
struct Pending {
    task: AbortHandle,
    /// Safe to abort at any await point: `Acquire` (its engine future is cancel-safe
    /// and is where a request can wait for long) and `Status` (read-only). Other
    /// requests change engine state in several steps and are short; they finish.
    abortable: bool,
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
        shared,
        pending: Mutex::new(HashMap::new()),
        permits: Mutex::new(HashMap::new()),
    });
    let reader = FramedRead::new(read, ServerCodec::new(max_frame as usize));
    let mut tasks = JoinSet::new();
    let end = serve_frames(&conn, reader, &tx, &mut tasks).await;

    // Teardown: abort the waits (dropping their engine futures ends them), let the
    // short state-changing requests finish (bounded), then release everything the
    // connection held.
    for p in lock(&conn.pending).values().filter(|p| p.abortable) {
        p.task.abort();
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
    if tokio::time::timeout(FLUSH_TIMEOUT, &mut writer_task)
        .await
        .is_err()
    {
        writer_task.abort();
    }
    let why = match end {
        End::Closed => "closed by peer",
        End::Violation => "closed after a protocol error",
        End::Shutdown => "closed for shutdown",
    };
    debug!(conn = id, "disconnected: {why}");
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
    let send = |id: u64, reply: Reply| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(ServerFrame { id, reply }).await;
        }
    };
    let violation = |id: u64, message: String| {
        debug!(conn = conn.id, "{message}");
        send(
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
        Ok(Some(Err(e))) => return frame_error(conn.id, e, &send).await,
        Ok(Some(Ok(ClientFrame {
            id,
            request:
                Request::Hello {
                    protocol_version,
                    client_name,
                    pid,
                },
        }))) => {
            if protocol_version != ipc_protocol::PROTOCOL_VERSION {
                violation(
                    id,
                    format!(
                        "protocol version mismatch: client {client_name:?} speaks version \
                         {protocol_version}, this sidecar speaks version {}",
                        ipc_protocol::PROTOCOL_VERSION
                    ),
                )
                .await;
                return End::Violation;
            }
            debug!(conn = conn.id, client = %client_name, client_pid = pid, "hello");
            let welcome = Reply::Welcome {
                protocol_version: ipc_protocol::PROTOCOL_VERSION,
                sidecar_version: env!("CARGO_PKG_VERSION").to_string(),
                max_frame: opts.max_frame,
            };
            send(id, welcome).await;
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
            f = reader.next() => f,
        };
        let ClientFrame { id, request } = match frame {
            None => return End::Closed,
            Some(Err(e)) => return frame_error(conn.id, e, &send).await,
            Some(Ok(f)) => f,
        };
        match request {
            Request::Hello { .. } => {
                violation(id, "Hello may only be the first frame".into()).await;
                return End::Violation;
            }
            Request::Cancel { target } => {
                let cancelled = {
                    let mut pending = lock(&conn.pending);
                    match pending.get(&target) {
                        Some(p) if p.abortable => pending.remove(&target),
                        _ => None,
                    }
                };
                if let Some(p) = cancelled {
                    p.task.abort();
                    debug!(conn = conn.id, request = target, "cancelled");
                    let e = convert::error(
                        ErrorKind::Cancelled,
                        format!("request {target} was cancelled"),
                    );
                    send(target, Reply::Error(e)).await;
                }
                send(id, Reply::Ok).await;
            }
            request => {
                // Spawned under the lock, so the task cannot finish (and look for its
                // entry) before the entry exists.
                let duplicate = match lock(&conn.pending).entry(id) {
                    Entry::Occupied(_) => true,
                    Entry::Vacant(slot) => {
                        let abortable =
                            matches!(request, Request::Acquire { .. } | Request::Status);
                        let task = tasks.spawn(request_task(conn.clone(), tx.clone(), id, request));
                        slot.insert(Pending { task, abortable });
                        false
                    }
                };
                if duplicate {
                    let e = convert::error(
                        ErrorKind::InvalidArgument,
                        format!("request id {id} is already in flight on this connection"),
                    );
                    send(id, Reply::Error(e)).await;
                }
            }
        }
    }
}

/// Answer a frame that could not be read, where that is possible; the caller closes.
async fn frame_error<Fut>(conn: OwnerId, e: FrameError, send: impl Fn(u64, Reply) -> Fut) -> End
where
    Fut: std::future::Future<Output = ()>,
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

/// Run one request and send its reply, unless it was cancelled meanwhile.
async fn request_task<B: Backend>(
    conn: Arc<Conn<B>>,
    tx: mpsc::Sender<ServerFrame>,
    id: u64,
    request: Request,
) {
    let reply = AssertUnwindSafe(handle(&conn, request))
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
        // permit it will never learn of goes straight back.
        if let Reply::Granted { permit, .. } = reply {
            lock(&conn.permits).remove(&permit);
            let engine = conn.engine.clone();
            let owner = conn.id;
            tokio::spawn(async move {
                let _ = engine.report(owner, permit, Outcome::Cancelled).await;
            });
        }
        return;
    }
    if let Reply::Error(e) = &reply {
        log_error(conn.id, id, e);
    }
    let _ = tx.send(ServerFrame { id, reply }).await;
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

/// Map one request onto the engine.
async fn handle<B: Backend>(conn: &Conn<B>, request: Request) -> Reply {
    let engine = &conn.engine;
    let owner = conn.id;
    let fail = |e: &crate::engine::EngineError| Reply::Error(convert::engine_error(e));
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
            match engine.begin_call(owner, &scope, est_tokens) {
                Ok(call) => Reply::CallBegun { call },
                Err(e) => fail(&e),
            }
        }
        Request::Acquire { call } => match engine.acquire(owner, call).await {
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
            if matches!(r, Ok(_) | Err(crate::engine::EngineError::UnknownPermit(_))) {
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

fn admin_result(
    conn: OwnerId,
    op: &str,
    source: &str,
    r: Result<crate::backend::Applied, crate::engine::EngineError>,
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
