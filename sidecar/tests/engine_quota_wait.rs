//! §5 quota wait at scale: many calls waiting on an exhausted quota (quota_full =
//! wait) cost passes per scope and size line, not per waiter; they are granted in
//! arrival order as tokens return; a small call is not held behind a much bigger
//! one; a cancelled poller hands its turn on; stall still ends every waiter on
//! time; and a §15 queue keeps someone looking when its napper leaves mid-turn. Memory backend, tokio's paused clock: deterministic, no real time spent.
//! Every case runs under a (virtual) timeout, so a lost wake-up fails it instead of
//! hanging.

mod support;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use polygate::backend::memory::MemoryBackend;
use polygate::backend::{FailureKind, Outcome};
use polygate::config::{ScopeConfig, SourceConfig};
use polygate::engine::{Engine, EngineError, Exhaustion};
use support::engine_cfg::*;
use tokio::time::Instant;

const OWNER: u64 = 1;

/// Runs `f` under a virtual-time timeout (the paused clock advances through sleeps).
async fn within<T>(limit: Duration, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, f)
        .await
        .expect("timed out: a waiter was never woken")
}

/// A source with `rpm` requests per minute (capacity one minute's worth) and `tpm`.
fn limited(name: &str, rpm: Option<u64>, tpm: Option<u64>) -> SourceConfig {
    let mut s = source(name);
    s.rpm = rpm;
    s.tpm = tpm;
    s
}

/// The waiting scope ("w", quota_full = wait, 50 ms poll) and a fail-fast scope
/// ("hog") on the same source, used to drain the quota.
fn scopes(src: SourceConfig, stall: Duration) -> Vec<ScopeConfig> {
    let mut w = scope("w", vec![src.clone()]);
    w.poll_interval = ms(50);
    w.stall_window = stall;
    w.pacer.initial = 100_000.0;
    w.pacer.max = 100_000.0;
    let mut hog = scope("hog", vec![src]);
    hog.quota_full = polygate::config::Mode::FailFast;
    hog.pacer.initial = 100_000.0;
    hog.pacer.max = 100_000.0;
    vec![w, hog]
}

/// Take grants in the fail-fast scope until the quota refuses; returns the permits.
async fn drain(e: &Engine<MemoryBackend>, est: Option<u64>) -> Vec<u64> {
    let mut held = Vec::new();
    loop {
        let c = e.begin_call(OWNER, "hog", est).unwrap();
        match e.acquire(OWNER, c).await {
            Ok(g) => held.push(g.permit),
            Err(EngineError::Exhausted {
                reason: Exhaustion::QuotaExhausted,
                ..
            }) => return held,
            Err(other) => panic!("draining: {other:?}"),
        }
        assert!(held.len() < 100_000, "the quota never refused");
    }
}

/// §5: the call ended `stalled`, after its stall window and within it +
/// `poll_interval` (50 ms here).
fn assert_stalled_on_time<T: std::fmt::Debug>(
    r: Result<T, EngineError>,
    took: Duration,
    stall: Duration,
) {
    assert!(
        matches!(
            r,
            Err(EngineError::Exhausted {
                reason: Exhaustion::Stalled,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(took > stall && took <= stall + ms(50), "{took:?}");
}

/// Start one waiting Acquire per label in scope "w", one after another (each has run
/// its first pass and queued before the next starts), each on a call `begin` opens;
/// each records its label when granted.
async fn spawn_waiters<T: Send + 'static>(
    e: &Arc<Engine<MemoryBackend>>,
    labels: impl IntoIterator<Item = T>,
    begin: impl Fn() -> u64,
    order: &Arc<Mutex<Vec<T>>>,
) -> Vec<tokio::task::JoinHandle<Result<(), EngineError>>> {
    let mut v = Vec::new();
    for label in labels {
        let (e2, order) = (e.clone(), order.clone());
        let call = begin();
        v.push(tokio::spawn(async move {
            e2.acquire(OWNER, call).await?;
            order.lock().unwrap().push(label);
            Ok(())
        }));
        tokio::time::sleep(ms(1)).await;
    }
    v
}

/// [`spawn_waiters`] of `n` calls estimating `est`, labelled by their index from
/// `base`.
async fn waiters(
    e: &Arc<Engine<MemoryBackend>>,
    base: usize,
    n: usize,
    est: Option<u64>,
    order: &Arc<Mutex<Vec<usize>>>,
) -> Vec<tokio::task::JoinHandle<Result<(), EngineError>>> {
    let begin = || e.begin_call(OWNER, "w", est).unwrap();
    spawn_waiters(e, base..base + n, begin, order).await
}

#[tokio::test(start_paused = true)]
async fn many_quota_waiters_cost_passes_per_scope_not_per_waiter() {
    within(secs(60), async {
        // rpm = 1: once drained, nothing returns for a minute.
        let e = engine(&config(scopes(limited("q", Some(1), None), secs(3600))));
        let _held = drain(&e, None).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let n = 2_000;
        let tasks = waiters(&e, 0, n, None, &order).await;
        assert_eq!(e.status_local()[0].waiters as usize, n);
        let p0 = e.passes_run();
        tokio::time::sleep(secs(2)).await;
        let passes = e.passes_run() - p0;
        // One poller naps poll_interval × [0.5, 1.0]: ≤ 80 passes in 2 s. Per waiter
        // it would be ≥ 2,000 × 40.
        assert!(
            passes <= 100,
            "{passes} passes in 2 s for {n} waiters of one size: the cost grew with the waiters"
        );
        assert!(passes >= 30, "{passes} passes: the poller stopped polling");
        assert!(
            order.lock().unwrap().is_empty(),
            "nothing can be granted yet"
        );
        for t in tasks {
            t.abort();
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn returning_tokens_grant_the_waiters_in_arrival_order() {
    within(secs(120), async {
        // rpm = 60: one request returns per second.
        let e = engine(&config(scopes(limited("q", Some(60), None), secs(3600))));
        let _held = drain(&e, None).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let n = 12;
        let tasks = waiters(&e, 0, n, None, &order).await;
        let p0 = e.passes_run();
        let t0 = Instant::now();
        for t in tasks {
            t.await.unwrap().expect("granted");
        }
        let took = t0.elapsed();
        assert_eq!(*order.lock().unwrap(), (0..n).collect::<Vec<_>>(), "FIFO");
        assert!(
            took <= secs(n as u64) + ms(100),
            "one per second as the quota refills, each within a poll: {took:?}"
        );
        // Per second: the poller's naps (≤ 40) plus the one hand-off pass.
        let passes = e.passes_run() - p0;
        assert!(passes <= 45 * n as u64, "{passes} passes");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_small_call_is_not_held_behind_a_much_bigger_one() {
    within(secs(120), async {
        // tpm = 6000: 100 tokens per second, capacity 6000.
        let e = engine(&config(scopes(limited("t", None, Some(6_000)), secs(3600))));
        let _held = drain(&e, Some(1_000)).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        // Index 0: needs 3000 (30 s of refill); index 1: needs 10 (0.1 s).
        let mut tasks = waiters(&e, 0, 1, Some(3_000), &order).await;
        tasks.extend(waiters(&e, 1, 1, Some(10), &order).await);
        let t0 = Instant::now();
        while order.lock().unwrap().is_empty() {
            tokio::time::sleep(ms(10)).await;
        }
        assert_eq!(*order.lock().unwrap(), vec![1], "the small one first");
        assert!(t0.elapsed() <= ms(400), "{:?}", t0.elapsed());
        tasks.remove(1).await.unwrap().unwrap();
        tasks.remove(0).await.unwrap().expect("the big one later");
        assert_eq!(*order.lock().unwrap(), vec![1, 0]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_poller_hands_its_turn_on() {
    within(secs(60), async {
        let e = engine(&config(scopes(limited("q", Some(60), None), secs(3600))));
        let _held = drain(&e, None).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = waiters(&e, 0, 3, None, &order).await;
        tokio::time::sleep(ms(200)).await;
        // The poller (first in line) goes away while waiting.
        tasks.remove(0).abort();
        let t0 = Instant::now();
        // The next in line takes over polling and gets the next request (≤ 1 s).
        let next = tasks.remove(0);
        next.await.unwrap().expect("granted");
        assert!(t0.elapsed() <= secs(1) + ms(60), "{:?}", t0.elapsed());
        assert_eq!(*order.lock().unwrap(), vec![1]);
        tasks.remove(0).await.unwrap().expect("granted");
        assert_eq!(*order.lock().unwrap(), vec![1, 2]);
        assert_eq!(e.status_local()[0].waiters, 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_freed_reservation_wakes_the_line_at_once() {
    within(secs(60), async {
        // tpm = 600 and a call of 600: one grant takes the whole bucket.
        let e = engine(&config(scopes(limited("t", None, Some(600)), secs(3600))));
        let held = drain(&e, Some(600)).await;
        assert_eq!(held.len(), 1);
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = waiters(&e, 0, 3, Some(300), &order).await;
        tokio::time::sleep(ms(500)).await;
        assert!(order.lock().unwrap().is_empty());
        // A transient failure refunds the 600 tokens: two waiters fit at once.
        let t0 = Instant::now();
        e.report(OWNER, held[0], Outcome::failure(FailureKind::Timeout))
            .await
            .unwrap();
        tasks.remove(0).await.unwrap().unwrap();
        tasks.remove(0).await.unwrap().unwrap();
        assert!(
            t0.elapsed() < ms(5),
            "woken by the refund, not by a nap: {:?}",
            t0.elapsed()
        );
        assert_eq!(*order.lock().unwrap(), vec![0, 1]);
        tasks.remove(0).abort();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn stall_still_ends_every_quota_waiter_on_time() {
    within(secs(60), async {
        let stall = secs(2);
        let e = engine(&config(scopes(limited("q", Some(1), None), stall)));
        let _held = drain(&e, None).await;
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..50 {
            let e2 = e.clone();
            let call = e.begin_call(OWNER, "w", None).unwrap();
            tasks.push(tokio::spawn(async move {
                let r = e2.acquire(OWNER, call).await;
                (r, Instant::now())
            }));
        }
        for t in tasks {
            let (r, at) = t.await.unwrap();
            assert_stalled_on_time(r, at - t0, stall);
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_quota_reset_wakes_every_follower() {
    within(secs(60), async {
        let e = engine(&config(scopes(limited("q", Some(60), None), secs(3600))));
        let _held = drain(&e, None).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let tasks = waiters(&e, 0, 5, None, &order).await;
        tokio::time::sleep(ms(300)).await;
        // An operator's reset refills the bucket: all five fit now, and none may
        // wait for a nap (the followers have none) or a refill.
        let t0 = Instant::now();
        e.reset("q").await.unwrap();
        for t in tasks {
            t.await.unwrap().expect("granted");
        }
        assert!(t0.elapsed() < ms(5), "{:?}", t0.elapsed());
        assert_eq!(order.lock().unwrap().len(), 5);
    })
    .await;
}

/// Scope "w" with two classes (8:1), the fail-fast "hog" on the same source.
fn classed(src: SourceConfig, stall: Duration) -> Vec<ScopeConfig> {
    let mut v = scopes(src, stall);
    let class = |name: &str, weight: f64| polygate::config::PriorityConfig {
        name: name.into(),
        weight,
        reserve: 0.0,
        limit: 1.0,
    };
    v[0].priorities = vec![class("interactive", 8.0), class("batch", 1.0)];
    v[0].default_priority = 1;
    v
}

/// [`spawn_waiters`] of `n` calls of class `class`, labelled by it.
async fn class_waiters(
    e: &Arc<Engine<MemoryBackend>>,
    n: usize,
    class: &'static str,
    order: &Arc<Mutex<Vec<&'static str>>>,
) -> Vec<tokio::task::JoinHandle<Result<(), EngineError>>> {
    let begin = || e.begin_call_as(OWNER, "w", None, Some(class)).unwrap();
    spawn_waiters(e, std::iter::repeat_n(class, n), begin, order).await
}

#[tokio::test(start_paused = true)]
async fn classed_quota_waiters_also_cost_per_scope_and_keep_the_class_order() {
    within(secs(120), async {
        let e = engine(&config(classed(limited("q", Some(60), None), secs(3600))));
        let _held = drain(&e, None).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = class_waiters(&e, 500, "batch", &order).await;
        tasks.extend(class_waiters(&e, 500, "interactive", &order).await);
        // Nothing returns for a second after the drain... measure 0.5 s of waiting
        // (the drain's first request returns 1 s after it was taken).
        let p0 = e.passes_run();
        tokio::time::sleep(ms(500)).await;
        let passes = e.passes_run() - p0;
        assert!(
            passes <= 40,
            "{passes} passes in 0.5 s for 1,000 classed waiters: the cost grew with the waiters"
        );
        // 18 requests return over the next 18 s: 8:1 while both classes wait.
        while order.lock().unwrap().len() < 18 {
            tokio::time::sleep(ms(100)).await;
        }
        let got = order.lock().unwrap()[..18].to_vec();
        let inter = got.iter().filter(|c| **c == "interactive").count();
        assert_eq!(inter, 16, "{got:?}");
        // A reset refills the bucket (60): as many are let in at once, one hand-off
        // after another in fair order, none waiting for a nap.
        e.reset("q").await.unwrap();
        tokio::time::sleep(ms(20)).await;
        let got = order.lock().unwrap()[18..].to_vec();
        assert_eq!(got.len(), 60, "the whole refilled bucket, within 20 ms");
        let inter = got.iter().filter(|c| **c == "interactive").count();
        assert!((52..=54).contains(&inter), "8:1 → 53 of 60: {inter}");
        for t in tasks {
            t.abort();
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn classed_waiters_that_never_nap_still_stall_on_time() {
    within(secs(60), async {
        let stall = secs(2);
        let e = engine(&config(classed(limited("q", Some(1), None), stall)));
        let _held = drain(&e, None).await;
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..40 {
            let e2 = e.clone();
            let class = if i % 2 == 0 { "batch" } else { "interactive" };
            let call = e.begin_call_as(OWNER, "w", None, Some(class)).unwrap();
            tasks.push(tokio::spawn(async move {
                (e2.acquire(OWNER, call).await, Instant::now())
            }));
        }
        for t in tasks {
            let (r, at) = t.await.unwrap();
            assert_stalled_on_time(r, at - t0, stall);
        }
    })
    .await;
}

/// Found by review: the napper (batch) leaves while the head (interactive) is
/// mid-turn on one freed unit; that turn must become a chain, or nobody naps any
/// more and the rest sleep to their stall edge while rpm refills.
#[tokio::test(start_paused = true)]
async fn a_napper_leaving_while_the_head_is_mid_turn_leaves_a_looker() {
    within(secs(60), async {
        let e = engine(&config(classed(limited("q", Some(60), None), secs(20))));
        let held = drain(&e, None).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let napper = class_waiters(&e, 1, "batch", &order).await;
        let others = class_waiters(&e, 2, "interactive", &order).await;
        let t0 = Instant::now();
        // In the same instant: the napper is cancelled and one unit is freed (a
        // refund gives the head a turn that is not a chain).
        napper[0].abort();
        e.report(OWNER, held[0], Outcome::Cancelled).await.unwrap();
        for t in others {
            t.await.unwrap().unwrap();
        }
        // rpm = 60 refills one request a second: both within a few seconds, not at
        // the 20 s stall edge.
        assert!(
            t0.elapsed() < secs(5),
            "granted only after {:?}",
            t0.elapsed()
        );
        assert_eq!(*order.lock().unwrap(), ["interactive", "interactive"]);
    })
    .await;
}

/// A scope ("p") whose one source has a pacer of exactly one slot, waiting on the
/// pacer (quota_full = wait), no classes.
fn one_slot() -> Arc<Engine<MemoryBackend>> {
    let mut p = scope("p", vec![source("s")]);
    p.poll_interval = ms(50);
    p.stall_window = secs(3600);
    p.pacer.initial = 1.0;
    p.pacer.min = 1.0;
    p.pacer.max = 1.0;
    engine(&config(vec![p]))
}

fn ok() -> Outcome {
    Outcome::Success {
        tokens: Some(1),
        split: None,
        count_attempt: true,
    }
}

/// §5 "waiters keep their place" (issue 21 item 7): a new Acquire that asks in the
/// instant a slot frees joins the line behind the waiter the slot was freed for,
/// instead of taking it. Before, its first pass took the slot at once, ahead of the
/// woken waiter (in the priorities bench one call waited a whole 3 s run).
#[tokio::test(start_paused = true)]
async fn a_new_acquire_does_not_take_a_slot_freed_for_a_waiter() {
    within(secs(60), async {
        let e = one_slot();
        let holder = e.begin_call(OWNER, "p", None).unwrap();
        let held = e.acquire(OWNER, holder).await.unwrap();
        let waiter_call = e.begin_call(OWNER, "p", None).unwrap();
        let e2 = e.clone();
        let waiter = tokio::spawn(async move { e2.acquire(OWNER, waiter_call).await });
        tokio::time::sleep(ms(5)).await;
        assert_eq!(e.status_local()[0].waiters, 1);

        // The slot frees; in the same instant (no yield) a new call asks.
        e.report(OWNER, held.permit, ok()).await.unwrap();
        let newcomer = e.begin_call(OWNER, "p", None).unwrap();
        let mut late = Box::pin(e.acquire(OWNER, newcomer));
        let first = tokio::select! {
            biased;
            r = &mut late => Some(r),
            _ = std::future::ready(()) => None,
        };
        assert!(
            first.is_none(),
            "the newcomer took the slot freed for the waiter: {first:?}"
        );
        let w = waiter.await.unwrap().expect("the waiter is granted");
        assert_eq!(e.status_local()[0].waiters, 1, "the newcomer waits in line");
        // The waiter's permit goes back: now it is the newcomer's turn.
        e.report(OWNER, w.permit, ok()).await.unwrap();
        let g = late.await.expect("granted after the waiter");
        assert_eq!(&*g.source, "s");
    })
    .await
}
