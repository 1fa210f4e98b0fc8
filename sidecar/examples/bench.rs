//! PolyGate bench: prints figures and ratios; asserts nothing (speed goals live here,
//! not in timed tests that flake on a busy machine).
//!
//! ```sh
//! cargo run --release -p polygate-sidecar --example bench [-- --quick]
//! ```
//!
//! 1. in-process engine on the memory backend: begin → acquire → report → end, one task;
//! 2. the same from 64 concurrent tasks;
//! 3. thousands of waiters on OPEN sources (memo answers): CPU per waiter-second, and
//!    how fast a force_close lets every one of them through;
//! 4. the same call cycle over the real Unix socket (server + wire codec), pipelined;
//! 5. the cost the request-latency histogram adds to every request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{ClientCodec, ClientFrame, Outcome, Reply, Request, PROTOCOL_VERSION};
use polygate::backend::memory::MemoryBackend;
use polygate::backend::Outcome as EOutcome;
use polygate::clock::{Clock, TokioClock};
use polygate::config::parse_str;
use polygate::config::Config;
use polygate::engine::Engine;
use polygate::peer::AccessPolicy;
use polygate::server::{self, ServerOptions};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::Framed;

const CONFIG: &str = r#"
[scopes.chat]
circuit_open = "wait"
poll_interval = "50ms"
stall_window = "10m"
[scopes.chat.pacer]
initial = 100000
max = 100000
[[scopes.chat.sources]]
name = "a"
tpm = 1000000000
rpm = 1000000000
est_tokens = 10
[[scopes.chat.sources]]
name = "b"

[scopes.narrow]
quota_full = "wait"
poll_interval = "50ms"
stall_window = "10m"
[scopes.narrow.pacer]
initial = 4
min = 4
max = 4
[[scopes.narrow.sources]]
name = "n"

[scopes.quota]
quota_full = "wait"
poll_interval = "50ms"
stall_window = "10m"
[[scopes.quota.sources]]
name = "q"
rpm = 1
"#;

fn engine(cfg: &Config) -> Arc<Engine<MemoryBackend>> {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let names: Vec<String> = cfg
        .scopes
        .iter()
        .flat_map(|s| s.sources.iter().map(|x| x.name.clone()))
        .collect();
    Engine::new(cfg, MemoryBackend::new(clock.clone(), names), clock)
}

async fn cycle(e: &Engine<MemoryBackend>, owner: u64) {
    let call = e.begin_call(owner, "chat", None).unwrap();
    let g = e.acquire(owner, call).await.unwrap();
    e.report(
        owner,
        g.permit,
        EOutcome::Success {
            tokens: Some(10),
            count_attempt: true,
        },
    )
    .await
    .unwrap();
    e.end_call(owner, call).await.unwrap();
}

fn cpu_time() -> Duration {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .expect("getrusage");
    let tv =
        |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
    tv(u.user_time()) + tv(u.system_time())
}

#[tokio::main]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    let cfg = parse_str(CONFIG, std::iter::empty()).expect("bench config");

    // 1. sequential in-process cycles.
    let e = engine(&cfg);
    let n = 200_000 / scale;
    let t = Instant::now();
    for _ in 0..n {
        cycle(&e, 1).await;
    }
    let seq = n as f64 / t.elapsed().as_secs_f64();
    println!(
        "1. in-process call cycle, 1 task:      {seq:>10.0} calls/s  ({:.2} µs/call)",
        1e6 / seq
    );

    // 2. concurrent in-process cycles.
    let tasks = 64;
    let per = 5_000 / scale;
    let t = Instant::now();
    let mut hs = Vec::new();
    for owner in 0..tasks {
        let e = e.clone();
        hs.push(tokio::spawn(async move {
            for _ in 0..per {
                cycle(&e, owner).await;
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    let conc = (tasks * per) as f64 / t.elapsed().as_secs_f64();
    println!(
        "2. in-process call cycle, {tasks} tasks:    {conc:>10.0} calls/s  (×{:.2} of 1 task)",
        conc / seq
    );

    // 3. waiters on OPEN sources.
    let e = engine(&cfg);
    let waiters = 5_000 / scale as u64;
    e.force_open("a", Duration::from_secs(3600)).await.unwrap();
    e.force_open("b", Duration::from_secs(3600)).await.unwrap();
    let mut hs = Vec::new();
    for owner in 0..waiters {
        let e = e.clone();
        hs.push(tokio::spawn(async move {
            let call = e.begin_call(owner, "chat", None).unwrap();
            let g = e.acquire(owner, call).await.unwrap();
            (e, owner, g.permit)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // let them all start waiting
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    let hold = Duration::from_secs(if quick { 1 } else { 3 });
    tokio::time::sleep(hold).await;
    let cpu = cpu_time() - cpu0;
    let wall = wall0.elapsed();
    let per_waiter_s = cpu.as_secs_f64() / (waiters as f64 * wall.as_secs_f64());
    let status = e.status().await;
    println!(
        "3. {waiters} waiters (OPEN, memo):       {:>10.1} µs CPU per waiter-second ({} waiting, {:.0}% of one core)",
        per_waiter_s * 1e6,
        status[0].waiters,
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
    );
    let t = Instant::now();
    e.force_close("a").await.unwrap();
    e.force_close("b").await.unwrap();
    for h in hs {
        let (e, owner, permit) = h.await.unwrap();
        e.report(owner, permit, EOutcome::Cancelled).await.unwrap();
    }
    println!(
        "   force_close → all {waiters} granted in   {:>10.1} ms (woken by the scope notify, not the 50 ms nap)",
        t.elapsed().as_secs_f64() * 1e3
    );

    // 3b. waiters on an exhausted quota: no hint, so each polls every 50 ms (jittered)
    // through the backend; a freed reservation wakes them early.
    let e = engine(&cfg);
    let waiters = 2_000 / scale as u64;
    let c0 = e.begin_call(u64::MAX, "quota", None).unwrap();
    let g0 = e.acquire(u64::MAX, c0).await.unwrap(); // takes the only request of the minute
    e.report(
        u64::MAX,
        g0.permit,
        EOutcome::failure(polygate::backend::FailureKind::Error),
    )
    .await
    .unwrap();
    let mut hs = Vec::new();
    for owner in 0..waiters {
        let e = e.clone();
        hs.push(tokio::spawn(async move {
            let call = e.begin_call(owner, "quota", None).unwrap();
            let _ = tokio::time::timeout(Duration::from_secs(30), e.acquire(owner, call)).await;
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    tokio::time::sleep(hold).await;
    let cpu = cpu_time() - cpu0;
    let wall = wall0.elapsed();
    println!(
        "3b. {waiters} waiters (quota, polling):  {:>10.1} µs CPU per waiter-second ({:.0}% of one core; ~{} passes/s expected)",
        cpu.as_secs_f64() / (waiters as f64 * wall.as_secs_f64()) * 1e6,
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64(),
        waiters * 1000 / 38
    );
    for h in hs {
        h.abort();
    }

    // 3c. many callers behind a narrow pacer (ceiling 4): each freed slot should cost
    // about one pass, not one per waiter.
    let e = engine(&cfg);
    let callers = 2_000 / scale as u64;
    let (cpu0, t) = (cpu_time(), Instant::now());
    let mut hs = Vec::new();
    for owner in 0..callers {
        let e = e.clone();
        hs.push(tokio::spawn(async move {
            let call = e.begin_call(owner, "narrow", None).unwrap();
            let g = e.acquire(owner, call).await.unwrap();
            tokio::task::yield_now().await;
            e.report(
                owner,
                g.permit,
                EOutcome::Success {
                    tokens: None,
                    count_attempt: true,
                },
            )
            .await
            .unwrap();
            e.end_call(owner, call).await.unwrap();
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    let wall = t.elapsed();
    let cpu = cpu_time() - cpu0;
    println!(
        "3c. {callers} callers, pacer ceiling 4:   {:>10.0} calls/s  ({:.1} µs CPU per call)",
        callers as f64 / wall.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / callers as f64
    );

    // 4. over the socket.
    let dir = tempfile_dir();
    let path = dir.join("bench.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let e = engine(&cfg);
    let opts = ServerOptions::new(65536, AccessPolicy::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let srv = tokio::spawn(server::run(listener, e, opts, async {
        let _ = stop_rx.await;
    }));
    let mut conn = Framed::new(
        UnixStream::connect(&path).await.unwrap(),
        ClientCodec::new(65536),
    );
    let mut id = 0u64;
    let mut send = |req: Request| {
        id += 1;
        ClientFrame { id, request: req }
    };
    conn.send(send(Request::Hello {
        protocol_version: PROTOCOL_VERSION,
        client_name: "bench".into(),
        pid: std::process::id(),
    }))
    .await
    .unwrap();
    conn.next().await.unwrap().unwrap();
    let n = 20_000 / scale;
    let t = Instant::now();
    for _ in 0..n {
        conn.send(send(Request::BeginCall {
            scope: "chat".into(),
            est_tokens: None,
        }))
        .await
        .unwrap();
        let Reply::CallBegun { call } = conn.next().await.unwrap().unwrap().reply else {
            panic!("begin")
        };
        conn.send(send(Request::Acquire { call })).await.unwrap();
        let Reply::Granted { permit, .. } = conn.next().await.unwrap().unwrap().reply else {
            panic!("acquire")
        };
        conn.send(send(Request::Report {
            permit,
            outcome: Outcome::Success {
                tokens: Some(10),
                count_attempt: true,
            },
        }))
        .await
        .unwrap();
        conn.send(send(Request::EndCall { call })).await.unwrap();
        conn.next().await.unwrap().unwrap();
        conn.next().await.unwrap().unwrap();
    }
    let sock = n as f64 / t.elapsed().as_secs_f64();
    println!(
        "4. socket call cycle, 1 connection:    {sock:>10.0} calls/s  ({:.1} µs/call, ×{:.3} of in-process)",
        1e6 / sock,
        sock / seq
    );
    drop(conn);
    let _ = stop_tx.send(());
    let _ = srv.await;
    let _ = std::fs::remove_dir_all(dir);

    // 5. what /metrics adds to every request: one Instant, its elapsed(), one
    // histogram observation; against the two clock reads alone (the floor).
    let hist = polygate::metrics::ServerMetrics::default();
    let n = 2_000_000 / scale;
    let t = Instant::now();
    for i in 0..n {
        let started = Instant::now();
        std::hint::black_box(i);
        std::hint::black_box(started.elapsed());
    }
    let floor = t.elapsed().as_nanos() as f64 / n as f64;
    let t = Instant::now();
    for i in 0..n {
        let started = Instant::now();
        std::hint::black_box(i);
        hist.observe(i as usize % 16, started.elapsed());
    }
    let hook = t.elapsed().as_nanos() as f64 / n as f64;
    println!(
        "5. request-latency hook:               {hook:>10.1} ns/request  (clock reads alone {floor:.1} ns; histogram {:.1} ns)",
        hook - floor
    );
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("polygate-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
