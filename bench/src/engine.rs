//! `--scenario engine`: the engine alone, in process, on the memory backend (no
//! socket, no codec): what a call costs before the server adds anything, and what the
//! request-latency histogram adds to each request. Kept from the old
//! `sidecar/examples/bench.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use polygate::backend::memory::MemoryBackend;
use polygate::backend::Outcome;
use polygate::clock::{Clock, TokioClock};
use polygate::config::parse_str;
use polygate::engine::Engine;

use crate::{Line, Opts, Scenario};

const CONFIG: &str = r#"
[scopes.bench]
[scopes.bench.pacer]
initial = 100000
max = 100000
[[scopes.bench.sources]]
name = "a"
tpm = 1000000000000
rpm = 1000000000000
est_tokens = 10

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
"#;

/// An engine on the memory backend and the real clock, configured by `config`
/// (sources named `sources`): every in-process scenario starts here.
pub fn in_process(config: &str, sources: &[&str]) -> Result<Arc<Engine<MemoryBackend>>, String> {
    let cfg = parse_str(config, std::iter::empty()).map_err(|e| e.to_string())?;
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let names: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
    Ok(Engine::new(
        &cfg,
        MemoryBackend::new(clock.clone(), names),
        clock,
    ))
}

fn engine() -> Result<Arc<Engine<MemoryBackend>>, String> {
    in_process(CONFIG, &["a", "n"])
}

async fn cycle(e: &Engine<MemoryBackend>, owner: u64, scope: &str) -> Result<(), String> {
    let call = e
        .begin_call(owner, scope, None)
        .map_err(|e| e.to_string())?;
    let g = e.acquire(owner, call).await.map_err(|e| e.to_string())?;
    if scope == "narrow" {
        tokio::task::yield_now().await;
    }
    let ok = Outcome::Success {
        tokens: Some(10),
        split: None,
        count_attempt: true,
    };
    e.report(owner, g.permit, ok)
        .await
        .map_err(|e| e.to_string())?;
    e.end_call(owner, call).await.map_err(|e| e.to_string())
}

/// Calls/s of `tasks` tasks cycling for `window`.
async fn rate(
    e: &Arc<Engine<MemoryBackend>>,
    tasks: u64,
    scope: &'static str,
    window: Duration,
) -> Result<f64, String> {
    let t0 = Instant::now();
    let hs: Vec<_> = (0..tasks)
        .map(|owner| {
            let e = e.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while t0.elapsed() < window {
                    cycle(&e, owner, scope).await?;
                    n += 1;
                }
                Ok::<_, String>(n)
            })
        })
        .collect();
    let mut n = 0;
    for h in hs {
        n += h.await.map_err(|e| e.to_string())??;
    }
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}

pub fn run(rt: &tokio::runtime::Runtime, opts: &Opts) -> Result<Vec<Line>, String> {
    let window = opts.window();
    rt.block_on(async {
        let e = engine()?;
        let mut l = Line::new(Scenario::Engine);
        let one = rate(&e, 1, "bench", window).await?;
        l.num("calls_per_s_1_task", one)
            .num("us_per_call", 1e6 / one)
            .num("calls_per_s_64_tasks", rate(&e, 64, "bench", window).await?);
        let cpu0 = crate::procs::cpu_time(std::process::id())?;
        let narrow = rate(&e, 256, "narrow", window).await?;
        let cpu = crate::procs::cpu_time(std::process::id())? - cpu0;
        l.num("pacer4_calls_per_s", narrow).num(
            "pacer4_cpu_us_per_call",
            cpu.as_secs_f64() * 1e6 / (narrow * window.as_secs_f64()).max(1.0),
        );
        let (hook, clocks) = latency_hook();
        l.num("metrics_hook_ns", hook - clocks)
            .num("clock_reads_ns", clocks);
        Ok(vec![l])
    })
}

/// What the request-latency histogram (`polygate_request_duration_seconds`) adds to
/// every request: one `Instant`, its `elapsed()` and one observation, against the two
/// clock reads alone (its floor). The two loops alternate over several rounds and
/// each keeps its fastest round, so a busy machine does not make the difference
/// noise. Returns (hook, clock reads) in ns per request.
fn latency_hook() -> (f64, f64) {
    let hist = polygate::metrics::ServerMetrics::default();
    let n = 400_000u64;
    let (mut hook, mut floor) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..n {
            let started = Instant::now();
            std::hint::black_box(i);
            std::hint::black_box(started.elapsed());
        }
        floor = floor.min(t.elapsed().as_nanos() as f64 / n as f64);
        let t = Instant::now();
        for i in 0..n {
            let started = Instant::now();
            std::hint::black_box(i);
            hist.observe(i as usize % 16, started.elapsed());
        }
        hook = hook.min(t.elapsed().as_nanos() as f64 / n as f64);
    }
    (hook, floor)
}
