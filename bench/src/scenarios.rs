//! The Rust-side scenarios: `latency`, `throughput`, `redis`, `waiters` (DESIGN §16).
//! Each returns its JSON lines; a failure becomes a line with an `error` key.

use std::path::Path;
use std::time::{Duration, Instant};

use ipc_protocol::{CallSpec, Request};

use crate::context::{redis_server, sidecar, tempdir, Ctx};
use crate::echo;
use crate::frames::{echo_request, BlockingConn, ReplySizes, Requests, Template};
use crate::load::{self, Floor, Run, Shape};
use crate::procs;
use crate::target::{Backend, Redis};
use crate::{Line, Opts, Scenario};

/// Runs one scenario; a failure becomes a line with an `error` key.
pub fn run(ctx: &mut Ctx, s: Scenario) -> Vec<Line> {
    let r = match s {
        Scenario::Latency => latency(ctx.opts),
        Scenario::Throughput => throughput(ctx),
        Scenario::Redis => redis(ctx),
        Scenario::Waiters => waiters(ctx),
        Scenario::Engine => crate::engine::run(&ctx.rt, ctx.opts),
        Scenario::Priorities => crate::priorities::run(&ctx.rt, ctx.opts),
        Scenario::Fleet => Ok(vec![fleet(ctx.opts)]),
        Scenario::StatusFlood => crate::flood::run(ctx.opts),
        Scenario::Tenants => crate::tenants::run(ctx),
        Scenario::Python | Scenario::Node | Scenario::Go => crate::drivers::run(ctx, s),
        Scenario::Transport => crate::drivers::transport(ctx),
    };
    r.unwrap_or_else(|e| {
        let mut l = Line::new(s);
        l.set("error", e);
        vec![l]
    })
}

/// Blocking round trips of `fill` frames for `window` (after `warmup`): sorted ns.
fn round_trips(
    path: &Path,
    hello: bool,
    warmup: Duration,
    window: Duration,
    fill: impl Fn(&mut Vec<u8>, u64),
) -> Result<Vec<u32>, String> {
    let mut c = BlockingConn::connect(path, hello).map_err(|e| e.to_string())?;
    let mut lat = Vec::with_capacity(1 << 20);
    let t0 = Instant::now();
    let mut measuring = false;
    let mut start = t0;
    loop {
        let id = c.id();
        let t = Instant::now();
        let got = c
            .round_trip(
                |out| fill(out, id),
                |f| {
                    f.check().map_err(std::io::Error::other)?;
                    Ok(f.id())
                },
            )
            .map_err(|e| e.to_string())?;
        let d = t.elapsed();
        if got != id {
            return Err(format!("reply id {got}, sent {id}"));
        }
        if measuring {
            lat.push(d.as_nanos().min(u32::MAX as u128) as u32);
            if start.elapsed() >= window {
                break;
            }
        } else if t0.elapsed() >= warmup {
            measuring = true;
            start = Instant::now();
        }
    }
    lat.sort_unstable();
    Ok(lat)
}

/// `latency`: one connection, Ping round trips, next to the echo floor.
fn latency(opts: &Opts) -> Result<Vec<Line>, String> {
    let dir = tempdir()?;
    let all = procs::all_cpus();
    if opts.pin {
        procs::pin(0, &[0])?;
    }
    let result = (|| {
        let sc = sidecar(opts, dir.path(), &Backend::Memory)?;
        if opts.pin {
            procs::pin(sc.pid, &[0])?;
        }
        let ping = Requests::new().ping;
        let lat = round_trips(&sc.socket, true, opts.warmup(), opts.window(), |out, id| {
            ping.put(out, id, None)
        })?;
        let mut line = Line::new(Scenario::Latency);
        let p50 = load::quantile_ns(&lat, 0.5) / 1000.0;
        line.num("rtt_p50_us", p50)
            .num("rtt_p99_us", load::quantile_ns(&lat, 0.99) / 1000.0);
        let sizes = (ping.payload_len(), ReplySizes::new().pong);
        let mut best: Option<(f64, f64, &str)> = None;
        for kind in echo::Kind::ALL {
            let floor = Floor::start(kind, dir.path())?;
            if opts.pin {
                procs::pin(floor.proc.pid(), &[0])?;
            }
            let lat = round_trips(
                &floor.socket,
                false,
                opts.warmup(),
                opts.window(),
                |out, id| echo_request(out, id, sizes.0, sizes.1),
            )?;
            let f50 = load::quantile_ns(&lat, 0.5) / 1000.0;
            let f99 = load::quantile_ns(&lat, 0.99) / 1000.0;
            line.num(&format!("floor_{}_p50_us", kind.name()), f50);
            if best.is_none_or(|b| f50 < b.0) {
                best = Some((f50, f99, kind.name()));
            }
        }
        let (f50, f99, kind) = best.expect("two floors");
        line.num("floor_p50_us", f50)
            .num("floor_p99_us", f99)
            .set("floor_kind", kind)
            .num("ratio", p50 / f50)
            .set("pinned", opts.pin);
        Ok(vec![line])
    })();
    if opts.pin {
        procs::pin(0, &all)?;
    }
    result
}

/// Calls/s, latency and server CPU of `shape` from `clients` connections.
fn measure(ctx: &Ctx, path: &Path, shape: &Shape, clients: usize, pid: u32) -> Result<Run, String> {
    let o = ctx.opts;
    ctx.rt.block_on(load::run(
        path,
        shape,
        clients,
        o.warmup(),
        o.window(),
        Some(pid),
    ))
}

/// `throughput`: full calls (Start + Finish) from N connections on the memory backend,
/// the four-frame call for comparison, and the echo floor at the same round trips.
fn throughput(ctx: &mut Ctx) -> Result<Vec<Line>, String> {
    let dir = tempdir()?;
    let sc = sidecar(ctx.opts, dir.path(), &Backend::Memory)?;
    let floors: Vec<Floor> = echo::Kind::ALL
        .into_iter()
        .map(|k| Floor::start(k, dir.path()))
        .collect::<Result<_, _>>()?;
    let mut lines = Vec::new();
    for &n in &ctx.opts.clients {
        let v2 = measure(ctx, &sc.socket, &Shape::V2, n, sc.pid)?;
        let v1 = measure(ctx, &sc.socket, &Shape::V1, n, sc.pid)?;
        let mut line = Line::new(Scenario::Throughput);
        line.set("clients", n)
            .num("calls_per_s", v2.calls_per_s())
            .num("call_p50_us", v2.quantile_us(0.5))
            .num("call_p99_us", v2.quantile_us(0.99))
            .opt("sidecar_cpu_per_frame_us", v2.cpu_per_frame_us())
            .opt("sidecar_sys_per_frame_us", v2.sys_per_frame_us())
            .num("calls_per_s_v1", v1.calls_per_s())
            .opt("sidecar_cpu_per_frame_us_v1", v1.cpu_per_frame_us());
        let mut best: Option<(f64, Option<f64>, Option<f64>, &str)> = None;
        for f in &floors {
            let r = measure(ctx, &f.socket, &Shape::V2.floor(), n, f.proc.pid())?;
            line.num(
                &format!("floor_{}_calls_per_s", f.kind.name()),
                r.calls_per_s(),
            );
            if best.is_none_or(|b| r.calls_per_s() > b.0) {
                best = Some((
                    r.calls_per_s(),
                    r.cpu_per_frame_us(),
                    r.sys_per_frame_us(),
                    f.kind.name(),
                ));
            }
        }
        let (fc, fcpu, fsys, kind) = best.expect("two floors");
        line.num("floor_calls_per_s", fc)
            .opt("floor_cpu_per_frame_us", fcpu)
            .opt("floor_sys_per_frame_us", fsys)
            .set("floor_kind", kind)
            .num("ratio", v2.calls_per_s() / fc);
        lines.push(line);
    }
    Ok(lines)
}

/// Totals of `INFO commandstats`: (all commands but INFO, script commands, script µs).
pub(crate) fn command_totals(r: &Redis) -> Result<(u64, u64, u64), String> {
    let mut all = 0;
    let (mut scripts, mut usec) = (0, 0);
    for (k, v) in r.info("commandstats")? {
        let Some(name) = k.strip_prefix("cmdstat_") else {
            continue;
        };
        let field = |f: &str| -> u64 {
            v.split(',')
                .find_map(|kv| kv.strip_prefix(f).and_then(|x| x.strip_prefix('=')))
                .and_then(|x| x.parse().ok())
                .unwrap_or(0)
        };
        if name == "info" {
            continue;
        }
        all += field("calls");
        if matches!(
            name,
            "evalsha" | "eval" | "fcall" | "fcall_ro" | "evalsha_ro"
        ) {
            scripts += field("calls");
            usec += field("usec");
        }
    }
    Ok((all, scripts, usec))
}

/// Redis CPU seconds so far (INFO cpu: works for a remote server too).
fn redis_cpu(r: &Redis) -> Result<f64, String> {
    let info = r.info("cpu")?;
    let get = |k: &str| -> f64 {
        info.iter()
            .find(|(n, _)| n == k)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0.0)
    };
    Ok(get("used_cpu_sys") + get("used_cpu_user"))
}

/// `redis`: the throughput run on the Redis backend, with what Redis did per call.
fn redis(ctx: &mut Ctx) -> Result<Vec<Line>, String> {
    let dir = tempdir()?;
    let redis = redis_server(ctx.opts, dir.path())?;
    let sc = sidecar(ctx.opts, dir.path(), &Backend::Redis(redis.url.clone()))?;
    let mut lines = Vec::new();
    for &n in &ctx.opts.clients {
        let before = command_totals(&redis)?;
        let cpu0 = redis_cpu(&redis)?;
        // Script cost per interval (µs per script call), sampled while the run goes.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let stop = stop.clone();
            let url = redis.url.clone();
            std::thread::spawn(move || -> Vec<f64> {
                let Ok(r) = Redis::external(&url) else {
                    return Vec::new();
                };
                let mut per = Vec::new();
                let mut last = command_totals(&r).ok();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    let now = command_totals(&r).ok();
                    if let (Some(a), Some(b)) = (last, now) {
                        if b.1 > a.1 {
                            per.push((b.2 - a.2) as f64 / (b.1 - a.1) as f64);
                        }
                    }
                    last = now;
                }
                per
            })
        };
        let t0 = Instant::now();
        let v2 = measure(ctx, &sc.socket, &Shape::V2, n, sc.pid);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut per = sampler.join().unwrap_or_default();
        let v2 = v2?;
        let wall = t0.elapsed().as_secs_f64();
        let after = command_totals(&redis)?;
        let cpu = redis_cpu(&redis)? - cpu0;
        // The counts cover the warm-up too: divide by every call made in the run.
        let total_calls = v2.total_calls.max(1) as f64;
        per.sort_by(f64::total_cmp);
        let v1 = measure(ctx, &sc.socket, &Shape::V1, n, sc.pid)?;
        let mut line = Line::new(Scenario::Redis);
        line.set("clients", n)
            .num("calls_per_s", v2.calls_per_s())
            .num("call_p50_us", v2.quantile_us(0.5))
            .num("call_p99_us", v2.quantile_us(0.99))
            .num("calls_per_s_v1", v1.calls_per_s())
            .num(
                "redis_cmds_per_call",
                (after.0 - before.0) as f64 / total_calls,
            )
            .num(
                "script_calls_per_call",
                (after.1 - before.1) as f64 / total_calls,
            )
            .opt("script_us_p50", per.get(per.len() / 2).copied())
            .num("redis_cpu_pct", 100.0 * cpu / wall)
            .num("redis_cpu_us_per_call", cpu * 1e6 / total_calls)
            .opt("sidecar_cpu_per_frame_us", v2.cpu_per_frame_us());
        lines.push(line);
    }
    Ok(lines)
}

/// The `open` scope's waiters (or `quota`'s), per the sidecar's status.
async fn waiting(c: &mut load::Conn, scope: &str) -> Result<u32, String> {
    let t = Template::new(Request::Status);
    let mut out = Vec::new();
    t.put(&mut out, u64::MAX, None);
    c.send_raw(&out).await.map_err(|e| e.to_string())?;
    let report = c.recv_status().await.map_err(|e| e.to_string())?;
    Ok(report
        .scopes
        .iter()
        .find(|s| s.name == scope)
        .map_or(0, |s| s.waiters))
}

/// One admin request on `c`, answered `Ok`.
async fn admin(c: &mut load::Conn, request: Request) -> Result<(), String> {
    let mut out = Vec::new();
    Template::new(request).put(&mut out, u64::MAX - 1, None);
    c.send_raw(&out).await.map_err(|e| e.to_string())?;
    c.recv_ok().await.map(|_| ()).map_err(|e| e.to_string())
}

/// `n` Starts on `scope`, pipelined over connections of at most 1000 calls each.
async fn start_waiters(
    path: &Path,
    scope: &str,
    n: usize,
) -> Result<Vec<(load::Conn, usize)>, String> {
    let start = Template::new(Request::Start(CallSpec {
        scope: scope.into(),
        est_tokens: Some(10),
        priority: None,
        est_input_tokens: None,
        est_output_tokens: None,
    }));
    let mut conns = Vec::new();
    let mut left = n;
    let mut id = 1u64;
    while left > 0 {
        let k = left.min(1000);
        let mut c = load::Conn::connect(path, true)
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(k * 40);
        for _ in 0..k {
            id += 1;
            start.put(&mut out, id, None);
        }
        c.send_raw(&out).await.map_err(|e| e.to_string())?;
        conns.push((c, k));
        left -= k;
    }
    Ok(conns)
}

async fn until_waiting(c: &mut load::Conn, scope: &str, n: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let w = waiting(c, scope).await? as usize;
        if w >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("only {w} of {n} calls of {scope} ever waited"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `waiters`: 10,000 calls waiting on an OPEN source (circuit_open = wait): memory,
/// CPU while they wait, and how long a force_close takes to grant them all; then as
/// many waiting on an exhausted quota (quota_full = wait), CPU while they wait.
fn waiters(ctx: &mut Ctx) -> Result<Vec<Line>, String> {
    let dir = tempdir()?;
    let sc = sidecar(ctx.opts, dir.path(), &Backend::Memory)?;
    let n = ctx.opts.waiters;
    let hold = ctx.opts.window();
    let (pid, path) = (sc.pid, sc.socket.clone());
    let mut line = Line::new(Scenario::Waiters);
    line.set("waiters", n);
    ctx.rt.block_on(async {
        let mut adm = load::Conn::connect(&path, true)
            .await
            .map_err(|e| e.to_string())?;
        line.num("rss_idle_mib", procs::rss_mib(pid)?);

        // OPEN source.
        admin(
            &mut adm,
            Request::ForceOpen {
                source: "wo".into(),
                seconds: 3600.0,
            },
        )
        .await?;
        let conns = start_waiters(&path, "open", n).await?;
        until_waiting(&mut adm, "open", n).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (cpu0, t0) = (procs::cpu_time(pid)?, Instant::now());
        tokio::time::sleep(hold).await;
        let cpu = procs::cpu_time(pid)? - cpu0;
        let rss_open = procs::rss_mib(pid)?;
        line.num(
            "cpu_pct_while_waiting",
            100.0 * cpu.as_secs_f64() / t0.elapsed().as_secs_f64(),
        );
        let t = Instant::now();
        let readers: Vec<_> = conns
            .into_iter()
            .map(|(mut c, k)| {
                tokio::spawn(async move {
                    for i in 0..k {
                        c.recv_started().await.map_err(|e| e.to_string())?;
                        if i % 50 == 0 {}
                    }
                    Ok::<_, String>(c)
                })
            })
            .collect();

        admin(
            &mut adm,
            Request::ForceClose {
                source: "wo".into(),
            },
        )
        .await?;

        let mut done = Vec::new();
        for r in readers {
            done.push(r.await.map_err(|e| e.to_string())??);
        }
        line.num("release_ms", t.elapsed().as_secs_f64() * 1e3);
        drop(done);

        // Exhausted quota: one call takes the only request of the minute and holds it.
        let mut hog = load::Conn::connect(&path, true)
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        Template::new(Request::Start(CallSpec {
            scope: "quota".into(),
            est_tokens: Some(10),
            priority: None,
            est_input_tokens: None,
            est_output_tokens: None,
        }))
        .put(&mut out, 1, None);
        hog.send_raw(&out).await.map_err(|e| e.to_string())?;
        hog.recv_started().await.map_err(|e| e.to_string())?;
        let conns = start_waiters(&path, "quota", n).await?;
        until_waiting(&mut adm, "quota", n).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (cpu0, t0) = (procs::cpu_time(pid)?, Instant::now());
        tokio::time::sleep(hold).await;
        let cpu = procs::cpu_time(pid)? - cpu0;
        line.num(
            "quota_cpu_pct_while_waiting",
            100.0 * cpu.as_secs_f64() / t0.elapsed().as_secs_f64(),
        );
        let rss_quota = procs::rss_mib(pid)?;
        line.num("rss_mib", rss_open.max(rss_quota));
        drop(conns);
        Ok::<_, String>(())
    })?;
    Ok(vec![line])
}

/// DESIGN §7a: the fleet driver (`bench/fleet/fleet.py`) run once with this bench's
/// settings; its JSON line becomes the scenario's line.
fn fleet(opts: &Opts) -> Line {
    let f = &opts.fleet;
    let mut line = Line::new(Scenario::Fleet);
    let out = std::process::Command::new(&opts.python)
        .arg(&f.driver)
        .args([
            "--hosts",
            &f.hosts.to_string(),
            "--workers",
            &f.workers.to_string(),
        ])
        .args([
            "--seconds",
            &opts.seconds.to_string(),
            "--upstream",
            f.upstream.name(),
        ])
        .args(["--rpm", &f.rpm.to_string(), "--tpm", &f.tpm.to_string()])
        .args(["--config", &f.config, "--fault", &f.fault])
        .args(["--fault-for", &f.fault_for.to_string()])
        .args(["--degraded-share", &f.degraded_share])
        .args(f.cluster.then_some("--cluster"))
        .args(["--foreign", &f.foreign.to_string(), "--observe", &f.observe])
        .args(f.auto.then_some("--auto"))
        .args(["--learn-rate", &f.learn_rate])
        .args(["--config", &f.config, "--sidecar"])
        .arg(&opts.sidecar_bin)
        .output();
    let parsed = out.as_ref().ok().and_then(|o| {
        let text = String::from_utf8_lossy(&o.stdout);
        let last = text.lines().last()?.to_string();
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&last).ok()
    });
    match parsed {
        Some(m) => {
            for (k, v) in m {
                line.set(&k, v);
            }
            line.set("scenario", Scenario::Fleet.name());
        }
        None => {
            let why = match &out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            line.set("error", format!("fleet driver failed: {why}"));
        }
    }
    line
}
