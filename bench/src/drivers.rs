//! The binding scenarios: `python`, `node`, `go` (DESIGN §16), on the Redis backend.
//!
//! Each runs a driver script of its binding (bench/drivers/, written with the
//! binding: CLI `--socket --concurrency --seconds --scope`, one JSON line out) against
//! a sidecar started here. `python` also runs, in the same run and against the same
//! Redis, the in-process redis-py baseline (bench/baseline/redis_py_baseline.py): the
//! sidecar's own admit and report script calls for one call, captured with MONITOR,
//! replayed from Python at the same concurrency. A missing driver is reported in the
//! line (`skipped`), not an error.
//!
//! `transport` (DESIGN §17) runs bench/drivers/python_transport.py against a sidecar on
//! the memory backend: the HTTP transport's cost per request next to `run()` around
//! the same request, and its CPU per 1,000-chunk stream (the driver starts its own fake
//! upstream). A driver that finds httpx missing prints `skipped`, passed on as is.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::context::{redis_server, rel, scratch, sidecar, Ctx};
use crate::frames::{BlockingConn, Frame, Requests, SCOPE};
use crate::procs;
use crate::target::{Backend, Redis};
use crate::{Line, Scenario};

/// Run `cmd`, wait at most `limit`, and parse the last JSON line it printed.
fn run_json(mut cmd: Command, limit: Duration) -> Result<Map<String, Value>, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what} still running after {limit:?}; killed"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        return Err(format!(
            "{what} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .and_then(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|v| v.as_object().cloned())
        .ok_or_else(|| format!("{what} printed no JSON line: {stdout:?}"))
}

fn field(m: &Map<String, Value>, k: &str) -> Option<f64> {
    m.get(k).and_then(Value::as_f64)
}

/// The shared setup: Redis, a sidecar on it, a scratch dir.
struct Env {
    dir: tempfile::TempDir,
    redis: Redis,
    socket: PathBuf,
    _sidecar: crate::target::Sidecar,
}

fn env(ctx: &Ctx) -> Result<Env, String> {
    let dir = scratch()?;
    let redis = redis_server(ctx.opts, dir.path())?;
    let sc = sidecar(ctx.opts, dir.path(), &Backend::Redis(redis.url.clone()))?;
    Ok(Env {
        socket: sc.socket.clone(),
        _sidecar: sc,
        redis,
        dir,
    })
}

/// The time limit of one driver run.
fn limit(ctx: &Ctx) -> Duration {
    Duration::from_secs_f64(ctx.opts.seconds + 120.0)
}

fn python_driver(ctx: &Ctx, env: &Env, mode: &str) -> Result<Map<String, Value>, String> {
    let o = ctx.opts;
    let mut cmd = Command::new(&o.python);
    cmd.arg(&o.python_driver)
        .arg("--socket")
        .arg(&env.socket)
        .args(["--mode", mode])
        .args(["--concurrency", &o.concurrency.to_string()])
        .args(["--seconds", &o.seconds.to_string()])
        .args(["--scope", SCOPE, "--est-tokens", "10"]);
    run_json(cmd, limit(ctx))
}

pub fn run(ctx: &mut Ctx, s: Scenario) -> Result<Vec<Line>, String> {
    let o = ctx.opts;
    let driver = match s {
        Scenario::Python => &o.python_driver,
        Scenario::Node => &o.node_driver,
        _ => &o.go_driver,
    };
    if !driver.exists() {
        let mut l = Line::new(s);
        l.set(
            "skipped",
            format!("driver missing: {}", rel(driver).display()),
        );
        if s == Scenario::Python {
            l.set("mode", "sync");
        }
        return Ok(vec![l]);
    }
    let env = env(ctx)?;
    match s {
        Scenario::Python => python(ctx, &env),
        _ => other(ctx, &env, s),
    }
}

/// `transport`: the Python HTTP transport's overhead (DESIGN §17).
pub fn transport(ctx: &mut Ctx) -> Result<Vec<Line>, String> {
    let o = ctx.opts;
    let mut l = Line::new(Scenario::Transport);
    if !o.transport_driver.exists() {
        l.set(
            "skipped",
            format!("driver missing: {}", rel(&o.transport_driver).display()),
        );
        return Ok(vec![l]);
    }
    let dir = scratch()?;
    let sc = sidecar(o, dir.path(), &Backend::Memory)?;
    // --seconds scales the counts: 3 s (the default) → 3,000 requests, 20 streams.
    let requests = ((o.seconds * 1000.0) as usize).max(100);
    let streams = ((o.seconds * 7.0) as usize).max(2);
    let mut cmd = Command::new(&o.python);
    cmd.arg(&o.transport_driver)
        .arg("--socket")
        .arg(&sc.socket)
        .args(["--scope", SCOPE])
        .args(["--requests", &requests.to_string()])
        .args(["--streams", &streams.to_string()])
        .args(["--chunks", "1000"]);
    let m = run_json(cmd, limit(ctx))?;
    l.set("driver", rel(&o.transport_driver).display().to_string());
    for (k, v) in &m {
        l.set(k, v.clone());
    }
    Ok(vec![l])
}

/// `python`: the binding (sync, asyncio) next to the redis-py baseline.
fn python(ctx: &mut Ctx, env: &Env) -> Result<Vec<Line>, String> {
    let o = ctx.opts;
    let capture = capture(&env.redis, &env.socket, env.dir.path());
    let mut lines = Vec::new();
    for mode in ["sync", "asyncio"] {
        let mut l = Line::new(Scenario::Python);
        l.set("mode", mode)
            .set("driver", rel(&o.python_driver).display().to_string())
            .set("concurrency", o.concurrency);
        let mine = python_driver(ctx, env, mode);
        match &mine {
            Ok(m) => {
                l.opt("calls_per_s", field(m, "calls_per_s"))
                    .opt("call_p50_us", field(m, "call_p50_us"))
                    .opt("call_p99_us", field(m, "call_p99_us"));
                if mode == "asyncio" {
                    ctx.python_asyncio = field(m, "calls_per_s");
                }
            }
            Err(e) => {
                l.set("error", e.clone());
            }
        }
        let base = capture.clone().and_then(|file| {
            let mut cmd = Command::new(&o.python);
            cmd.arg(procs::repo_root().join("bench/baseline/redis_py_baseline.py"))
                .args(["--redis-url", &env.redis.url])
                .arg("--capture")
                .arg(&file)
                .arg("--script")
                .arg(procs::repo_root().join("sidecar/src/backend/redis/gate.lua"))
                .args(["--mode", mode])
                .args(["--concurrency", &o.concurrency.to_string()])
                .args(["--seconds", &o.seconds.to_string()]);
            run_json(cmd, limit(ctx))
        });
        match base {
            Ok(b) => {
                l.opt("baseline_calls_per_s", field(&b, "calls_per_s"))
                    .opt("baseline_call_p50_us", field(&b, "call_p50_us"))
                    .opt("baseline_commands_per_call", field(&b, "commands_per_call"))
                    .set(
                        "baseline_script_matches",
                        b.get("script_matches").cloned().unwrap_or(Value::Null),
                    );
                if let (Some(a), Some(b)) = (
                    mine.as_ref().ok().and_then(|m| field(m, "calls_per_s")),
                    field(&b, "calls_per_s"),
                ) {
                    l.num("ratio", a / b);
                }
            }
            Err(e) => {
                l.set("baseline_error", e);
            }
        }
        lines.push(l);
    }
    Ok(lines)
}

/// `node` / `go`: the driver's calls/s and its ratio to Python asyncio.
fn other(ctx: &mut Ctx, env: &Env, s: Scenario) -> Result<Vec<Line>, String> {
    let o = ctx.opts;
    let mut l = Line::new(s);
    let args = |c: &mut Command, dash: &str| {
        c.arg(format!("{dash}socket"))
            .arg(&env.socket)
            .arg(format!("{dash}concurrency"))
            .arg(o.concurrency.to_string())
            .arg(format!("{dash}seconds"))
            .arg(o.seconds.to_string())
            .arg(format!("{dash}scope"))
            .arg(SCOPE);
    };
    let cmd = if s == Scenario::Node {
        let mut c = Command::new("node");
        c.arg(&o.node_driver);
        args(&mut c, "--");
        c
    } else {
        let bin = env.dir.path().join("go_client");
        let built = Command::new("go")
            .args(["build", "-o"])
            .arg(&bin)
            .arg(".")
            .current_dir(&o.go_driver)
            .output()
            .map_err(|e| format!("cannot run go build: {e}"))?;
        if !built.status.success() {
            return Err(format!(
                "go build in {} failed: {}",
                rel(&o.go_driver).display(),
                String::from_utf8_lossy(&built.stderr).trim()
            ));
        }
        let mut c = Command::new(bin);
        args(&mut c, "-");
        c
    };
    let m = run_json(cmd, limit(ctx))?;
    let calls = field(&m, "calls_per_s");
    l.opt("calls_per_s", calls)
        .opt("call_p50_us", field(&m, "call_p50_us"))
        .set("concurrency", o.concurrency);
    if ctx.python_asyncio.is_none() && o.python_driver.exists() {
        ctx.python_asyncio = python_driver(ctx, env, "asyncio")
            .ok()
            .and_then(|m| field(&m, "calls_per_s"));
    }
    l.opt("python_asyncio_calls_per_s", ctx.python_asyncio);
    if let (Some(a), Some(b)) = (calls, ctx.python_asyncio) {
        l.num("ratio", a / b);
    }
    Ok(vec![l])
}

/// One MONITOR line: `<time> [<db> <client>] "CMD" "arg" …` → (client, args).
pub(crate) fn parse_monitor(line: &str) -> Option<(String, Vec<String>)> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    let client = line[open + 1..close].to_string();
    let mut args = Vec::new();
    let mut chars = line[close + 1..].chars();
    while let Some(c) = chars.next() {
        if c != '"' {
            continue;
        }
        let mut s = String::new();
        while let Some(c) = chars.next() {
            match c {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => s.push('\n'),
                    'r' => s.push('\r'),
                    't' => s.push('\t'),
                    'a' => s.push('\x07'),
                    'b' => s.push('\x08'),
                    'x' => {
                        let h: String = chars.by_ref().take(2).collect();
                        s.push(u8::from_str_radix(&h, 16).ok()? as char);
                    }
                    other => s.push(other),
                },
                c => s.push(c),
            }
        }
        args.push(s);
    }
    Some((client, args))
}

/// Record the Redis commands the sidecar makes for one call (admit: during `Start`;
/// report: during `Finish`) into `dir/capture.json`, for the baseline to replay.
fn capture(redis: &Redis, socket: &Path, dir: &Path) -> Result<PathBuf, String> {
    let q = Requests::new();
    let mut c = BlockingConn::connect(socket, true).map_err(|e| e.to_string())?;
    let call = |c: &mut BlockingConn, between: &dyn Fn() -> Result<(), String>| {
        let id = c.id();
        let permit = c
            .round_trip(
                |o| q.start.put(o, id, None),
                |f: &Frame<'_>| f.started_permit().map_err(std::io::Error::other),
            )
            .map_err(|e| e.to_string())?;
        between()?;
        let id = c.id();
        c.round_trip(
            |o| q.finish.put(o, id, Some(permit)),
            |f| f.check().map_err(std::io::Error::other),
        )
        .map_err(|e| e.to_string())
    };
    // Warm up (script loaded, connections made), then the recorded call.
    call(&mut c, &|| Ok(()))?;
    let mut mon = redis.connect()?;
    mon.cmd(&["MONITOR"])?;
    let marker = |m: &str| redis.cmd(&["ECHO", m]).map(|_| ());
    call(&mut c, &|| marker("polygate-bench-admit-done"))?;
    marker("polygate-bench-report-done")?;
    let (mut admit, mut report) = (Vec::new(), Vec::new());
    let mut phase = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while phase < 2 {
        if Instant::now() > deadline {
            return Err("MONITOR never showed the bench's markers".into());
        }
        let line = mon.reply()?;
        let Some((client, args)) = parse_monitor(&line) else {
            continue;
        };
        // `[0 lua]`: a command a script ran; replaying the script runs it again.
        if client.ends_with(" lua") {
            continue;
        }
        let Some(name) = args.first().map(|a| a.to_ascii_uppercase()) else {
            continue;
        };
        if name == "ECHO" {
            if args
                .get(1)
                .is_some_and(|a| a.starts_with("polygate-bench-"))
            {
                phase += 1;
            }
            continue;
        }
        if matches!(name.as_str(), "PING" | "INFO" | "CLIENT" | "HELLO") {
            continue;
        }
        let v = Value::from(args);
        if phase == 0 {
            admit.push(v);
        } else {
            report.push(v);
        }
    }
    if admit.is_empty() {
        return Err("the sidecar made no Redis command during Start".into());
    }
    let file = dir.join("capture.json");
    let body = serde_json::json!({ "admit": admit, "report": report });
    std::fs::write(&file, body.to_string()).map_err(|e| e.to_string())?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::parse_monitor;

    #[test]
    fn monitor_lines_parse_with_escapes() {
        let (client, args) = parse_monitor(
            r#"1700000000.123456 [0 127.0.0.1:5341] "EVALSHA" "ab" "2" "{p:a}:b" "x\"y" "\x01z""#,
        )
        .unwrap();
        assert_eq!(client, "0 127.0.0.1:5341");
        assert_eq!(args, ["EVALSHA", "ab", "2", "{p:a}:b", "x\"y", "\u{1}z"]);
    }
}
