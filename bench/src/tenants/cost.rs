//! `--scenario tenants`, part `cost` (issue 30: "added latency of a tenant-carrying
//! call vs one without <= 10 % on memory and on Redis (same run), and no extra Redis
//! round trip per call"). One sidecar on memory and one on a throwaway redis-server,
//! both with the bench scopes plus `tc`: the bench scope's source, priced, with
//! tenants whose default limits are a token bucket and a dollar budget far above
//! what the run spends (so every call takes the whole tenant path: the ledger's
//! check, its reservation in the same step as the source's, its settlement, and
//! never a refusal). One connection (protocol 3) makes full calls back to back:
//! `Start` on `bench` (no tenants: today's call) and `StartTenant` on `tc`,
//! alternated call by call (the pair's order flipping every pair), so both see the
//! same state of the machine: on this VM a call's latency moves by 2x with how idle
//! the cores are, between runs and within one, which alternating whole runs of each
//! turned into ratios of 0.2 to 2.6. The figures are the medians of [`ROUNDS`]
//! windows' p50 call latencies. Apart from them, each call alone in a window of its
//! own: on Redis, `INFO commandstats` the commands and script time per call, and
//! MONITOR how many commands the sidecar sent per call (its round trips) and how many
//! its scripts ran.

use std::sync::Arc;

use ipc_protocol::{CallSpec, Request};

use crate::context::tempdir;
use crate::frames::{Template, SCOPE};
use crate::load::{self, Shape};
use crate::scenarios::command_totals;
use crate::target::{Backend, Redis, Sidecar};
use crate::{Line, Opts};

/// Alternations of the two calls.
const ROUNDS: usize = 3;

/// The scope `tc`.
const SCOPE_TC: &str = r#"
[scopes.tc]
circuit_open = "fail_fast"
quota_full = "fail_fast"
[scopes.tc.pacer]
initial = 100000
min = 1
max = 100000
[scopes.tc.tenants]
default = { tpm = 1000000000000, usd_per_day = 1000000.0 }
[[scopes.tc.sources]]
name = "tca"
tpm = 1000000000000
rpm = 1000000000000
est_tokens = 10
timeout = "60s"
usd_per_1m_input = 3.0
usd_per_1m_output = 15.0
"#;

fn start(scope: &str, tenant: Option<&str>) -> Arc<Template> {
    let spec = CallSpec {
        scope: scope.into(),
        est_tokens: Some(10),
        priority: None,
        est_input_tokens: None,
        est_output_tokens: None,
    };
    Arc::new(Template::new(match tenant {
        None => Request::Start(spec),
        Some(t) => Request::StartTenant {
            spec,
            tenant: t.into(),
        },
    }))
}

/// What one of the two calls measured over the rounds.
#[derive(Default)]
struct Side {
    /// p50 call latency of each round, µs.
    p50: Vec<f64>,
    /// Redis commands and script calls per call, summed over the rounds.
    cmds: u64,
    scripts: u64,
    /// µs Redis spent in the scripts, summed over the rounds.
    script_us: u64,
    calls: u64,
}

impl Side {
    fn median(&self) -> f64 {
        let mut v = self.p50.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// The two calls.
fn shapes() -> [Shape; 2] {
    [
        Shape::V3(start(SCOPE, None)),
        Shape::V3(start("tc", Some("acme"))),
    ]
}

/// Both calls on `sc`: the latencies interleaved call by call ([`interleaved`]), then
/// (`redis`) each call's Redis commands in a window of its own.
async fn sides(opts: &Opts, sc: &Sidecar, redis: Option<&Redis>) -> Result<(Side, Side), String> {
    let shapes = shapes();
    let mut out = [Side::default(), Side::default()];
    for _ in 0..ROUNDS {
        let p50 = interleaved(sc, &shapes, opts.warmup(), opts.window()).await?;
        for (side, p) in out.iter_mut().zip(p50) {
            side.p50.push(p);
        }
    }
    if let Some(redis) = redis {
        for (shape, side) in shapes.iter().zip(out.iter_mut()) {
            let r0 = command_totals(redis)?;
            let r = load::run(&sc.socket, shape, 1, opts.warmup(), opts.window(), None).await?;
            let r1 = command_totals(redis)?;
            // The totals span the warmup: per call of the whole run (`total_calls`).
            side.cmds += r1.0 - r0.0;
            side.scripts += r1.1 - r0.1;
            side.script_us += r1.2 - r0.2;
            side.calls += r.total_calls;
        }
    }
    let [a, b] = out;
    Ok((a, b))
}

/// p50 latency (µs) of each of `shapes` over `window` after `warmup`, one connection
/// making them by turns: pairs of one call each, the pair's order flipping every pair.
async fn interleaved(
    sc: &Sidecar,
    shapes: &[Shape; 2],
    warmup: std::time::Duration,
    window: std::time::Duration,
) -> Result<[f64; 2], String> {
    use std::time::Instant;
    let q = crate::frames::Requests::new();
    let mut c = load::Conn::connect_version(&sc.socket, Some(3))
        .await
        .map_err(|e| e.to_string())?;
    let mut ns: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
    let t0 = Instant::now();
    let mut flip = 0;
    while t0.elapsed() < warmup + window {
        let counted = t0.elapsed() >= warmup;
        for k in [flip, 1 - flip] {
            let s = Instant::now();
            c.call(&shapes[k], &q).await.map_err(|e| e.to_string())?;
            if counted {
                ns[k].push(u32::try_from(s.elapsed().as_nanos()).unwrap_or(u32::MAX));
            }
        }
        flip = 1 - flip;
    }
    Ok(ns.map(|mut v| {
        v.sort_unstable();
        load::quantile_ns(&v, 0.5) / 1e3
    }))
}

/// Calls of each kind [`round_trips`] watches.
const WATCHED: u64 = 200;

/// Redis commands per call of `shape` on `sc`, as MONITOR shows them between two
/// markers around [`WATCHED`] calls: (sent by the sidecar to run the gate — its
/// round trips: `FCALL` or `EVALSHA`, a pipeline counted per command —, run by its
/// scripts, and every other command the sidecar sent meanwhile: its background
/// tasks, the host heartbeat's scripts and the connection's `PING`, which a window
/// meets by chance). `INFO commandstats` cannot tell them apart: it counts a
/// script's `redis.call`s too. A call that sent a command of another kind would
/// show as about one background command per call.
async fn round_trips(
    redis: &Redis,
    sc: &Sidecar,
    shape: &Shape,
) -> Result<(f64, f64, f64), String> {
    let q = crate::frames::Requests::new();
    let mut c = load::Conn::connect_version(&sc.socket, Some(3))
        .await
        .map_err(|e| e.to_string())?;
    // Warm up: scripts loaded, the tenant's ledger made.
    c.call(shape, &q).await.map_err(|e| e.to_string())?;
    let mut mon = redis.connect()?;
    mon.cmd(&["MONITOR"])?;
    let marker = |m: &str| redis.cmd(&["ECHO", m]).map(|_| ());
    marker("polygate-bench-begin")?;
    for _ in 0..WATCHED {
        c.call(shape, &q).await.map_err(|e| e.to_string())?;
    }
    marker("polygate-bench-end")?;
    let (mut sent, mut scripted, mut background, mut phase) = (0u64, 0u64, 0u64, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while phase < 2 {
        if std::time::Instant::now() > deadline {
            return Err("MONITOR never showed the bench's markers".into());
        }
        let line = mon.reply()?;
        let Some((client, args)) = crate::drivers::parse_monitor(&line) else {
            continue;
        };
        let name = args
            .first()
            .map(|a| a.to_ascii_uppercase())
            .unwrap_or_default();
        if name == "ECHO"
            && args
                .get(1)
                .is_some_and(|a| a.starts_with("polygate-bench-"))
        {
            phase += 1;
            continue;
        }
        if phase == 1 {
            if client.ends_with(" lua") {
                scripted += 1;
            } else if name == "FCALL" || name == "EVALSHA" {
                sent += 1;
            } else {
                background += 1;
            }
        }
    }
    let per = |n: u64| n as f64 / WATCHED as f64;
    Ok((per(sent), per(scripted), per(background)))
}

/// Fills the cost keys of `l`.
pub async fn measure(l: &mut Line, opts: &Opts) -> Result<(), String> {
    let dir = tempdir()?;
    let mem_dir = dir.path().join("memory");
    let redis_dir = dir.path().join("redis");
    for d in [&mem_dir, &redis_dir] {
        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    }
    let mem = Sidecar::start_with(&opts.sidecar_bin, &mem_dir, &Backend::Memory, SCOPE_TC)?;
    let redis = Redis::start(&redis_dir)?;
    let on_redis = Sidecar::start_with(
        &opts.sidecar_bin,
        &redis_dir,
        &Backend::Redis(redis.url.clone()),
        SCOPE_TC,
    )?;
    let (plain, tenant) = sides(opts, &mem, None).await?;
    let (rplain, rtenant) = sides(opts, &on_redis, Some(&redis)).await?;
    let plain_rt = round_trips(&redis, &on_redis, &Shape::V3(start(SCOPE, None))).await?;
    let tenant_rt = round_trips(&redis, &on_redis, &Shape::V3(start("tc", Some("acme")))).await?;
    l.num("redis_round_trips_per_call", plain_rt.0)
        .num("redis_round_trips_per_call_tenant", tenant_rt.0)
        .num("redis_script_cmds_per_call", plain_rt.1)
        .num("redis_script_cmds_per_call_tenant", tenant_rt.1)
        .num("redis_background_cmds_per_call", plain_rt.2)
        .num("redis_background_cmds_per_call_tenant", tenant_rt.2);
    let per = |n: u64, s: &Side| n as f64 / s.calls.max(1) as f64;
    l.num("cost_us_memory", plain.median())
        .num("cost_us_memory_tenant", tenant.median())
        .num("cost_ratio_memory", tenant.median() / plain.median())
        .num("cost_added_us_memory", tenant.median() - plain.median())
        .num("cost_us_redis", rplain.median())
        .num("cost_us_redis_tenant", rtenant.median())
        .num("cost_ratio_redis", rtenant.median() / rplain.median())
        .num("cost_added_us_redis", rtenant.median() - rplain.median())
        .num("redis_cmds_per_call", per(rplain.cmds, &rplain))
        .num("redis_cmds_per_call_tenant", per(rtenant.cmds, &rtenant))
        .num("script_calls_per_call", per(rplain.scripts, &rplain))
        .num(
            "script_calls_per_call_tenant",
            per(rtenant.scripts, &rtenant),
        )
        .num("redis_script_us_per_call", per(rplain.script_us, &rplain))
        .num(
            "redis_script_us_per_call_tenant",
            per(rtenant.script_us, &rtenant),
        );
    Ok(())
}
