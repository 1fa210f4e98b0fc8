//! `--scenario status-flood` (DESIGN §12, issue 21 item 6): does a client flooding
//! `StatusJson` slow the calls of a healthy one? The sidecar runs the bench config
//! plus a scope of `--sources` sources (3,000 by default, the case); one
//! healthy connection makes full calls (`Start` + `Finish`, blocking, one at a time)
//! for the window alone, then again while [`FLOODERS`] other connections send
//! `StatusJson` back to back, [`DEPTH`] pipelined each. The figures: the healthy
//! call's p50 and p99 both ways, their ratio (the goal: p50 within 2×), and how many
//! status replies the flooders got per second.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipc_protocol::Request;

use crate::frames::{BlockingConn, Requests, Template};
use crate::load::quantile_ns;
use crate::target::{Backend, Sidecar};
use crate::{Line, Opts, Scenario};

/// Connections flooding `StatusJson` (the reproduction used two).
const FLOODERS: usize = 2;
/// `StatusJson` requests each flooder keeps in flight.
const DEPTH: usize = 4;

/// A scope `big` of `n` sources (each its own breaker and quota: status walks all).
fn big_scope(n: usize) -> String {
    let mut s = String::from("[scopes.big]\n");
    for i in 0..n {
        s.push_str(&format!(
            "[[scopes.big.sources]]\nname = \"big-{i}\"\ntpm = 1000000\nrpm = 10000\n"
        ));
    }
    s
}

/// Full calls on one connection for `window` after `warmup`: sorted ns per call.
fn healthy(socket: &Path, warmup: Duration, window: Duration) -> Result<Vec<u32>, String> {
    let r = Requests::new();
    let mut c = BlockingConn::connect(socket, true).map_err(|e| e.to_string())?;
    let mut lat = Vec::with_capacity(1 << 16);
    let t0 = Instant::now();
    let mut start: Option<Instant> = None;
    loop {
        let t = Instant::now();
        let id = c.id();
        let permit = c
            .round_trip(
                |out| r.start.put(out, id, None),
                |f| f.started_permit().map_err(std::io::Error::other),
            )
            .map_err(|e| e.to_string())?;
        let id = c.id();
        c.round_trip(
            |out| r.finish.put(out, id, Some(permit)),
            |f| f.check().map_err(std::io::Error::other),
        )
        .map_err(|e| e.to_string())?;
        let d = t.elapsed();
        match start {
            Some(s) => {
                lat.push(d.as_nanos().min(u32::MAX as u128) as u32);
                if s.elapsed() >= window {
                    break;
                }
            }
            None if t0.elapsed() >= warmup => start = Some(Instant::now()),
            None => {}
        }
    }
    lat.sort_unstable();
    Ok(lat)
}

/// Flood `StatusJson` until `stop`; counts replies in `got`.
fn flood(socket: &Path, stop: &AtomicBool, got: &AtomicU64) -> Result<(), String> {
    let t = Template::new(Request::StatusJson);
    let mut c = BlockingConn::connect(socket, true).map_err(|e| e.to_string())?;
    while !stop.load(Ordering::Relaxed) {
        let ids: Vec<u64> = (0..DEPTH).map(|_| c.id()).collect();
        c.burst(
            DEPTH,
            |out| {
                for &id in &ids {
                    t.put(out, id, None);
                }
            },
            |f| {
                f.check().map_err(std::io::Error::other)?;
                got.fetch_add(1, Ordering::Relaxed);
                Ok(())
            },
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

pub fn run(opts: &Opts) -> Result<Vec<Line>, String> {
    let dir = tempfile::Builder::new()
        .prefix("polygate-bench-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let extra = big_scope(opts.sources);
    let sc = match &opts.socket {
        Some(s) => Sidecar::external(s)?,
        None => Sidecar::start_with(&opts.sidecar_bin, dir.path(), &Backend::Memory, &extra)?,
    };
    let (warmup, window) = (opts.warmup(), opts.window());
    let quiet = healthy(&sc.socket, warmup, window)?;

    let stop = Arc::new(AtomicBool::new(false));
    let got = Arc::new(AtomicU64::new(0));
    let flooders: Vec<_> = (0..FLOODERS)
        .map(|_| {
            let (socket, stop, got) = (sc.socket.clone(), stop.clone(), got.clone());
            std::thread::spawn(move || flood(&socket, &stop, &got))
        })
        .collect();
    // Let the flood start before the healthy client measures (its warm-up).
    let before = got.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let flooded = healthy(&sc.socket, warmup, window);
    let statuses = got.load(Ordering::Relaxed) - before;
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().map_err(|_| "a flooder panicked".to_string())??;
    }
    let flooded = flooded?;
    let us = |v: &[u32], q: f64| quantile_ns(v, q) / 1e3;
    let mut l = Line::new(Scenario::StatusFlood);
    l.set("sources", opts.sources)
        .num("call_p50_us", us(&quiet, 0.5))
        .num("call_p99_us", us(&quiet, 0.99))
        .num("call_p50_us_flooded", us(&flooded, 0.5))
        .num("call_p99_us_flooded", us(&flooded, 0.99))
        .num(
            "p50_ratio",
            us(&flooded, 0.5) / us(&quiet, 0.5).max(f64::MIN_POSITIVE),
        )
        .num("status_replies_per_s", statuses as f64 / secs);
    Ok(vec![l])
}
