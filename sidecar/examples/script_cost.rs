//! What one `gate.lua` call costs Redis (DESIGN §10, §16): drives admissions and
//! reports through the Redis backend from many tasks, then reads `INFO commandstats`
//! and prints one JSON line: script calls per second, Redis's own µs per script call
//! (`usec_per_call`), and the Redis commands each script call runs.
//!
//! ```sh
//! cargo run --release -p polygate-sidecar --example script_cost -- \
//!     [--redis-url redis://127.0.0.1:6379/] [--tasks 64] [--seconds 5] [--sources 4] \
//!     [--outcome success|failure|mixed]
//! ```
//!
//! Without `--redis-url` it starts a throwaway `redis-server` on a free port (no
//! persistence) and stops it at the end. It asserts nothing: a measuring tool, kept
//! out of the timed tests. `polygate-bench --scenario redis` measures the whole call
//! through the sidecar; this isolates the script.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use polygate::backend::redis::{RedisBackend, RedisOptions};
use polygate::backend::{
    Admit, AdmitRequest, Backend, BreakerParams, FailureKind, Outcome, QuotaParams, ReportRequest,
};
use polygate::clock::TokioClock;
use polygate::config::OnBackendError;

/// Command-line options.
struct Opts {
    /// Use this Redis instead of starting one.
    url: Option<String>,
    /// Concurrent admit + report loops.
    tasks: usize,
    /// Measured run time.
    seconds: f64,
    /// Distinct sources the loops spread over.
    sources: usize,
    /// What each attempt reports.
    outcome: String,
}

fn opts() -> Opts {
    let mut o = Opts {
        url: None,
        tasks: 64,
        seconds: 5.0,
        sources: 4,
        outcome: "success".into(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--redis-url" => o.url = Some(val()),
            "--tasks" => o.tasks = val().parse().expect("--tasks N"),
            "--seconds" => o.seconds = val().parse().expect("--seconds S"),
            "--sources" => o.sources = val().parse().expect("--sources N"),
            "--outcome" => o.outcome = val(),
            other => panic!("unknown argument {other:?}"),
        }
    }
    o
}

/// A throwaway redis-server, killed on drop.
struct Server(Child, u16);

impl Server {
    fn start() -> Server {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            l.local_addr().expect("bound").port()
        };
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Server(child, port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bp() -> BreakerParams {
    BreakerParams {
        failure_threshold: 5,
        failure_rate: 0.5,
        min_calls: 20,
        window: Duration::from_secs(60),
        cooldown: Duration::from_secs(60),
        max_cooldown: Duration::from_secs(600),
        probe_ttl: Duration::from_secs(120),
    }
}

fn qp() -> QuotaParams {
    QuotaParams {
        tpm: Some(1_000_000_000),
        rpm: Some(1_000_000_000),
        ..QuotaParams::default()
    }
}

/// `INFO commandstats` → (command, calls, usec).
async fn commandstats(con: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .expect("INFO");
    let mut out = Vec::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let field = |k: &str| -> u64 {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(k))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        out.push((name.to_string(), field("calls="), field("usec=")));
    }
    out
}

#[tokio::main]
async fn main() {
    let o = opts();
    let server = o.url.is_none().then(Server::start);
    let url = o
        .url
        .clone()
        .unwrap_or_else(|| format!("redis://127.0.0.1:{}/", server.as_ref().expect("started").1));
    let sources: Vec<String> = (0..o.sources).map(|i| format!("s{i}")).collect();
    let opts = RedisOptions {
        url: url.clone(),
        cluster_nodes: vec![],
        key_prefix: format!("script-cost-{}", std::process::id()),
        timeout: Duration::from_secs(2),
        on_backend_error: OnBackendError::FailClosed,
        sources: sources.clone(),
        degraded_share: polygate::config::DegradedShare::Auto,
    };
    let backend = Arc::new(
        RedisBackend::connect(opts, Arc::new(TokioClock::new()))
            .await
            .expect("connect"),
    );
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect for INFO");
    // Warm up: loads the script, creates the keys.
    for s in &sources {
        if let Ok(Admit::Admitted {
            epoch, is_probe, ..
        }) = backend.admit(s, AdmitRequest::new(&bp(), &qp(), 10)).await
        {
            let ok = Outcome::Success {
                tokens: Some(10),
                split: None,
                count_attempt: true,
            };
            let _ = backend
                .report(s, ReportRequest::new(&bp(), &qp(), epoch, is_probe, 10, ok))
                .await;
        }
    }
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut con)
        .await
        .expect("RESETSTAT");
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..o.tasks {
        let (b, stop, calls, sources) = (
            backend.clone(),
            stop.clone(),
            calls.clone(),
            sources.clone(),
        );
        let mode = o.outcome.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = t;
            while !stop.load(Ordering::Relaxed) {
                let s = &sources[i % sources.len()];
                i += 1;
                let Ok(Admit::Admitted {
                    epoch,
                    is_probe,
                    rate,
                    ..
                }) = b.admit(s, AdmitRequest::new(&bp(), &qp(), 10)).await
                else {
                    continue;
                };
                let outcome = match (mode.as_str(), i % 10) {
                    ("failure", _) | ("mixed", 0) => Outcome::failure(FailureKind::ServerError),
                    _ => Outcome::Success {
                        tokens: Some(8),
                        split: None,
                        count_attempt: true,
                    },
                };
                let _ = b
                    .report(
                        s,
                        // What the engine sends: the permit's admission with it.
                        ReportRequest::new(&bp(), &qp(), epoch, is_probe, 10, outcome)
                            .admitted_at(rate),
                    )
                    .await;
                calls.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(o.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = commandstats(&mut con).await;
    let script = ["evalsha", "eval", "fcall", "evalsha_ro", "fcall_ro"];
    let (mut script_calls, mut script_usec, mut inner) = (0u64, 0u64, 0u64);
    let mut per_cmd = Vec::new();
    for (name, n, us) in &stats {
        if script.contains(&name.as_str()) {
            script_calls += n;
            script_usec += us;
        } else if !["info", "config|resetstat", "script|load", "function|load"]
            .contains(&name.as_str())
        {
            inner += n;
            per_cmd.push(format!("\"{name}\":{:.2}", *n as f64 / 1.0));
        }
    }
    let calls = calls.load(Ordering::Relaxed);
    let per_call = |n: u64| n as f64 / script_calls.max(1) as f64;
    println!(
        "{{\"outcome\":\"{}\",\"tasks\":{},\"calls_per_s\":{:.0},\"script_calls_per_s\":{:.0},\
         \"script_us_per_call\":{:.2},\"redis_cmds_per_script_call\":{:.2},\"inner_calls\":{{{}}}}}",
        o.outcome,
        o.tasks,
        calls as f64 / elapsed,
        script_calls as f64 / elapsed,
        per_call(script_usec),
        per_call(inner),
        per_cmd.join(","),
    );
    drop(server);
}
