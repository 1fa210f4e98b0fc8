//! The admin listener (§12): `GET /live`, `/ready` and `/metrics` over HTTP/1.1 on a
//! TCP address of its own, kept apart from the worker socket (linkerd2-proxy style)
//! so scraping never competes with admission. HTTP is hyper's (`hyper` +
//! `hyper-util`); the routes and the limits are ours.
//!
//! Probes cannot be locked out by idle or slow connections: nothing is ever refused.
//! Each connection must send a request head within [`AdminOptions::header_read_timeout`]
//! (also between keep-alive requests) and is closed after
//! [`AdminOptions::max_lifetime`]. Past [`AdminOptions::max_connections`] the *oldest*
//! connection is asked to close (at once if idle, after its response otherwise, and
//! dropped after [`SHED_GRACE`] either way) to make room for the new one, so however
//! many idle TCP connections a peer opens, the next probe is served.
//!
//! `/metrics` costs the shared backend nothing per scrape ([`crate::metrics`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::metrics::{self, Exposition};

/// Default for [`AdminOptions::max_connections`].
pub const MAX_CONNECTIONS: usize = 64;

/// Default for [`AdminOptions::header_read_timeout`].
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Default for [`AdminOptions::max_lifetime`].
pub const MAX_LIFETIME: Duration = Duration::from_secs(60);

/// How long a connection asked to close (shed, or shutdown) may still take to
/// finish its response before it is dropped.
pub const SHED_GRACE: Duration = Duration::from_secs(1);

/// Largest request head accepted (hyper's read buffer); longer ones are refused.
const MAX_HEAD: usize = 16 * 1024;

/// Limits of the admin listener: every connection holds a file descriptor, and the
/// worker socket shares the process's descriptor limit.
#[derive(Debug, Clone)]
pub struct AdminOptions {
    /// Connections kept at once; a new one past this makes the oldest close.
    pub max_connections: usize,
    /// Time a connection has to send a complete request head, counted from the
    /// accept or from the end of the previous response (idle keep-alive).
    pub header_read_timeout: Duration,
    /// Time a connection may live in all, whatever it does.
    pub max_lifetime: Duration,
}

impl Default for AdminOptions {
    fn default() -> Self {
        AdminOptions {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_lifetime: MAX_LIFETIME,
        }
    }
}

/// Live connections in accept order: id → how to ask it to close.
type Live = Arc<Mutex<BTreeMap<u64, oneshot::Sender<()>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`serve_with`] the default [`AdminOptions`].
pub async fn serve<B: Backend>(
    listener: TcpListener,
    exp: Exposition<B>,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, exp, AdminOptions::default(), shutdown).await
}

/// Serve until `shutdown` resolves, then ask every connection to close. `/ready`
/// answers 503 once the engine is shutting down (the daemon keeps this listener up
/// until the worker server has drained, so the drain is visible) and for requests
/// still in progress when `shutdown` resolves.
pub async fn serve_with<B: Backend>(
    listener: TcpListener,
    exp: Exposition<B>,
    opts: AdminOptions,
    shutdown: impl Future<Output = ()>,
) {
    let stopping = CancellationToken::new();
    let live: Live = Arc::default();
    let mut next_id: u64 = 0;
    let mut shed: u64 = 0;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => {
                stopping.cancel();
                return;
            }
            r = listener.accept() => match r {
                Ok((stream, _peer)) => {
                    let _ = stream.set_nodelay(true);
                    next_id += 1;
                    let id = next_id;
                    let (close_tx, close_rx) = oneshot::channel();
                    {
                        let mut live = lock(&live);
                        while live.len() >= opts.max_connections.max(1) {
                            let Some((_, oldest)) = live.pop_first() else { break };
                            let _ = oldest.send(());
                            shed += 1;
                        }
                        live.insert(id, close_tx);
                    }
                    if shed > 0 && shed.is_power_of_two() {
                        tracing::debug!(shed, limit = opts.max_connections, "admin listener: closing the oldest connections to make room");
                    }
                    tokio::spawn(connection(
                        stream,
                        id,
                        exp.clone(),
                        opts.clone(),
                        live.clone(),
                        close_rx,
                        stopping.clone(),
                    ));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "admin listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// Serve one connection until it closes, its lifetime ends, or it is asked to
/// close (shed, shutdown) and [`SHED_GRACE`] passed.
async fn connection<B: Backend>(
    stream: TcpStream,
    id: u64,
    exp: Exposition<B>,
    opts: AdminOptions,
    live: Live,
    mut close: oneshot::Receiver<()>,
    stopping: CancellationToken,
) {
    let service = {
        let stopping = stopping.clone();
        hyper::service::service_fn(move |req| {
            let exp = exp.clone();
            let stopping = stopping.clone();
            async move { Ok::<_, Infallible>(respond(req, &exp, &stopping).await) }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_read_timeout)
        .max_buf_size(MAX_HEAD)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let lifetime = tokio::time::sleep(opts.max_lifetime);
    tokio::pin!(lifetime);
    let mut closing: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "admin connection ended with an error");
                }
                break;
            }
            _ = &mut close, if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Box::pin(tokio::time::sleep(SHED_GRACE)));
            }
            () = stopping.cancelled(), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Box::pin(tokio::time::sleep(SHED_GRACE)));
            }
            () = async { closing.as_mut().expect("guarded").await }, if closing.is_some() => break,
            () = &mut lifetime => break,
        }
    }
    lock(&live).remove(&id);
}

/// A plain-text response.
fn text(code: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = code;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Route one request.
async fn respond<B: Backend>(
    req: Request<Incoming>,
    exp: &Exposition<B>,
    stopping: &CancellationToken,
) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/live" => text(StatusCode::OK, "live\n"),
        "/ready" if stopping.is_cancelled() || exp.engine.is_shutting_down() => {
            text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
        }
        "/ready" => text(StatusCode::OK, "ready\n"),
        "/metrics" => {
            let mut r = Response::new(Full::new(Bytes::from(metrics::render(exp).await)));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static(metrics::CONTENT_TYPE),
            );
            r
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /live, /ready, /metrics\n",
        ),
    }
}
