//! Black-box tests of the socket server (§11, §11a, §12, §16) through the fixture of
//! `support/server.rs`: a real Unix socket, the server in-process, a raw client.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{
    BreakerState, ClientFrame, ErrorKind, Outcome, Reply, Request, PROTOCOL_VERSION,
};
use polygate::server::MAX_IN_FLIGHT;
use support::server::*;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

#[tokio::test]
async fn handshake_welcome_and_version_mismatch() {
    let server = Server::start().await;

    let mut c = Client::raw(&server.path).await;
    c.send(7, hello(PROTOCOL_VERSION)).await;
    let f = c.recv().await;
    assert_eq!(f.id, 7);
    assert_eq!(
        f.reply,
        Reply::Welcome {
            protocol_version: PROTOCOL_VERSION,
            sidecar_version: env!("CARGO_PKG_VERSION").into(),
            max_frame: MAX_FRAME,
        }
    );

    let mut old = Client::raw(&server.path).await;
    old.send(1, hello(PROTOCOL_VERSION + 98)).await;
    let e = error_frame(old.recv().await, 1, ErrorKind::ProtocolViolation);
    assert!(
        e.message.contains(&(PROTOCOL_VERSION + 98).to_string()),
        "{e:?}"
    );
    old.expect_closed().await;

    // The first frame must be Hello.
    let mut rude = Client::raw(&server.path).await;
    rude.send(3, Request::Ping).await;
    let e = error_frame(rude.recv().await, 3, ErrorKind::ProtocolViolation);
    assert!(e.message.contains("Hello"), "{e:?}");
    rude.expect_closed().await;

    // A second Hello is a violation too.
    let mut twice = server.client().await;
    twice.send(4, hello(PROTOCOL_VERSION)).await;
    error_frame(twice.recv().await, 4, ErrorKind::ProtocolViolation);
    twice.expect_closed().await;

    // None of that disturbed the first connection.
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn ping_pong() {
    let (server, mut c) = Server::with_client().await;
    for _ in 0..3 {
        assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn unknown_scope_and_unknown_permit_are_named() {
    let (server, mut c) = Server::with_client().await;

    let e = error_of(
        c.call(Request::BeginCall {
            scope: "no-such-scope".into(),
            est_tokens: None,
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnknownScope);
    assert!(e.message.contains("no-such-scope"), "{e:?}");

    let e = error_of(
        c.call(Request::Report {
            permit: 424242,
            outcome: Outcome::Cancelled,
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnknownPermit);
    assert!(e.message.contains("424242"), "{e:?}");

    let e = error_of(c.call(Request::Acquire { call: 777 }).await);
    assert_eq!(e.kind, ErrorKind::UnknownCall);
    assert!(e.message.contains("777"), "{e:?}");

    // Bad outcome arguments are refused before they reach the engine.
    let e = error_of(
        c.call(Request::Report {
            permit: 1,
            outcome: Outcome::RateLimited {
                retry_after_s: Some(f64::NAN),
            },
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("retry_after_s"), "{e:?}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn success_flow() {
    let (server, mut c) = Server::with_client().await;

    let call = c.begin("chat").await;
    let permit = match c.call(Request::Acquire { call }).await {
        Reply::Granted {
            permit,
            source,
            is_probe,
            attempt,
            ..
        } => {
            assert_eq!(source, "a", "priority order picks the first source");
            assert!(!is_probe);
            assert_eq!(attempt, 1);
            permit
        }
        other => panic!("expected Granted, got {other:?}"),
    };
    let report = c.status().await;
    let chat = report.scopes.iter().find(|s| s.name == "chat").unwrap();
    assert_eq!(chat.calls, 1);
    assert_eq!(chat.sources[0].in_flight, 1);
    assert_eq!(report.backend, "memory");

    let r = c
        .call(Request::Report {
            permit,
            outcome: Outcome::Success {
                tokens: Some(12),
                count_attempt: true,
            },
        })
        .await;
    assert_eq!(
        r,
        Reply::Reported {
            applied: true,
            state: BreakerState::Closed,
            retry_after_s: 0.0
        }
    );
    assert_eq!(c.call(Request::EndCall { call }).await, Reply::Ok);

    let a = c.source("a").await;
    assert_eq!(a.in_flight, 0);
    assert_eq!(a.window_successes, 1);
    let report = c.status().await;
    assert_eq!(report.scopes[0].calls, 0);

    // The permit is gone once reported.
    let e = error_of(
        c.call(Request::Report {
            permit,
            outcome: Outcome::Cancelled,
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnknownPermit);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn concurrent_requests_are_multiplexed_by_id() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("s1", 60.0).await;

    // A waiting Acquire must not hold up anything else on the connection.
    let call = c.begin("slow").await;
    c.send(1, Request::Acquire { call }).await;

    let n = 60u64;
    for i in 0..n {
        let id = 100 + i;
        let request = match i % 3 {
            0 => Request::Ping,
            1 => Request::BeginCall {
                scope: "chat".into(),
                est_tokens: Some(i),
            },
            _ => Request::Status,
        };
        c.send(id, request).await;
    }
    // A duplicate of an in-flight id is refused (the Acquire still waits).
    c.send(1, Request::Ping).await;

    let mut seen = std::collections::HashSet::new();
    let mut duplicate_refused = false;
    for _ in 0..=n {
        let f = c.recv().await;
        if f.id == 1 {
            let e = error_of(f.reply);
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(e.message.contains("already in flight"), "{e:?}");
            duplicate_refused = true;
            continue;
        }
        let i = f.id - 100;
        match (i % 3, &f.reply) {
            (0, Reply::Pong) | (1, Reply::CallBegun { .. }) | (2, Reply::Status(_)) => {}
            _ => panic!("reply {:?} does not match request {}", f.reply, f.id),
        }
        assert!(seen.insert(f.id), "two replies for {}", f.id);
    }
    assert!(duplicate_refused);
    assert_eq!(seen.len() as u64, n);

    // The Acquire was waiting all along.
    let report = c.status().await;
    let slow = report.scopes.iter().find(|s| s.name == "slow").unwrap();
    assert_eq!(slow.waiters, 1);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn cancel_ends_a_waiting_acquire_and_leaves_nothing_in_flight() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("s1", 60.0).await;

    let call = c.begin("slow").await;
    c.send(10, Request::Acquire { call }).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    c.send(11, Request::Cancel { target: 10 }).await;

    let f = c.recv().await;
    let e = error_frame(f, 10, ErrorKind::Cancelled);
    assert!(e.message.contains("10"), "{e:?}");
    let f = c.recv().await;
    assert_eq!((f.id, f.reply), (11, Reply::Ok));

    // Cancelling something no longer pending is still Ok.
    c.send(12, Request::Cancel { target: 10 }).await;
    let f = c.recv().await;
    assert_eq!((f.id, f.reply), (12, Reply::Ok));

    eventually(&mut c, "s1", |s| s.in_flight == 0).await;
    let report = c.status().await;
    let slow = report.scopes.iter().find(|s| s.name == "slow").unwrap();
    assert_eq!(slow.waiters, 0, "{slow:?}");
    server.assert_nothing_held(false);

    // The call is usable again: once the source is closed it gets a permit.
    assert_eq!(
        c.call(Request::ForceClose {
            source: "s1".into()
        })
        .await,
        Reply::Ok
    );
    match c.call(Request::Acquire { call }).await {
        Reply::Granted { source, .. } => assert_eq!(source, "s1"),
        other => panic!("expected Granted, got {other:?}"),
    }
    assert_eq!(c.call(Request::EndCall { call }).await, Reply::Ok);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn garbage_frame_closes_only_its_connection() {
    let server = Server::start().await;
    let mut good = server.client().await;

    // Too short to even hold an id.
    let mut bad = server.client().await;
    bad.framed
        .get_mut()
        .write_all(&[0, 0, 0, 3, 1, 2, 3])
        .await
        .unwrap();
    let e = error_frame(bad.recv().await, 0, ErrorKind::Malformed);
    assert!(!e.message.is_empty());
    bad.expect_closed().await;

    // An id, then a request tag that does not exist: the error carries the id.
    let mut bad = server.client().await;
    let mut frame = 12u32.to_be_bytes().to_vec();
    frame.extend_from_slice(&77u64.to_le_bytes());
    frame.extend_from_slice(&99u32.to_le_bytes());
    bad.framed.get_mut().write_all(&frame).await.unwrap();
    error_frame(bad.recv().await, 77, ErrorKind::Malformed);
    bad.expect_closed().await;

    assert_eq!(good.call(Request::Ping).await, Reply::Pong);
    let mut fresh = server.client().await;
    assert_eq!(fresh.call(Request::Ping).await, Reply::Pong);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn oversize_frame_closes_only_its_connection() {
    let server = Server::start().await;
    let mut good = server.client().await;
    let mut bad = server.client().await;
    // Only the length prefix: the server must refuse before reading the payload.
    bad.framed
        .get_mut()
        .write_all(&(MAX_FRAME + 1).to_be_bytes())
        .await
        .unwrap();
    let e = error_frame(bad.recv().await, 0, ErrorKind::FrameTooLarge);
    assert!(e.message.contains(&MAX_FRAME.to_string()), "{e:?}");
    bad.expect_closed().await;

    // Also before the handshake.
    let mut early = Client::raw(&server.path).await;
    early
        .framed
        .get_mut()
        .write_all(&u32::MAX.to_be_bytes())
        .await
        .unwrap();
    error_frame(early.recv().await, 0, ErrorKind::FrameTooLarge);
    early.expect_closed().await;

    assert_eq!(good.call(Request::Ping).await, Reply::Pong);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn dropped_connection_releases_its_permit() {
    let server = Server::start().await;
    let mut watcher = server.client().await;
    let mut worker = server.client().await;

    let call = worker.begin("chat").await;
    match worker.call(Request::Acquire { call }).await {
        Reply::Granted { source, .. } => assert_eq!(source, "a"),
        other => panic!("expected Granted, got {other:?}"),
    }
    assert_eq!(watcher.source("a").await.in_flight, 1);
    assert_eq!(watcher.status().await.scopes[0].calls, 1);

    drop(worker);
    eventually(&mut watcher, "a", |s| s.in_flight == 0).await;
    assert_eq!(watcher.status().await.scopes[0].calls, 0);
    server.assert_nothing_held(true);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_a_waiting_acquire_with_shutting_down() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("s1", 60.0).await;
    let call = c.begin("slow").await;
    c.send(5, Request::Acquire { call }).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let path = server.path.clone();
    let started = tokio::time::Instant::now();
    let stopping = tokio::spawn(server.shutdown());

    let e = error_frame(c.recv().await, 5, ErrorKind::ShuttingDown);
    assert!(!e.message.is_empty());
    // Nothing left to drain on this connection: it closes without waiting for the grace.
    c.expect_closed().await;
    stopping.await.unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "idle connections should not hold shutdown for the whole grace"
    );
    // No longer accepting.
    assert!(UnixStream::connect(&path).await.is_err());
}

#[tokio::test]
async fn shutdown_drops_connections_after_the_grace() {
    let (server, mut c) = Server::with_client().await;
    let call = c.begin("chat").await;
    // Holding an unreported permit keeps the connection open while draining.
    assert!(matches!(
        c.call(Request::Acquire { call }).await,
        Reply::Granted { .. }
    ));
    let started = tokio::time::Instant::now();
    let stopping = tokio::spawn(server.shutdown());
    c.expect_closed().await;
    stopping.await.unwrap().unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(4),
        "grace is 2s, took {took:?}"
    );
}

#[tokio::test]
async fn admin_requests_need_an_admin_uid() {
    let server = Setup::new()
        .sidecar(&format!("admin_uids = [{}]", other_uid()))
        .start()
        .await;
    let mut c = server.client().await;
    for request in [
        Request::ForceOpen {
            source: "a".into(),
            seconds: 5.0,
        },
        Request::ForceClose { source: "a".into() },
        Request::Reset { source: "a".into() },
    ] {
        let e = error_of(c.call(request).await);
        assert_eq!(e.kind, ErrorKind::PermissionDenied);
        assert!(e.message.contains(&my_uid().to_string()), "{e:?}");
    }
    // Nothing changed.
    assert_eq!(c.source("a").await.state, BreakerState::Closed);
    // Non-admin requests still work.
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn admin_arguments_are_validated() {
    let (server, mut c) = Server::with_client().await;
    for seconds in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = error_of(
            c.call(Request::ForceOpen {
                source: "a".into(),
                seconds,
            })
            .await,
        );
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "seconds = {seconds}");
        assert!(e.message.contains("seconds"), "{e:?}");
    }
    let e = error_of(
        c.call(Request::Reset {
            source: "zzz".into(),
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("zzz"), "{e:?}");

    c.force_open("a", 30.0).await;
    let a = c.source("a").await;
    assert_eq!(a.state, BreakerState::Open);
    assert!(a.retry_after_s > 29.0 && a.retry_after_s <= 30.0, "{a:?}");
    // Fail-fast scope with `a` open: the call goes to `b`.
    let call = c.begin("chat").await;
    match c.call(Request::Acquire { call }).await {
        Reply::Granted { source, .. } => assert_eq!(source, "b"),
        other => panic!("expected Granted, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn peers_outside_the_allowed_lists_are_refused() {
    let server = Setup::new()
        .sidecar(&format!(
            "allowed_uids = [{}]\nadmin_uids = [{}]",
            other_uid(),
            other_uid()
        ))
        .start()
        .await;
    let mut c = Client::raw(&server.path).await;
    let e = error_frame(c.recv().await, 0, ErrorKind::PermissionDenied);
    assert!(e.message.contains(&my_uid().to_string()), "{e:?}");
    c.expect_closed().await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_silent_client_is_closed_after_the_handshake_timeout() {
    let server = Setup::new()
        .sidecar("")
        .options(|o| o.handshake_timeout = Duration::from_millis(200))
        .start()
        .await;
    let mut c = Client::raw(&server.path).await;
    let e = error_frame(c.recv().await, 0, ErrorKind::ProtocolViolation);
    assert!(e.message.contains("Hello"), "{e:?}");
    c.expect_closed().await;
    server.shutdown().await.unwrap();
}

/// Send `Status` requests on `c` in batches, without reading, until the server has
/// `more` requests in flight beyond `base` (their replies cannot be queued: the
/// connection's reply queue is full). Returns the next unused id.
async fn fill_reply_queue(server: &Server, c: &mut Client, mut id: u64, base: usize) -> u64 {
    let more = 20;
    for _ in 0..200 {
        for _ in 0..50 {
            c.framed
                .feed(ClientFrame {
                    id,
                    request: Request::Status,
                })
                .await
                .unwrap();
            id += 1;
        }
        c.framed.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        if server.stats.in_flight() >= base + more {
            return id;
        }
    }
    panic!(
        "the reply queue never filled up: {} in flight",
        server.stats.in_flight()
    );
}

#[tokio::test]
async fn a_client_that_does_not_read_is_held_at_the_in_flight_cap() {
    let server = Server::start().await;
    let c = server.client().await;
    let (mut sink, mut stream) = c.framed.split();
    // Status replies are a few hundred bytes: 5000 of them are far more than the
    // socket buffer and the reply queue hold. Sent from a task: once the server stops
    // reading, this connection's socket fills up and the sends block.
    let n = 5000u64;
    let sender = tokio::spawn(async move {
        for id in 1..=n {
            sink.feed(ClientFrame {
                id,
                request: Request::Status,
            })
            .await
            .unwrap();
        }
        sink.flush().await.unwrap();
        sink
    });

    // The connection reaches the cap and stays there.
    server
        .in_flight_until("the cap", |k| k == MAX_IN_FLIGHT)
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.stats.in_flight(), MAX_IN_FLIGHT);
    assert_eq!(server.stats.peak_in_flight(), MAX_IN_FLIGHT);

    // Other connections are unaffected.
    let mut other = server.client().await;
    assert_eq!(other.call(Request::Ping).await, Reply::Pong);
    assert!(!other.status().await.scopes.is_empty());

    // Reading drains everything, each reply exactly once.
    let mut seen = HashSet::new();
    for _ in 0..n {
        let f = tokio::time::timeout(REPLY_TIMEOUT, stream.next())
            .await
            .expect("reply")
            .expect("open")
            .expect("frame");
        assert!(matches!(f.reply, Reply::Status(_)), "{f:?}");
        assert!(seen.insert(f.id), "two replies for {}", f.id);
    }
    assert_eq!(seen.len() as u64, n);
    let sink = sender.await.unwrap();
    let mut c = Client {
        framed: sink.reunite(stream).unwrap(),
        next_id: n + 1,
    };
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    server.in_flight_until("0", |k| k == 0).await;
    assert!(server.stats.peak_in_flight() <= MAX_IN_FLIGHT);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn waiting_acquires_do_not_hold_in_flight_slots() {
    waiting_acquires_do_not_hold_slots(false).await;
}

#[tokio::test]
async fn waiting_acquires_do_not_hold_in_flight_slots_on_a_remote_backend() {
    waiting_acquires_do_not_hold_slots(true).await;
}

async fn waiting_acquires_do_not_hold_slots(remote: bool) {
    // A cap of 4, and 10 Acquires waiting: the connection must still read the
    // requests that would end the waits.
    let server = Setup::new()
        .remote(remote, Duration::ZERO)
        .options(|o| o.max_in_flight = 4)
        .start()
        .await;
    let mut c = server.client().await;
    c.force_open("s1", 60.0).await;
    let mut calls = Vec::new();
    for _ in 0..10 {
        calls.push(c.begin("slow").await);
    }
    for (i, &call) in calls.iter().enumerate() {
        c.send(1 + i as u64, Request::Acquire { call }).await;
    }
    let deadline = tokio::time::Instant::now() + REPLY_TIMEOUT;
    loop {
        let report = c.status().await;
        let slow = report.scopes.iter().find(|s| s.name == "slow").unwrap();
        if slow.waiters == 10 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{slow:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);

    // Closing the source ends the waits; every Acquire answers.
    c.send(
        50,
        Request::ForceClose {
            source: "s1".into(),
        },
    )
    .await;
    // The pacer admits 8 at a time: report each grant as it comes so the rest follow.
    let (mut granted, mut reported, mut closed) = (0, 0, false);
    while granted < 10 || reported < 10 || !closed {
        let f = c.recv().await;
        match f.reply {
            Reply::Ok if f.id == 50 => closed = true,
            Reply::Granted { permit, .. } => {
                assert!((1..=10).contains(&f.id), "{f:?}");
                granted += 1;
                c.send(
                    100 + f.id,
                    Request::Report {
                        permit,
                        outcome: Outcome::Cancelled,
                    },
                )
                .await;
            }
            Reply::Reported { .. } => reported += 1,
            other => panic!("expected Granted or Reported, got {other:?}"),
        }
    }
    assert!(server.stats.peak_in_flight() <= 4);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn pipelined_failing_acquires_on_a_remote_backend_are_held_at_the_cap() {
    // On a remote backend every Acquire waits for its admission round trip, so it
    // gives its slot back at once; the slot must be taken again before its reply is
    // queued, or a client that pipelines Acquires without reading is never held.
    const CAP: usize = 4;
    let server = Setup::new()
        .remote(true, Duration::ZERO)
        .options(|o| o.max_in_flight = CAP)
        .start()
        .await;
    let mut c = server.client().await;
    // Both sources HALF_OPEN with their probes out: every Acquire of `chat` makes
    // a backend round trip and fails fast with CircuitOpen.
    c.force_open("a", 0.1).await;
    c.force_open("b", 0.1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut probes = Vec::new();
    for _ in 0..2 {
        let call = c.begin("chat").await;
        probes.push(c.acquire(call).await);
    }
    let call = c.begin("chat").await;
    let e = error_of(c.call(Request::Acquire { call }).await);
    assert_eq!(e.kind, ErrorKind::CircuitOpen, "{e:?}");
    // Many calls, used in turn, so that an Acquire's call has (almost always)
    // finished its previous Acquire: its reply is CircuitOpen, not Busy (a Busy
    // reply is ready at once and keeps its slot: enough of them would hold the
    // connection at the cap even without the fix).
    let mut calls = vec![call];
    for _ in 0..4095 {
        calls.push(c.begin("chat").await);
    }

    let (mut sink, mut stream) = c.framed.split();
    // Far more than the socket buffers and the reply queue hold, either way.
    let n = 40_000u64;
    let sender = tokio::spawn({
        let calls = calls.clone();
        async move {
            for id in 1..=n {
                let call = calls[id as usize % calls.len()];
                sink.feed(ClientFrame {
                    id,
                    request: Request::Acquire { call },
                })
                .await
                .unwrap();
            }
            sink.flush().await.unwrap();
            sink
        }
    });

    // The connection reaches the cap and stays there: the server stopped reading.
    server.in_flight_until("the cap", |k| k == CAP).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.stats.in_flight(), CAP);
    assert!(
        !sender.is_finished(),
        "every frame was read although the client reads no reply"
    );
    assert!(server.stats.peak_in_flight() <= CAP);
    // What the daemon holds for it is bounded: a few tasks, not one per frame read.
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    assert!(alive < 200, "{alive} tasks alive");

    // Reading drains everything, each reply exactly once.
    let mut seen = HashSet::new();
    let mut circuit_open = 0;
    for _ in 0..n {
        let f = tokio::time::timeout(REPLY_TIMEOUT, stream.next())
            .await
            .expect("reply")
            .expect("open")
            .expect("frame");
        let e = error_of(f.reply);
        match e.kind {
            ErrorKind::CircuitOpen => circuit_open += 1,
            ErrorKind::Busy => {}
            _ => panic!("expected CircuitOpen or Busy, got {e:?}"),
        }
        assert!(seen.insert(f.id), "two replies for {}", f.id);
    }
    assert_eq!(seen.len() as u64, n);
    assert!(circuit_open > 0);
    let sink = sender.await.unwrap();
    let mut c = Client {
        framed: sink.reunite(stream).unwrap(),
        next_id: n + 1,
    };
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    server.in_flight_until("0", |k| k == 0).await;
    assert!(server.stats.peak_in_flight() <= CAP);
    for permit in probes {
        let r = c
            .call(Request::Report {
                permit,
                outcome: Outcome::Cancelled,
            })
            .await;
        assert!(matches!(r, Reply::Reported { .. }), "{r:?}");
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_completes_when_clients_fill_their_reply_queues() {
    let server = Server::start().await;
    let engine = server.engine.clone();

    // `c` holds a permit, then stops reading; its reader is stuck queuing the reply
    // to a Cancel.
    let mut c = server.client().await;
    let call = c.begin("chat").await;
    c.acquire(call).await;
    fill_reply_queue(&server, &mut c, 10_000, 0).await;
    c.send(1, Request::Cancel { target: 77 }).await;

    // `d` has an Acquire waiting, then stops reading; its reader is stuck queuing the
    // refusal of a duplicate id.
    let mut d = server.client().await;
    d.force_open("s1", 60.0).await;
    let call = d.begin("slow").await;
    d.send(7, Request::Acquire { call }).await;
    let base = server.stats.in_flight();
    fill_reply_queue(&server, &mut d, 10_000, base).await;
    d.send(7, Request::Ping).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let started = tokio::time::Instant::now();
    server.shutdown().await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(2000 + 1000),
        "grace is 2s, shutdown took {took:?}"
    );
    let live = engine.live_counts();
    assert_eq!(live.permits, 0, "{live:?}");
    assert_eq!(live.calls, 0, "{live:?}");
    assert_eq!(live.pacer_in_flight, 0, "{live:?}");
    drop((c, d));
}

#[tokio::test]
async fn admin_errors_without_a_scope_carry_none() {
    let (server, mut c) = Server::with_client().await;
    server.backend_down(true);
    for request in [
        Request::ForceOpen {
            source: "a".into(),
            seconds: 5.0,
        },
        Request::ForceClose { source: "a".into() },
        Request::Reset { source: "a".into() },
    ] {
        let e = error_of(c.call(request).await);
        assert_eq!(e.kind, ErrorKind::BackendUnavailable, "{e:?}");
        assert_eq!(e.scope, None, "{e:?}");
    }
    // Scope-level errors still name their scope.
    let e = error_of(
        c.call(Request::BeginCall {
            scope: "nope".into(),
            est_tokens: None,
        })
        .await,
    );
    assert_eq!(e.scope.as_deref(), Some("nope"));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_refused_force_close_keeps_this_hosts_memo() {
    // The memo may only forget a cooldown the backend really ended.
    let (server, mut c) = Server::with_client().await;
    let r = c
        .call(Request::ForceOpen {
            source: "a".into(),
            seconds: 60.0,
        })
        .await;
    assert!(!matches!(r, Reply::Error(_)), "{r:?}");
    assert!(c.source("a").await.memo_remaining_s > 59.0);
    server.backend_down(true);
    for request in [
        Request::ForceClose { source: "a".into() },
        Request::Reset { source: "a".into() },
    ] {
        let e = error_of(c.call(request).await);
        assert_eq!(e.kind, ErrorKind::BackendUnavailable, "{e:?}");
    }
    server.backend_down(false);
    assert!(
        c.source("a").await.memo_remaining_s > 59.0,
        "a refused close/reset must not clear the memo"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_report_the_backend_failed_does_not_hold_up_the_drain() {
    let (server, mut c) = Server::with_client().await;
    let call = c.begin("chat").await;
    let permit = c.acquire(call).await;
    server.backend_down(true);
    let e = error_of(
        c.call(Request::Report {
            permit,
            outcome: Outcome::Success {
                tokens: Some(5),
                count_attempt: true,
            },
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::BackendUnavailable, "{e:?}");
    assert_eq!(e.scope.as_deref(), Some("chat"), "{e:?}");
    server.assert_nothing_held(false);

    // The connection holds nothing: shutdown does not wait out the 2 s grace for it.
    let started = tokio::time::Instant::now();
    let stopping = tokio::spawn(server.shutdown());
    c.expect_closed().await;
    stopping.await.unwrap().unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[tokio::test]
async fn absurd_token_counts_are_refused() {
    let (server, mut c) = Server::with_client().await;
    let limit = 1_000_000_000u64;

    let e = error_of(
        c.call(Request::BeginCall {
            scope: "chat".into(),
            est_tokens: Some(limit + 1),
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e:?}");
    assert!(
        e.message.contains("est_tokens") && e.message.contains(&limit.to_string()),
        "{e:?}"
    );
    assert_eq!(c.status().await.scopes[0].calls, 0);

    // The limit itself is accepted.
    let call = match c
        .call(Request::BeginCall {
            scope: "chat".into(),
            est_tokens: Some(limit),
        })
        .await
    {
        Reply::CallBegun { call } => call,
        other => panic!("expected CallBegun, got {other:?}"),
    };
    assert_eq!(c.call(Request::EndCall { call }).await, Reply::Ok);

    let call = c.begin("chat").await;
    let permit = c.acquire(call).await;
    let e = error_of(
        c.call(Request::Report {
            permit,
            outcome: Outcome::Success {
                tokens: Some(u64::MAX),
                count_attempt: true,
            },
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e:?}");
    assert!(
        e.message.starts_with("tokens must be at most") && e.message.contains(&limit.to_string()),
        "{e:?}"
    );
    // Refused before the engine: the permit is still there to be reported properly.
    let r = c
        .call(Request::Report {
            permit,
            outcome: Outcome::Success {
                tokens: Some(limit),
                count_attempt: true,
            },
        })
        .await;
    assert!(matches!(r, Reply::Reported { applied: true, .. }), "{r:?}");
    server.shutdown().await.unwrap();
}

// ---- protocol version 2 (DESIGN §11a): Start / Retry / Finish / Begin / StatusJson ----

#[tokio::test]
async fn every_protocol_version_is_accepted_and_welcomed_as_sent() {
    let server = Server::start().await;
    for v in [1, 2, 3] {
        let mut c = Client::raw(&server.path).await;
        c.send(1, hello(v)).await;
        match c.recv().await.reply {
            Reply::Welcome {
                protocol_version, ..
            } => assert_eq!(protocol_version, v),
            other => panic!("expected Welcome, got {other:?}"),
        }
    }
    let mut future = Client::raw(&server.path).await;
    future.send(1, hello(4)).await;
    let e = error_frame(future.recv().await, 1, ErrorKind::ProtocolViolation);
    assert!(e.message.contains("1 to 3"), "{e:?}");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn version_2_requests_are_refused_on_a_version_1_connection() {
    let server = Server::start().await;
    let mut c = Client::raw(&server.path).await;
    c.send(1, hello(1)).await;
    c.recv().await;
    for request in [
        Request::Start(spec("chat")),
        Request::StatusJson,
        Request::Report {
            permit: 1,
            outcome: Outcome::SuccessUsage {
                usage: ipc_protocol::Usage::default(),
                count_attempt: true,
            },
        },
    ] {
        let e = error_of(c.call(request).await);
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e:?}");
        assert!(e.message.contains("needs protocol version 2"), "{e:?}");
    }
    // The connection stays usable and nothing was created.
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    server.assert_nothing_held(true);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn start_then_finish_is_a_whole_call_in_two_round_trips() {
    let (server, mut c) = Server::with_client().await;
    let mut s = spec("chat");
    s.est_tokens = Some(321);
    let reply = c.call(Request::Start(s)).await;
    let Reply::Started { est_tokens, .. } = &reply else {
        panic!("expected Started, got {reply:?}")
    };
    assert_eq!(*est_tokens, 321);
    let (call, permit, source, attempt) = started(reply);
    assert_eq!((source.as_str(), attempt), ("a", 1));
    assert_eq!(server.engine.live_counts().calls, 1);
    match c
        .call(Request::Finish {
            permit,
            outcome: success(Some(300)),
        })
        .await
    {
        Reply::Reported { applied, state, .. } => {
            assert!(applied);
            assert_eq!(state, BreakerState::Closed);
        }
        other => panic!("expected Reported, got {other:?}"),
    }
    // The call is gone: nothing to end, nothing held.
    server.assert_nothing_held(true);
    let e = error_of(c.call(Request::EndCall { call }).await);
    assert_eq!(e.kind, ErrorKind::UnknownCall);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn retry_reports_and_fails_over_in_one_round_trip() {
    let (server, mut c) = Server::with_client().await;
    let (call, permit, source, _) = started(c.call(Request::Start(spec("chat"))).await);
    assert_eq!(source, "a");
    // The timeout is applied and the next permit is on b (call-local demotion).
    let permit2 = match c
        .call(Request::Retry {
            permit,
            outcome: timeout(),
        })
        .await
    {
        Reply::Granted {
            permit,
            source,
            attempt,
            ..
        } => {
            assert_eq!((source.as_str(), attempt), ("b", 2));
            permit
        }
        other => panic!("expected Granted, got {other:?}"),
    };
    assert_eq!(
        c.source("a").await.streak,
        1,
        "the timeout reached a's breaker"
    );
    // The old permit is spent.
    let e = error_of(
        c.call(Request::Retry {
            permit,
            outcome: timeout(),
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnknownPermit);
    assert!(matches!(
        c.call(Request::Finish {
            permit: permit2,
            outcome: success(None),
        })
        .await,
        Reply::Reported { applied: true, .. }
    ));
    server.assert_nothing_held(true);
    let e = error_of(c.call(Request::EndCall { call }).await);
    assert_eq!(e.kind, ErrorKind::UnknownCall);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn invalid_retry_or_finish_changes_nothing() {
    let (server, mut c) = Server::with_client().await;
    let (_, permit, _, _) = started(c.call(Request::Start(spec("chat"))).await);
    for request in [
        Request::Retry {
            permit,
            outcome: success(Some(u64::MAX)),
        },
        Request::Finish {
            permit,
            outcome: Outcome::RateLimited {
                retry_after_s: Some(f64::NAN),
            },
        },
        Request::Finish {
            permit,
            outcome: Outcome::FailureUsage {
                kind: ipc_protocol::FailureKind::BadResult,
                usage: ipc_protocol::Usage {
                    tokens: None,
                    input_tokens: Some(2_000_000_000),
                    output_tokens: None,
                },
            },
        },
    ] {
        let e = error_of(c.call(request).await);
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e:?}");
    }
    let e = error_of(
        c.call(Request::Finish {
            permit: permit ^ 1,
            outcome: success(None),
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnknownPermit);
    // The permit is still ours and still counts.
    assert_eq!(server.engine.live_counts().permits, 1);
    assert!(matches!(
        c.call(Request::Finish {
            permit,
            outcome: success(None),
        })
        .await,
        Reply::Reported { .. }
    ));
    server.assert_nothing_held(true);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_start_or_retry_that_ends_in_an_error_leaves_no_call() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("a", 60.0).await;
    c.force_open("b", 60.0).await;
    let e = error_of(c.call(Request::Start(spec("chat"))).await);
    assert_eq!(e.kind, ErrorKind::CircuitOpen, "{e:?}");
    assert_eq!(e.scope.as_deref(), Some("chat"));
    assert!(e.retry_after_s > 50.0, "{e:?}");
    server.assert_nothing_held(true);

    for s in ["a", "b"] {
        let r = c.call(Request::ForceClose { source: s.into() }).await;
        assert_eq!(r, Reply::Ok);
    }
    let (call, permit, _, _) = started(c.call(Request::Start(spec("chat"))).await);
    c.force_open("a", 60.0).await;
    c.force_open("b", 60.0).await;
    let e = error_of(
        c.call(Request::Retry {
            permit,
            outcome: timeout(),
        })
        .await,
    );
    assert_eq!(e.kind, ErrorKind::CircuitOpen, "{e:?}");
    server.assert_nothing_held(true);
    let e = error_of(c.call(Request::EndCall { call }).await);
    assert_eq!(e.kind, ErrorKind::UnknownCall);

    // An unknown scope, a priority while no classes exist: refused, no call.
    let e = error_of(c.call(Request::Start(spec("nope"))).await);
    assert_eq!(e.kind, ErrorKind::UnknownScope);
    let mut s = spec("chat");
    s.priority = Some("interactive".into());
    let e = error_of(c.call(Request::Start(s)).await);
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(
        e.message.contains("\"chat\"") && e.message.contains("priority"),
        "{e:?}"
    );
    server.assert_nothing_held(true);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn cancelling_a_waiting_start_leaves_nothing_behind() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("s1", 600.0).await;
    c.send(10, Request::Start(spec("slow"))).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.engine.live_counts().calls, 1);
    c.send(11, Request::Cancel { target: 10 }).await;
    let mut ids = vec![];
    for _ in 0..2 {
        let f = c.recv().await;
        if f.id == 10 {
            assert_eq!(error_of(f.reply).kind, ErrorKind::Cancelled);
        } else {
            assert_eq!(f.reply, Reply::Ok);
        }
        ids.push(f.id);
    }
    ids.sort();
    assert_eq!(ids, vec![10, 11]);
    nothing_held_eventually(&server).await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn cancelling_a_waiting_retry_ends_its_call() {
    let (server, mut c) = Server::with_client().await;
    let (_, permit, _, _) = started(c.call(Request::Start(spec("slow"))).await);
    c.force_open("s1", 600.0).await;
    c.send(
        20,
        Request::Retry {
            permit,
            outcome: timeout(),
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let live = server.engine.live_counts();
    assert_eq!((live.calls, live.permits), (1, 0), "{live:?}");
    c.send(21, Request::Cancel { target: 20 }).await;
    for _ in 0..2 {
        let f = c.recv().await;
        match f.id {
            20 => assert_eq!(error_of(f.reply).kind, ErrorKind::Cancelled),
            21 => assert_eq!(f.reply, Reply::Ok),
            other => panic!("unexpected reply id {other}"),
        }
    }
    nothing_held_eventually(&server).await;
    // The connection stays fine.
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn begin_and_split_estimates_and_usage_totals() {
    let (server, mut c) = Server::with_client().await;
    let mut s = spec("chat");
    s.est_input_tokens = Some(900);
    s.est_output_tokens = Some(300);
    let call = match c.call(Request::Begin(s.clone())).await {
        Reply::CallBegun { call } => call,
        other => panic!("expected CallBegun, got {other:?}"),
    };
    match c.call(Request::Acquire { call }).await {
        Reply::Granted { est_tokens, .. } => assert_eq!(est_tokens, 1200),
        other => panic!("expected Granted, got {other:?}"),
    }
    assert_eq!(c.call(Request::EndCall { call }).await, Reply::Ok);
    // An explicit total wins over the split.
    s.est_tokens = Some(50);
    let reply = c.call(Request::Start(s)).await;
    let Reply::Started {
        est_tokens, permit, ..
    } = reply
    else {
        panic!("expected Started, got {reply:?}")
    };
    assert_eq!(est_tokens, 50);
    let r = c
        .call(Request::Finish {
            permit,
            outcome: Outcome::SuccessUsage {
                usage: ipc_protocol::Usage {
                    tokens: None,
                    input_tokens: Some(40),
                    output_tokens: Some(2),
                },
                count_attempt: true,
            },
        })
        .await;
    assert!(matches!(r, Reply::Reported { applied: true, .. }), "{r:?}");
    let mut s = spec("chat");
    s.est_output_tokens = Some(1_000_000_001);
    let e = error_of(c.call(Request::Begin(s)).await);
    assert!(e.message.contains("est_output_tokens"), "{e:?}");
    server.assert_nothing_held(true);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn status_json_names_every_scope_and_source() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("b", 30.0).await;
    let json = match c.call(Request::StatusJson).await {
        Reply::StatusJson(j) => j,
        other => panic!("expected StatusJson, got {other:?}"),
    };
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert_eq!(v["backend"], "memory");
    assert_eq!(v["protocol_version"], 3);
    let scopes = v["scopes"].as_array().unwrap();
    let names: Vec<&str> = scopes.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["chat", "slow"]);
    let chat = &scopes[0]["sources"];
    assert_eq!(chat[0]["name"], "a");
    assert_eq!(chat[0]["state"], "closed");
    assert_eq!(chat[1]["state"], "open");
    assert!(chat[1]["retry_after_s"].as_f64().unwrap() > 25.0, "{chat}");
    server.shutdown().await.unwrap();
}

// ---- the hot path (DESIGN §16): frames answered on the connection's own task ----

#[tokio::test]
async fn requests_are_answered_inline_while_another_waits() {
    let (server, mut c) = Server::with_client().await;
    c.force_open("s1", 60.0).await;
    let waiting = c.begin("slow").await;
    c.send(1, Request::Acquire { call: waiting }).await;
    // The wait does not hold up the connection: a whole call, a Ping and a status
    // are answered while it goes on.
    assert_eq!(c.call(Request::Ping).await, Reply::Pong);
    let (_, permit, source, _) = started(c.call(Request::Start(spec("chat"))).await);
    assert_eq!(source, "a");
    let r = c
        .call(Request::Finish {
            permit,
            outcome: success(None),
        })
        .await;
    assert!(matches!(r, Reply::Reported { applied: true, .. }), "{r:?}");
    let report = c.status().await;
    let slow = report.scopes.iter().find(|s| s.name == "slow").unwrap();
    assert_eq!(slow.waiters, 1, "{slow:?}");
    // Still waiting: the Cancel catches it.
    c.send(2, Request::Cancel { target: 1 }).await;
    let (mut cancelled, mut ok) = (false, false);
    while !(cancelled && ok) {
        let f = c.recv().await;
        match f.id {
            1 => cancelled = error_of(f.reply).kind == ErrorKind::Cancelled,
            2 => ok = f.reply == Reply::Ok,
            _ => panic!("unexpected {f:?}"),
        }
    }
    assert_eq!(c.call(Request::EndCall { call: waiting }).await, Reply::Ok);
    nothing_held_eventually(&server).await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_cancel_behind_an_inline_answer_finds_nothing_to_cancel() {
    let (server, mut c) = Server::with_client().await;
    let call = c.begin("chat").await;
    // One write: the Acquire is answered (granted at once) before the Cancel behind
    // it is even decoded, so its normal reply is the one the client gets, and the
    // permit is the client's.
    c.framed
        .feed(ClientFrame {
            id: 10,
            request: Request::Acquire { call },
        })
        .await
        .unwrap();
    c.framed
        .feed(ClientFrame {
            id: 11,
            request: Request::Cancel { target: 10 },
        })
        .await
        .unwrap();
    c.framed
        .feed(ClientFrame {
            id: 12,
            request: Request::Start(spec("chat")),
        })
        .await
        .unwrap();
    c.framed
        .feed(ClientFrame {
            id: 13,
            request: Request::Cancel { target: 12 },
        })
        .await
        .unwrap();
    c.framed.flush().await.unwrap();
    let (mut permit, mut started_permit) = (None, None);
    for _ in 0..4 {
        let f = c.recv().await;
        match (f.id, f.reply) {
            (10, Reply::Granted { permit: p, .. }) => permit = Some(p),
            (12, r @ Reply::Started { .. }) => started_permit = Some(started(r).1),
            (11 | 13, Reply::Ok) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    for p in [permit.expect("granted"), started_permit.expect("started")] {
        let r = c
            .call(Request::Report {
                permit: p,
                outcome: Outcome::Cancelled,
            })
            .await;
        assert!(matches!(r, Reply::Reported { .. }), "{r:?}");
    }
    assert_eq!(c.call(Request::EndCall { call }).await, Reply::Ok);
    assert_eq!(
        c.call(Request::Ping).await,
        Reply::Pong,
        "no reply left over"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn pipelined_frames_are_all_answered_and_batched() {
    let (server, mut c) = Server::with_client().await;
    // 400 Pings and 50 BeginCalls in one write: every one answered, by id; they are
    // answered from one read, so their replies wait together for one write.
    for id in 0..450u64 {
        let request = if id % 9 == 0 {
            Request::BeginCall {
                scope: "chat".into(),
                est_tokens: None,
            }
        } else {
            Request::Ping
        };
        c.framed
            .feed(ClientFrame {
                id: 1 + id,
                request,
            })
            .await
            .unwrap();
    }
    c.framed.flush().await.unwrap();
    let mut seen = HashSet::new();
    for _ in 0..450 {
        let f = c.recv().await;
        match (f.id - 1) % 9 {
            0 => assert!(matches!(f.reply, Reply::CallBegun { .. }), "{f:?}"),
            _ => assert_eq!(f.reply, Reply::Pong, "{f:?}"),
        }
        assert!(seen.insert(f.id), "two replies for {}", f.id);
    }
    assert!(
        server.stats.peak_in_flight() > 1,
        "replies were written one by one"
    );
    server.in_flight_until("0", |n| n == 0).await;
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn on_a_remote_backend_waiting_requests_run_in_tasks_and_others_pass_them() {
    let server = Setup::new()
        .remote(true, Duration::from_millis(100))
        .start()
        .await;
    let mut c = server.client().await;
    // The Start waits for its admission round trip; the Ping behind it is answered
    // first, on the connection's own task, and the Start's answer follows on its
    // own (nothing else wakes the connection meanwhile).
    c.send(1, Request::Start(spec("chat"))).await;
    c.send(2, Request::Ping).await;
    let first = c.recv().await;
    assert_eq!((first.id, first.reply), (2, Reply::Pong));
    let f = c.recv().await;
    assert_eq!(f.id, 1);
    let (_, permit, _, _) = started(f.reply);
    let r = c
        .call(Request::Finish {
            permit,
            outcome: success(Some(5)),
        })
        .await;
    assert!(matches!(r, Reply::Reported { applied: true, .. }), "{r:?}");
    assert!(
        server
            .engine
            .backend()
            .admits
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 1
    );
    nothing_held_eventually(&server).await;
    server.shutdown().await.unwrap();
}

/// PROTOCOL §7: an id may be reused once its reply arrived, even while a Retry
/// cancelled by token still runs its report: the new request gets its own answer
/// (found by review: it got the old Retry's, and its grant was refunded).
#[tokio::test]
async fn an_id_reused_after_a_cancelled_retry_gets_its_own_reply() {
    let server = Setup::new()
        .remote(true, Duration::from_millis(300))
        .start()
        .await;
    let mut c = server.client().await;
    let (_call, permit, _, _) = started(c.call(Request::Start(spec("chat"))).await);
    // The Retry's report takes a 300 ms round trip; cancel it meanwhile.
    c.send(
        10,
        Request::Retry {
            permit,
            outcome: timeout(),
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.send(11, Request::Cancel { target: 10 }).await;
    let mut got_cancelled = false;
    for _ in 0..2 {
        let f = c.recv().await;
        if f.id == 10 {
            assert_eq!(error_of(f.reply).kind, ErrorKind::Cancelled);
            got_cancelled = true;
        }
    }
    assert!(got_cancelled);
    // Request 10 was answered: the id may be reused (PROTOCOL.md §7).
    c.send(
        12,
        Request::BeginCall {
            scope: "chat".into(),
            est_tokens: None,
        },
    )
    .await;
    let call2 = match c.recv().await.reply {
        Reply::CallBegun { call } => call,
        other => panic!("{other:?}"),
    };
    c.send(10, Request::Acquire { call: call2 }).await;
    let f = c.recv().await;
    assert_eq!(f.id, 10);
    assert!(
        matches!(f.reply, Reply::Granted { .. }),
        "the new request 10 got {:?}",
        f.reply
    );
}
