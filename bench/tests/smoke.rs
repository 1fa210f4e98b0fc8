//! Smoke test of the bench (DESIGN §16: speed goals live in the bench, never in timed
//! tests): every scenario runs with tiny durations and prints JSON lines carrying its
//! keys. No figure is checked; only that the tool works.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// `target/<profile>/`: this test runs from `target/<profile>/deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// The keys each scenario's lines must carry (bench/src/main.rs `Scenario::keys`).
fn keys(scenario: &str) -> &'static [&'static str] {
    match scenario {
        "latency" => &["rtt_p50_us", "rtt_p99_us", "floor_p50_us", "ratio"],
        "throughput" => &[
            "clients",
            "calls_per_s",
            "call_p50_us",
            "call_p99_us",
            "floor_calls_per_s",
            "ratio",
            "calls_per_s_v1",
            "sidecar_cpu_per_frame_us",
        ],
        "redis" => &[
            "clients",
            "calls_per_s",
            "redis_cmds_per_call",
            "script_us_p50",
            "redis_cpu_pct",
        ],
        "waiters" => &["waiters", "rss_mib", "cpu_pct_while_waiting", "release_ms"],
        "python" => &["mode", "calls_per_s", "baseline_calls_per_s", "ratio"],
        "node" | "go" => &["calls_per_s", "python_asyncio_calls_per_s", "ratio"],
        "transport" => &[
            "plain_us",
            "transport_us",
            "run_http_us",
            "overhead_ratio",
            "cpu_overhead_ratio",
            "stream_cpu_ratio",
        ],
        "engine" => &[
            "calls_per_s_1_task",
            "calls_per_s_64_tasks",
            "metrics_hook_ns",
            "clock_reads_ns",
        ],
        "priorities" => &[
            "interactive_p50_ms",
            "interactive_p99_ms",
            "interactive_p50_ms_without_classes",
            "interactive_p99_ms_without_classes",
            "batch_calls_per_s",
        ],
        "status_flood" => &[
            "sources",
            "call_p50_us",
            "call_p50_us_flooded",
            "p50_ratio",
            "status_replies_per_s",
        ],
        other => panic!("unexpected scenario {other:?}"),
    }
}

#[test]
fn every_scenario_prints_its_keys() {
    let dir = profile_dir();
    let sidecar = dir.join("polygate-sidecar");
    assert!(
        sidecar.is_file(),
        "{} missing: build the workspace first (cargo build --workspace)",
        sidecar.display()
    );
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_polygate-bench"))
        .args(["--all", "--smoke", "--sidecar-bin"])
        .arg(&sidecar)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run polygate-bench");
    // Bounded: a hung scenario fails the test instead of hanging the run.
    let limit = Duration::from_secs(240);
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("polygate-bench --all --smoke still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut seen = Vec::new();
    for line in stdout.lines() {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}\nstderr: {stderr}"));
        let m = v.as_object().expect("a JSON object per line");
        let scenario = m["scenario"].as_str().expect("scenario name").to_string();
        assert!(
            !m.contains_key("error"),
            "{scenario} failed: {line}\nstderr: {stderr}"
        );
        for k in keys(&scenario) {
            assert!(m.contains_key(*k), "{scenario} line without {k}: {line}");
        }
        assert!(m.contains_key("loadavg"), "{line}");
        seen.push(scenario);
    }
    for s in [
        "latency",
        "throughput",
        "redis",
        "waiters",
        "python",
        "node",
        "go",
        "transport",
        "engine",
        "priorities",
        "status_flood",
    ] {
        assert!(
            seen.iter().any(|x| x == s),
            "no line for {s}: {stdout}\nstderr: {stderr}"
        );
    }
    assert!(out.status.success(), "exit {}: {stderr}", out.status);
}
