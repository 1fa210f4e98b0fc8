//! The admin listener (`/live`, `/ready`, `/metrics`) and the Prometheus exposition.

mod support;

use std::time::Duration;

use polygate::admin_http::{serve_with, AdminOptions};
use polygate::backend::{FailureKind, Outcome};
use support::engine_cfg::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

async fn get(addr: std::net::SocketAddr, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out[9..12].parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test]
async fn live_ready_metrics_and_errors() {
    let e = engine(&config(vec![
        scope("chat", vec![source("a"), source("b\"q")]),
        scope("emb", vec![source("a")]),
    ]));
    // Some traffic: a success, a failure, a 429, and a fail-fast CircuitOpen.
    for outcome in [
        Outcome::Success {
            tokens: None,
            count_attempt: true,
        },
        Outcome::Failure(FailureKind::Timeout),
        Outcome::RateLimited { retry_after: None },
    ] {
        let call = e.begin_call(1, "emb", None).unwrap();
        let g = e.acquire(1, call).await.unwrap();
        e.report(1, g.permit, outcome).await.unwrap();
        e.end_call(1, call).await.unwrap();
    }
    e.force_open("a", secs(60)).await.unwrap();
    let call = e.begin_call(1, "emb", None).unwrap();
    assert!(e.acquire(1, call).await.is_err());

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(polygate::admin_http::serve(listener, e.clone(), async {
        let _ = stop_rx.await;
    }));

    assert_eq!(
        get(addr, "GET /live HTTP/1.1\r\nHost: x\r\n\r\n").await,
        (200, "live\n".into())
    );
    assert_eq!(get(addr, "GET /ready HTTP/1.1\r\n\r\n").await.0, 200);
    assert_eq!(get(addr, "GET /nope HTTP/1.1\r\n\r\n").await.0, 404);
    assert_eq!(get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await.0, 405);

    let (code, m) = get(addr, "GET /metrics HTTP/1.1\r\n\r\n").await;
    assert_eq!(code, 200);
    let info = format!(
        "polygate_info{{version=\"{}\",backend=\"memory\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    for line in [
        info.as_str(),
        "polygate_grants_total{source=\"a\"} 3",
        "polygate_reports_total{source=\"a\",outcome=\"success\"} 1",
        "polygate_reports_total{source=\"a\",outcome=\"failure\"} 1",
        "polygate_reports_total{source=\"a\",outcome=\"rate_limited\"} 1",
        "polygate_acquire_errors_total{scope=\"emb\",kind=\"circuit_open\"} 1",
        "polygate_breaker_state{source=\"a\",state=\"open\"} 1",
        "polygate_breaker_state{source=\"a\",state=\"closed\"} 0",
        // A label value with a quote is escaped.
        "polygate_pacer_in_flight{source=\"b\\\"q\"} 0",
    ] {
        assert!(m.lines().any(|l| l == line), "missing {line:?} in:\n{m}");
    }
    let ra: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("polygate_breaker_retry_after_seconds{source=\"a\"} "))
        .expect("retry_after sample")
        .parse()
        .unwrap();
    assert!(ra > 59.0 && ra <= 60.0, "{ra}");
    // Each family is declared once even though `a` is in two scopes.
    assert_eq!(m.matches("# TYPE polygate_breaker_epoch gauge").count(), 1);
    assert_eq!(
        m.lines()
            .filter(|l| l.starts_with("polygate_breaker_epoch{source=\"a\"}"))
            .count(),
        1
    );

    e.shutdown();
    assert_eq!(get(addr, "GET /ready HTTP/1.1\r\n\r\n").await.0, 503);
    let _ = stop_tx.send(());
    server.await.unwrap();
}

/// Read until the peer closes (EOF or reset), at most `limit`: what was read, and when
/// the connection ended (`None`: still open at `limit`).
async fn until_closed(mut s: TcpStream, limit: Duration) -> (Vec<u8>, Option<Duration>) {
    let started = Instant::now();
    let mut out = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        match tokio::time::timeout_at(started + limit, s.read(&mut chunk)).await {
            Err(_) => return (out, None),
            Ok(Ok(0)) | Ok(Err(_)) => return (out, Some(started.elapsed())),
            Ok(Ok(n)) => out.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test]
async fn idle_connections_are_capped_and_closed_at_the_deadline() {
    let e = engine(&config(vec![scope("chat", vec![source("a")])]));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = AdminOptions {
        max_connections: 32,
        deadline: Duration::from_millis(1000),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_with(listener, e.clone(), opts, async {
        let _ = stop_rx.await;
    }));

    // 40 connections that never send a byte, accepted in order.
    let started = Instant::now();
    let mut idle = Vec::new();
    for _ in 0..40 {
        let s = TcpStream::connect(addr).await.unwrap();
        idle.push(tokio::spawn(until_closed(s, Duration::from_secs(5))));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    // A 41st, with a request: refused at once (a 503, or a reset when the request
    // arrived before the close), not left hanging.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(b"GET /live HTTP/1.1\r\n\r\n").await;
    let (out, closed) = until_closed(s, Duration::from_millis(500)).await;
    assert!(closed.is_some(), "the 41st connection was left open");
    let out = String::from_utf8_lossy(&out);
    assert!(out.is_empty() || out.starts_with("HTTP/1.1 503"), "{out}");

    // The 8 over the cap were refused at once with a 503; the 32 within it were
    // closed with a 408 at the deadline (1 s), not before, and not much after.
    let mut refused = 0;
    for (i, task) in idle.into_iter().enumerate() {
        let (out, closed) = task.await.unwrap();
        let out = String::from_utf8_lossy(&out);
        let closed = closed.unwrap_or_else(|| panic!("idle connection {i} never closed"));
        if out.starts_with("HTTP/1.1 503") {
            refused += 1;
            assert!(closed < Duration::from_millis(500), "{i}: {closed:?}");
        } else {
            assert!(out.starts_with("HTTP/1.1 408"), "{i}: {out:?}");
            assert!(
                closed >= Duration::from_millis(800) && closed < Duration::from_millis(2500),
                "{i}: closed after {closed:?}"
            );
        }
    }
    assert_eq!(refused, 8);
    assert!(started.elapsed() < Duration::from_secs(4));

    // Slots freed: served again.
    assert_eq!(
        get(addr, "GET /live HTTP/1.1\r\n\r\n").await,
        (200, "live\n".into())
    );
    let _ = stop_tx.send(());
    server.await.unwrap();
}
