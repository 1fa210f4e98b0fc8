//! One request → the engine → one reply (§11, §11a; bindings/PROTOCOL.md §7, §14).
//!
//! [`dispatch`] answers what needs no engine future at once ([`Step::Now`]: `Ping`,
//! `BeginCall`, argument and permission errors) and turns everything else into a
//! [`Job`]: a boxed future the connection polls once, right where it read the frame.
//! On the memory backend that first poll finishes every request but an Acquire that
//! has to wait; only a future still pending after it is kept running ([`Running`]:
//! waiting Acquires, `Start`s and `Retry`s, and on a remote backend the round trips),
//! polled by the connection's task from then on. Moving a polled future, and
//! dropping it at any point, is what the engine's futures are built for: they are
//! cancel-safe at every await (a dropped Acquire leaves nothing reserved: see
//! `Ticket`, `AdmitResult` and the pass's slot guard in the engine) and keep no
//! state on the stack of whoever polled them.
//!
//! Each job owns a [`SlotGuard`]: the request's in-flight slot, given back the moment
//! its Acquire starts to wait (`Engine::acquire_or_wait`), or handed to the reply when
//! it finishes.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::future::{AbortHandle, AbortRegistration, Abortable};
use ipc_protocol::{ErrorKind, Reply, Request};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::budget::{Budget, Reserved, SlotGuard};
use super::convert;
use super::snapshot::Report as StatusKind;
use super::Shared;
use crate::backend::{Applied, Backend, Outcome};
use crate::engine::{Engine, EngineError, OwnerId};
use crate::limits;
use crate::logs::{self, Kind};

/// What the connection needs to run a request.
pub(super) struct Ctx<B: Backend> {
    pub engine: Arc<Engine<B>>,
    pub owner: OwnerId,
    /// The peer's uid (admin requests).
    pub uid: u32,
    pub shared: Arc<Shared>,
    pub budget: Arc<Budget>,
    /// The status snapshots' change count as of this connection's last answered
    /// change (or its accept): its status is never a shared snapshot built before
    /// that, so it reads its own writes and everything answered before it connected
    /// (`snapshot`).
    pub seen: std::sync::atomic::AtomicU64,
}

/// How a request is answered.
pub(super) enum Step {
    /// Answered already.
    Now(Reply),
    /// Needs the engine's futures: poll [`Job::fut`] (once inline, then in a task).
    Later(Job),
}

/// A request running as a future.
pub(super) struct Job {
    pub fut: Pin<Box<dyn Future<Output = Done> + Send>>,
    /// How a `Cancel` (or teardown) stops it.
    pub cancel: CancelBy,
}

/// What a finished job answers.
pub(super) enum Answer {
    /// A reply, encoded when it is buffered.
    Reply(Reply),
    /// A status reply, encoded already.
    Status(Encoded),
}

impl From<Reply> for Answer {
    fn from(r: Reply) -> Answer {
        Answer::Reply(r)
    }
}

/// A status reply as its snapshot holds it (`snapshot`), with the bytes its request
/// reserved of the connection's budget: released once the frame is in the outbox.
pub(super) struct Encoded {
    /// The whole frame with id 0 (the connection sets the request's id).
    pub frame: bytes::Bytes,
    /// Its reservation (`budget::Reserved`), dropped after the frame is buffered.
    pub held: Reserved,
}

/// A finished job.
pub(super) struct Done {
    pub reply: Answer,
    /// The request still held its in-flight slot: the reply takes it over.
    pub holds_slot: bool,
    /// A `Start` or `Retry`: if the client was already told `Cancelled`, a grant in
    /// `reply` is given back *and its call ended*.
    pub ends_call: bool,
}

/// How a running request can be stopped early.
pub(super) enum CancelBy {
    /// Dropping the future is safe at any await point: `Acquire`, `Start` (its call
    /// ends when dropped) and the read-only status requests — where a request can
    /// wait for long.
    Abort,
    /// `Retry`: its report must finish (several engine steps), its acquire may wait
    /// for long; the token ends the acquire, and the job ends the call.
    Token(CancellationToken),
    /// Short requests that change engine state in several steps: they finish.
    Never,
}

impl CancelBy {
    pub fn cancellable(&self) -> bool {
        !matches!(self, CancelBy::Never)
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

fn fail(e: &EngineError) -> Reply {
    convert::engine_reply(e)
}

fn invalid(e: convert::ArgumentError) -> Reply {
    Reply::Error(convert::error(ErrorKind::InvalidArgument, e.to_string()))
}

fn cancelled() -> Reply {
    Reply::Error(convert::error(ErrorKind::Cancelled, "cancelled"))
}

/// A job: `body` runs with the request's slot guard (`$slot`, borrowed, so the
/// engine's `on_wait` can release it) and yields the reply; the job reports whether
/// the slot is still held when it finishes.
macro_rules! job {
    ($budget:expr, $cancel:expr, $ends_call:expr, |$slot:ident| $body:block) => {{
        let $slot = SlotGuard::new($budget);
        Step::Later(Job {
            fut: Box::pin(async move {
                #[allow(unused_variables)]
                let reply = async {
                    let $slot = &$slot;
                    $body
                }
                .await;
                Done {
                    reply: reply.into(),
                    holds_slot: $slot.finish(),
                    ends_call: $ends_call,
                }
            }),
            cancel: $cancel,
        })
    }};
}

/// Map one request onto the engine. `Hello` and `Cancel` are the connection's.
pub(super) fn dispatch<B: Backend>(cx: &Ctx<B>, request: Request) -> Step {
    let owner = cx.owner;
    let engine = cx.engine.clone();
    let admin_denied = |what: &str| {
        (!cx.shared.opts.access.may_admin(cx.uid)).then(|| {
            Step::Now(Reply::Error(convert::error(
                ErrorKind::PermissionDenied,
                format!("uid {} may not {what} (not in admin_uids)", cx.uid),
            )))
        })
    };
    // §18: a report with observed limits is the same report, carrying them.
    let (request, observed) = match convert::split_observed(request) {
        Ok(x) => x,
        Err(e) => return Step::Now(invalid(e)),
    };
    // §19: a call on behalf of a tenant is the same call, naming it.
    let (request, tenant) = match convert::split_tenant(request) {
        Ok(x) => x,
        Err(e) => return Step::Now(invalid(e)),
    };
    match request {
        Request::Ping => Step::Now(Reply::Pong),
        Request::BeginCall { scope, est_tokens } => {
            if let Some(Err(e)) = est_tokens.map(|t| convert::tokens("est_tokens", t)) {
                return Step::Now(invalid(e));
            }
            Step::Now(match engine.begin_call(owner, &scope, est_tokens) {
                Ok(call) => Reply::CallBegun { call },
                Err(e) => fail(&e),
            })
        }
        Request::Begin(spec) => Step::Now(match convert::call_spec(spec) {
            Err(e) => invalid(e),
            Ok(a) => match engine.begin_call_for(
                owner,
                &a.scope,
                a.est,
                a.priority.as_deref(),
                tenant.as_deref(),
            ) {
                Ok(call) => Reply::CallBegun { call },
                Err(e) => fail(&e),
            },
        }),
        Request::Acquire { call } => job!(&cx.budget, CancelBy::Abort, false, |slot| {
            match engine.acquire_or_wait(owner, call, || slot.release()).await {
                Ok(g) => convert::granted(&g),
                Err(e) => fail(&e),
            }
        }),
        Request::Start(spec) => {
            let args = match convert::call_spec(spec) {
                Ok(a) => a,
                Err(e) => return Step::Now(invalid(e)),
            };
            let call = match engine.begin_call_for(
                owner,
                &args.scope,
                args.est,
                args.priority.as_deref(),
                tenant.as_deref(),
            ) {
                Ok(call) => call,
                Err(e) => return Step::Now(fail(&e)),
            };
            job!(&cx.budget, CancelBy::Abort, true, |slot| {
                let mut guard = CallGuard {
                    engine: engine.clone(),
                    owner,
                    call: Some(call),
                };
                let r = engine.acquire_or_wait(owner, call, || slot.release()).await;
                guard.call = None;
                match r {
                    Ok(g) => convert::started(call, &g),
                    Err(e) => {
                        let _ = engine.end_call(owner, call).await;
                        fail(&e)
                    }
                }
            })
        }
        Request::Report { permit, outcome } => {
            let (outcome, cached) = match convert::outcome_cached(outcome) {
                Ok(o) => o,
                Err(e) => return Step::Now(invalid(e)),
            };
            job!(&cx.budget, CancelBy::Never, false, |slot| {
                match engine
                    .report_full(owner, permit, outcome, observed, cached)
                    .await
                {
                    Ok((_, Ok(a))) => convert::reported(&a),
                    Ok((_, Err(e))) | Err(e) => fail(&e),
                }
            })
        }
        Request::EndCall { call } => job!(&cx.budget, CancelBy::Never, false, |slot| {
            match engine.end_call(owner, call).await {
                Ok(()) => Reply::Ok,
                Err(e) => fail(&e),
            }
        }),
        Request::Finish { permit, outcome } => {
            let (outcome, cached) = match convert::outcome_cached(outcome) {
                Ok(o) => o,
                Err(e) => return Step::Now(invalid(e)),
            };
            job!(&cx.budget, CancelBy::Never, false, |slot| {
                match engine
                    .report_full(owner, permit, outcome, observed, cached)
                    .await
                {
                    // Refused: nothing changed, the permit is still the client's.
                    Err(e) => fail(&e),
                    Ok((call, r)) => {
                        let _ = engine.end_call(owner, call).await;
                        match r {
                            Ok(a) => convert::reported(&a),
                            Err(e) => fail(&e),
                        }
                    }
                }
            })
        }
        Request::Retry { permit, outcome } => {
            let (outcome, cached) = match convert::outcome_cached(outcome) {
                Ok(o) => o,
                Err(e) => return Step::Now(invalid(e)),
            };
            let token = CancellationToken::new();
            let stop = token.clone();
            job!(&cx.budget, CancelBy::Token(token), true, |slot| {
                let call = match engine
                    .report_full(owner, permit, outcome, observed, cached)
                    .await
                {
                    Err(e) => return fail(&e),
                    // Applied (or lost to a backend failure): the attempt is over.
                    Ok((call, _)) => call,
                };
                let r = tokio::select! {
                    biased;
                    () = stop.cancelled() => None,
                    r = engine.acquire_or_wait(owner, call, || slot.release()) => Some(r),
                };
                let reply = match r {
                    Some(Ok(g)) => return convert::granted(&g),
                    Some(Err(e)) => fail(&e),
                    // The client was told `Cancelled` already; this reply is dropped.
                    None => cancelled(),
                };
                let _ = engine.end_call(owner, call).await;
                reply
            })
        }
        Request::TenantStatus { scope, tenant } => {
            if let Err(e) = convert::tenant_id(&tenant) {
                return Step::Now(invalid(e));
            }
            job!(&cx.budget, CancelBy::Abort, false, |slot| {
                match engine.tenant_status(&tenant, scope.as_deref()).await {
                    Ok(t) => Reply::StatusJson(super::tenant_doc::tenant_json(&t)),
                    Err(e) => fail(&e),
                }
            })
        }
        Request::Status | Request::StatusJson => {
            let kind = match request {
                Request::Status => StatusKind::Status,
                _ => StatusKind::Json,
            };
            let shared = cx.shared.clone();
            let seen = cx.seen.load(std::sync::atomic::Ordering::Relaxed);
            // Charged from now (the frame is read) until the reply is buffered.
            let mut held = Reserved::new(&cx.budget, &cx.shared, shared.status.estimate(kind));
            job!(&cx.budget, CancelBy::Abort, false, |slot| {
                let frame = shared.status.get(kind, &engine, seen, &mut held).await;
                Answer::Status(Encoded { frame, held })
            })
        }
        Request::ForceOpen { source, seconds } => {
            if let Some(denied) = admin_denied("force-open a source") {
                return denied;
            }
            let d = match convert::force_open_seconds(seconds) {
                Ok(d) => d,
                Err(e) => return Step::Now(invalid(e)),
            };
            job!(&cx.budget, CancelBy::Never, false, |slot| {
                let r = engine.force_open(&source, d).await;
                admin_result(owner, "force_open", &source, r)
            })
        }
        Request::ForceClose { source } => {
            if let Some(denied) = admin_denied("force-close a source") {
                return denied;
            }
            job!(&cx.budget, CancelBy::Never, false, |slot| {
                let r = engine.force_close(&source).await;
                admin_result(owner, "force_close", &source, r)
            })
        }
        Request::Reset { source } => {
            if let Some(denied) = admin_denied("reset a source") {
                return denied;
            }
            job!(&cx.budget, CancelBy::Never, false, |slot| {
                let r = engine.reset(&source).await;
                admin_result(owner, "reset", &source, r)
            })
        }
        // Both are the connection's own and never reach here; the observed reports
        // became plain ones above, and so did the tenants' starts.
        Request::Hello { .. }
        | Request::Cancel { .. }
        | Request::ReportObserved { .. }
        | Request::RetryObserved { .. }
        | Request::FinishObserved { .. }
        | Request::StartTenant { .. }
        | Request::BeginTenant { .. } => Step::Now(Reply::Error(convert::error(
            ErrorKind::Internal,
            "request routed to the wrong handler",
        ))),
    }
}

fn admin_result(conn: OwnerId, op: &str, source: &str, r: Result<Applied, EngineError>) -> Reply {
    match r {
        Ok(a) => {
            info!(conn, source, state = ?a.state, epoch = a.epoch, "admin {op}");
            Reply::Ok
        }
        Err(e) => fail(&e),
    }
}

/// A reply whose request the client cancelled after the engine answered: a permit
/// the client will never learn of goes straight back (reported `Cancelled`, which
/// refunds it), and the call of a cancelled `Start` or `Retry` ends.
pub(super) fn give_back<B: Backend>(engine: &Arc<Engine<B>>, owner: OwnerId, done: Done) {
    let Answer::Reply(Reply::Granted { permit, .. } | Reply::Started { permit, .. }) = done.reply
    else {
        return;
    };
    let engine = engine.clone();
    tokio::spawn(async move {
        if let Ok((call, _)) = engine
            .report_in_call(owner, permit, Outcome::Cancelled)
            .await
        {
            if done.ends_call {
                let _ = engine.end_call(owner, call).await;
            }
        }
    });
}

/// Log an error reply: expected outcomes of admission quietly, the rest as warnings.
pub(super) fn log_error(conn: OwnerId, request: u64, reply: &Reply) {
    let Reply::Error(e) = reply else { return };
    match e.kind {
        ErrorKind::CircuitOpen
        | ErrorKind::AllSourcesExhausted
        | ErrorKind::ShuttingDown
        | ErrorKind::Cancelled => debug!(conn, request, kind = ?e.kind, "{}", e.message),
        kind => {
            let family = match kind {
                ErrorKind::PermissionDenied => Kind::PermissionDenied,
                ErrorKind::BackendUnavailable => Kind::BackendRefused,
                ErrorKind::ProtocolViolation => Kind::BadHandshake,
                ErrorKind::Malformed | ErrorKind::FrameTooLarge => Kind::BadFrame,
                ErrorKind::Overloaded => Kind::Overloaded,
                ErrorKind::Internal => Kind::Internal,
                _ => Kind::BadRequest,
            };
            if logs::allow(family) {
                let message = limits::truncate(&e.message, 4 * limits::MAX_ECHO);
                warn!(conn, request, kind = ?e.kind, "{message}");
            }
        }
    }
}

/// The request's name, for messages.
pub(super) fn request_name(r: &Request) -> &'static str {
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
        Request::ReportObserved { .. } => "ReportObserved",
        Request::RetryObserved { .. } => "RetryObserved",
        Request::FinishObserved { .. } => "FinishObserved",
        Request::StartTenant { .. } => "StartTenant",
        Request::BeginTenant { .. } => "BeginTenant",
        Request::TenantStatus { .. } => "TenantStatus",
    }
}

/// A request still running after its first poll ([`Running`]).
pub(super) struct Pending {
    /// Which running future answers it (an id may be reused once answered, while a
    /// token-cancelled future of the old request still runs).
    pub seq: u64,
    /// Aborts its [`Running`] (a `Cancel`, teardown): the future is dropped at the
    /// connection task's next poll of its running set.
    pub task: AbortHandle,
    /// How a `Cancel` stops it.
    pub cancel: CancelBy,
    /// Its `/metrics` timer, observed when its reply is ready.
    pub timer: Timer,
}

/// A request's type ([`crate::metrics::request_type`]) and when it was read: the
/// `polygate_request_duration_seconds{request}` observation made with its reply.
#[derive(Clone, Copy)]
pub(super) struct Timer {
    /// Index of the request type.
    pub ty: usize,
    /// When the frame was decoded (`CLOCK_MONOTONIC` ns: [`crate::clock::monotonic_nanos`],
    /// the cheapest reading of the clock `Instant` uses).
    pub started: u64,
}

impl Pending {
    /// Stop it the way its request may be stopped.
    pub fn cancel(&self) {
        match &self.cancel {
            CancelBy::Abort => self.task.abort(),
            CancelBy::Token(t) => t.cancel(),
            CancelBy::Never => {}
        }
    }
}

/// A job still pending after its first poll, polled from then on by its
/// connection's own task (a `FuturesUnordered` there), not spawned: its wake-ups
/// (a Redis reply, a freed source) wake that task directly, and no task is spawned,
/// scheduled and joined per remote round trip (§16). It yields its request id and
/// its answer: `None` when aborted, an `Internal` error if the handler panicked.
pub(super) struct Running {
    conn: OwnerId,
    id: u64,
    seq: u64,
    fut: Abortable<Pin<Box<dyn Future<Output = Done> + Send>>>,
}

impl Running {
    /// `fut` as a running request, and the handle that aborts it.
    pub fn new(
        conn: OwnerId,
        id: u64,
        seq: u64,
        fut: Pin<Box<dyn Future<Output = Done> + Send>>,
    ) -> (Running, AbortHandle) {
        let (handle, reg): (AbortHandle, AbortRegistration) = AbortHandle::new_pair();
        let fut = Abortable::new(fut, reg);
        (Running { conn, id, seq, fut }, handle)
    }
}

impl Future for Running {
    type Output = (u64, u64, Option<Done>);

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(&mut this.fut).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(Ok(done))) => Poll::Ready((this.id, this.seq, Some(done))),
            Ok(Poll::Ready(Err(_aborted))) => Poll::Ready((this.id, this.seq, None)),
            Err(_) => Poll::Ready((
                this.id,
                this.seq,
                Some(Done {
                    reply: panicked(this.conn, this.id).into(),
                    holds_slot: false,
                    ends_call: false,
                }),
            )),
        }
    }
}

/// The reply of a request whose handler panicked (logged).
pub(super) fn panicked(conn: OwnerId, id: u64) -> Reply {
    warn!(conn, request = id, "request handler panicked");
    Reply::Error(convert::error(
        ErrorKind::Internal,
        "internal error while handling the request",
    ))
}

/// Check the first frame of a connection: a `Hello` of a version this sidecar
/// speaks. Its version and `Welcome`, or why the connection is closed.
pub(super) fn handshake(
    conn: OwnerId,
    request: Request,
    max_frame: u32,
) -> Result<(u32, Reply), String> {
    let Request::Hello {
        protocol_version,
        client_name,
        pid,
    } = request
    else {
        return Err(format!(
            "the first frame must be Hello, got {}",
            request_name(&request)
        ));
    };
    let supported = ipc_protocol::MIN_PROTOCOL_VERSION..=ipc_protocol::PROTOCOL_VERSION;
    if !supported.contains(&protocol_version) {
        return Err(format!(
            "protocol version mismatch: client {client_name:?} speaks version \
             {protocol_version}, this sidecar speaks versions {} to {}",
            supported.start(),
            supported.end()
        ));
    }
    debug!(conn, client = %client_name, client_pid = pid, protocol_version, "hello");
    let welcome = Reply::Welcome {
        protocol_version,
        sidecar_version: env!("CARGO_PKG_VERSION").to_string(),
        max_frame,
    };
    Ok((protocol_version, welcome))
}
