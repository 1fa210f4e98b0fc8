//! §15 queues keep someone looking (the napper rule, engine/acquire.rs header): when
//! the napper leaves while the head of the queue is mid-turn on one freed unit, that
//! turn becomes a chain, so its grant hands on and time-based refills still wake the
//! rest. Found by review: before the fix the others slept to their stall edge.
mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use polygate::backend::memory::MemoryBackend;
use polygate::backend::Outcome;
use polygate::config::{ScopeConfig, SourceConfig};
use polygate::engine::{Engine, EngineError};
use support::engine_cfg::*;

const OWNER: u64 = 1;

fn limited(name: &str, rpm: Option<u64>) -> SourceConfig {
    let mut s = source(name);
    s.rpm = rpm;
    s
}

fn scopes(src: SourceConfig, stall: Duration) -> Vec<ScopeConfig> {
    let mut w = scope("w", vec![src.clone()]);
    w.poll_interval = ms(50);
    w.stall_window = stall;
    w.pacer.initial = 100_000.0;
    w.pacer.max = 100_000.0;
    let class = |name: &str, weight: f64| polygate::config::PriorityConfig {
        name: name.into(),
        weight,
        reserve: 0.0,
        limit: 1.0,
    };
    w.priorities = vec![class("interactive", 8.0), class("batch", 1.0)];
    w.default_priority = 1;
    let mut hog = scope("hog", vec![src]);
    hog.quota_full = polygate::config::Mode::FailFast;
    hog.pacer.initial = 100_000.0;
    hog.pacer.max = 100_000.0;
    vec![w, hog]
}

async fn drain(e: &Engine<MemoryBackend>) -> Vec<u64> {
    let mut held = Vec::new();
    loop {
        let c = e.begin_call(OWNER, "hog", None).unwrap();
        match e.acquire(OWNER, c).await {
            Ok(g) => held.push(g.permit),
            Err(EngineError::Exhausted { .. }) => return held,
            Err(other) => panic!("draining: {other:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_napper_leaving_while_the_head_is_mid_turn_leaves_a_looker() {
    let e = engine(&config(scopes(limited("q", Some(60)), secs(3600))));
    let held = drain(&e).await;
    let order = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let spawn = |name: &'static str, class: &'static str| {
        let (e2, order) = (e.clone(), order.clone());
        let call = e.begin_call_as(OWNER, "w", None, Some(class)).unwrap();
        tokio::spawn(async move {
            e2.acquire(OWNER, call).await?;
            order.lock().unwrap().push(name);
            Ok::<(), EngineError>(())
        })
    };
    let a = spawn("A", "batch"); // the napper
    tokio::time::sleep(ms(1)).await;
    let _b = spawn("B", "interactive");
    tokio::time::sleep(ms(1)).await;
    let _c = spawn("C", "interactive");
    tokio::time::sleep(ms(1)).await;
    // The napper leaves (cancelled) and, in the same instant, one unit is freed
    // (a refund: wake_next gives B a non-chain turn before A's Place drops).
    a.abort();
    e.report(OWNER, held[0], Outcome::Cancelled).await.unwrap();
    // rpm = 60 refills one request per second; with someone napping C is granted
    // within ~1 s + poll_interval.
    tokio::time::sleep(secs(5)).await;
    let got = order.lock().unwrap().clone();
    assert_eq!(
        got,
        vec!["B", "C"],
        "C never woke: the queue lost its napper"
    );
}

#[tokio::test(start_paused = true)]
async fn no_waiter_sleeps_to_its_stall_edge_while_the_quota_refills() {
    let e = engine(&config(scopes(limited("q", Some(60)), secs(20))));
    let held = drain(&e).await;
    let spawn = |class: &'static str| {
        let e2 = e.clone();
        let call = e.begin_call_as(OWNER, "w", None, Some(class)).unwrap();
        tokio::spawn(async move { e2.acquire(OWNER, call).await.map(|_| ()) })
    };
    let a = spawn("batch");
    tokio::time::sleep(ms(1)).await;
    let b = spawn("interactive");
    tokio::time::sleep(ms(1)).await;
    let c = spawn("interactive");
    tokio::time::sleep(ms(1)).await;
    let t0 = tokio::time::Instant::now();
    a.abort();
    e.report(OWNER, held[0], Outcome::Cancelled).await.unwrap();
    b.await.unwrap().unwrap();
    let r = tokio::time::timeout(secs(60), c)
        .await
        .expect("C ends")
        .unwrap();
    assert!(
        r.is_ok() && t0.elapsed() < secs(5),
        "C: {r:?} only after {:?}: it slept to its stall edge while rpm refilled 1/s",
        t0.elapsed()
    );
}
