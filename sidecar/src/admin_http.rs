//! The admin listener: `GET /live`, `/ready` and `/metrics` over plain HTTP/1.1 on a
//! TCP address of its own, kept apart from the worker socket (linkerd2-proxy style)
//! so scraping never competes with admission. One request per connection; anything
//! else is answered 404/405. Small on purpose: no HTTP library for three routes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::engine::Engine;

/// Largest request head read; longer ones are refused.
const MAX_HEAD: usize = 8 * 1024;

/// How long a client may take to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serve until `shutdown` resolves. `/ready` turns 503 as soon as shutdown begins.
pub async fn serve<B: Backend>(
    listener: TcpListener,
    engine: Arc<Engine<B>>,
    shutdown: impl Future<Output = ()>,
) {
    let stopping = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => {
                stopping.cancel();
                return;
            }
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    let engine = engine.clone();
                    let stopping = stopping.clone();
                    tokio::spawn(async move {
                        if let Err(e) = handle(stream, &engine, &stopping).await {
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

async fn handle<B: Backend>(
    mut stream: TcpStream,
    engine: &Engine<B>,
    stopping: &CancellationToken,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(512);
    let head = tokio::time::timeout(READ_TIMEOUT, async {
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
    let complete = matches!(head, Ok(Ok(true)));
    let line = String::from_utf8_lossy(&buf);
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
