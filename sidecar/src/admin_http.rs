//! The admin listener: `GET /live`, `/ready` and `/metrics` over plain HTTP/1.1 on a
//! TCP address of its own, kept apart from the worker socket (linkerd2-proxy style)
//! so scraping never competes with admission. One request per connection; anything
//! else is answered 404/405. Small on purpose: no HTTP library for three routes.
//! Bounded: at most [`MAX_CONNECTIONS`] connections at once (more are refused with a
//! 503 at once), each closed within [`DEADLINE`] of being accepted, whatever the peer
//! does.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::engine::Engine;

/// Largest request head read; longer ones are refused.
const MAX_HEAD: usize = 8 * 1024;

/// Default for [`AdminOptions::max_connections`].
pub const MAX_CONNECTIONS: usize = 32;

/// Default for [`AdminOptions::deadline`].
pub const DEADLINE: Duration = Duration::from_secs(5);

/// How often, at most, refused connections are logged at `warn`.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Answer to a connection over [`AdminOptions::max_connections`].
const TOO_MANY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\
Content-Length: 27\r\nConnection: close\r\n\r\ntoo many admin connections\n";

/// Answer to a connection that did not send its request head within the deadline.
const TOO_SLOW: &[u8] = b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain\r\n\
Content-Length: 16\r\nConnection: close\r\n\r\nrequest timeout\n";

/// Limits of the admin listener: every connection holds a file descriptor, and the
/// worker socket shares the process's descriptor limit.
#[derive(Debug, Clone)]
pub struct AdminOptions {
    /// Connections served at once; more are answered 503 (best effort, without
    /// waiting) and closed at once.
    pub max_connections: usize,
    /// Time a connection may take in all, from accept to the last byte written
    /// (reading the request, rendering, writing); then it is closed.
    pub deadline: Duration,
}

impl Default for AdminOptions {
    fn default() -> Self {
        AdminOptions {
            max_connections: MAX_CONNECTIONS,
            deadline: DEADLINE,
        }
    }
}

/// [`serve_with`] the default [`AdminOptions`].
pub async fn serve<B: Backend>(
    listener: TcpListener,
    engine: Arc<Engine<B>>,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, engine, AdminOptions::default(), shutdown).await
}

/// Serve until `shutdown` resolves. `/ready` answers 503 once the engine is shutting
/// down (the daemon keeps this listener up until the worker server has drained, so
/// the drain is visible) and for requests still in progress when `shutdown` resolves.
pub async fn serve_with<B: Backend>(
    listener: TcpListener,
    engine: Arc<Engine<B>>,
    opts: AdminOptions,
    shutdown: impl Future<Output = ()>,
) {
    let stopping = CancellationToken::new();
    let slots = Arc::new(Semaphore::new(opts.max_connections.max(1)));
    let mut refused: u64 = 0;
    let mut last_warned: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => {
                stopping.cancel();
                return;
            }
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        // Never wait on a refused peer: one non-blocking write, then
                        // close.
                        let _ = stream.try_write(TOO_MANY);
                        drop(stream);
                        refused += 1;
                        if last_warned.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_EVERY) {
                            tracing::warn!(
                                %peer,
                                refused,
                                limit = opts.max_connections,
                                "admin listener: too many connections; refusing"
                            );
                            last_warned = Some(Instant::now());
                            refused = 0;
                        }
                        continue;
                    };
                    let engine = engine.clone();
                    let stopping = stopping.clone();
                    let deadline = Instant::now() + opts.deadline;
                    tokio::spawn(async move {
                        let _slot = slot;
                        if let Err(e) = handle(stream, &engine, &stopping, deadline).await {
                            tracing::debug!(error = %e, "admin request failed");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "admin listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

/// One request, all of it before `deadline`.
async fn handle<B: Backend>(
    mut stream: TcpStream,
    engine: &Engine<B>,
    stopping: &CancellationToken,
    deadline: Instant,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(512);
    let head = tokio::time::timeout_at(deadline, async {
        let mut chunk = [0u8; 512];
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
                return Ok(true);
            }
            if buf.len() > MAX_HEAD {
                return Ok(false);
            }
        }
    })
    .await;
    let Ok(head) = head else {
        // Out of time: a best-effort answer that cannot block, then close.
        let _ = stream.try_write(TOO_SLOW);
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no request head within the deadline",
        ));
    };
    let respond = respond(&mut stream, head, &buf, engine, stopping);
    match tokio::time::timeout_at(deadline, respond).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the response was not written within the deadline",
        )),
    }
}

/// Route the request head in `buf` and write the response.
async fn respond<B: Backend>(
    stream: &mut TcpStream,
    head: std::io::Result<bool>,
    buf: &[u8],
    engine: &Engine<B>,
    stopping: &CancellationToken,
) -> std::io::Result<()> {
    let complete = matches!(head, Ok(true));
    let line = String::from_utf8_lossy(buf);
    let mut parts = line.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (code, ctype, body) = if !complete {
        (400, "text/plain", "bad request\n".to_string())
    } else if method != "GET" && method != "HEAD" {
        (405, "text/plain", "only GET\n".to_string())
    } else {
        match path.split('?').next().unwrap_or("") {
            "/live" => (200, "text/plain", "live\n".to_string()),
            "/ready" if stopping.is_cancelled() || engine.is_shutting_down() => {
                (503, "text/plain", "shutting down\n".to_string())
            }
            "/ready" => (200, "text/plain", "ready\n".to_string()),
            "/metrics" => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                crate::metrics::render(engine).await,
            ),
            _ => (
                404,
                "text/plain",
                "not found: try /live, /ready, /metrics\n".to_string(),
            ),
        }
    };
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let mut resp = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        resp.push_str(&body);
    }
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}
