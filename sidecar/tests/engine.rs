//! Engine behaviour (§3–§9) on the memory backend with tokio's paused clock: waits
//! auto-advance virtual time, so every case is deterministic and costs no real time.

mod support;

use std::sync::Arc;
use std::time::Duration;

use polygate::backend::{FailureKind, Outcome, State};
use polygate::config::{Mode, Selector};
use polygate::engine::{EngineError, Exhaustion, ReloadError, SkipReason};
use support::engine_cfg::*;
use tokio::time::Instant;

const OWNER: u64 = 1;

fn success() -> Outcome {
    Outcome::Success {
        tokens: None,
        split: None,
        count_attempt: true,
    }
}

fn failure() -> Outcome {
    Outcome::failure(FailureKind::ServerError)
}

fn reasons(v: &[(&str, SkipReason)]) -> Vec<(String, SkipReason)> {
    v.iter().map(|(s, r)| (s.to_string(), *r)).collect()
}

#[tokio::test(start_paused = true)]
async fn success_flow_and_failover_to_next_source() {
    let e = engine(&config(vec![scope("chat", vec![source("a"), source("b")])]));
    let call = e.begin_call(OWNER, "chat", Some(10)).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(
        (&*g.source, g.attempt, g.is_probe, g.est_tokens),
        ("a", 1, false, 10)
    );
    e.report(OWNER, g.permit, failure()).await.unwrap();
    // Call-local demotion: the failed source goes to the back.
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!((&*g.source, g.attempt), ("b", 2));
    let a = e.report(OWNER, g.permit, success()).await.unwrap();
    assert!(a.applied);
    e.end_call(OWNER, call).await.unwrap();
    assert_eq!(e.live_counts().calls, 0);
    // A new call starts with priority order again.
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    assert_eq!(&*e.acquire(OWNER, call).await.unwrap().source, "a");
}

#[tokio::test(start_paused = true)]
async fn fail_fast_defaults_report_circuit_open_with_retry_after_and_reasons() {
    let e = engine(&config(vec![scope("chat", vec![source("a"), source("b")])]));
    e.force_open("a", secs(30)).await.unwrap();
    e.force_open("b", secs(20)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let t0 = Instant::now();
    match e.acquire(OWNER, call).await {
        Err(EngineError::CircuitOpen {
            scope,
            retry_after,
            reasons: r,
        }) => {
            assert_eq!(scope, "chat");
            assert_eq!(retry_after, secs(20), "min over sources");
            assert_eq!(
                r,
                reasons(&[
                    ("a", SkipReason::CircuitOpen),
                    ("b", SkipReason::CircuitOpen)
                ])
            );
        }
        other => panic!("expected CircuitOpen, got {other:?}"),
    }
    assert_eq!(t0.elapsed(), Duration::ZERO, "fail-fast does not sleep");
    // The memo now answers for both (same numbers, no backend needed).
    match e.acquire(OWNER, call).await {
        Err(EngineError::CircuitOpen { retry_after, .. }) => assert_eq!(retry_after, secs(20)),
        other => panic!("expected CircuitOpen, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn wait_mode_sleeps_until_the_probe_then_succeeds() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.circuit_open = Mode::Wait;
    let e = engine(&config(vec![sc]));
    e.force_open("a", secs(30)).await.unwrap();
    e.force_open("b", secs(20)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let t0 = Instant::now();
    let g = e.acquire(OWNER, call).await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(&*g.source, "b", "the first source out of cooldown");
    assert!(g.is_probe);
    assert!(
        waited >= secs(20) && waited <= secs(20) + ms(50),
        "slept the cooldown plus one jitter: {waited:?}"
    );
    let a = e.report(OWNER, g.permit, success()).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::Closed));
}

#[tokio::test(start_paused = true)]
async fn wait_circuit_with_fail_fast_quota_waits_and_never_reports_quota_exhausted() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.circuit_open = Mode::Wait;
    sc.quota_full = Mode::FailFast;
    let e = engine(&config(vec![sc]));
    e.force_open("a", secs(5)).await.unwrap();
    e.force_open("b", secs(5)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let t0 = Instant::now();
    let g = e
        .acquire(OWNER, call)
        .await
        .expect("all open + wait must wait, not fail");
    assert!(g.is_probe);
    assert!(t0.elapsed() >= secs(5), "it waited for the cooldown");
}

#[tokio::test(start_paused = true)]
async fn cooldown_longer_than_stall_window_ends_stalled_within_window_plus_poll() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    sc.stall_window = secs(10);
    sc.poll_interval = secs(1);
    let e = engine(&config(vec![sc]));
    e.force_open("a", secs(600)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let t0 = Instant::now();
    match e.acquire(OWNER, call).await {
        Err(EngineError::Exhausted {
            reason: Exhaustion::Stalled,
            reasons: r,
            ..
        }) => assert_eq!(r, reasons(&[("a", SkipReason::CircuitOpen)])),
        other => panic!("expected stalled, got {other:?}"),
    }
    let took = t0.elapsed();
    assert!(took > secs(10), "not before the window: {took:?}");
    assert!(
        took <= secs(11),
        "within stall_window + poll_interval: {took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_source_that_keeps_failing_ends_retry_exhausted() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    sc.max_attempts = 3;
    sc.breaker.failure_threshold = 1;
    sc.breaker.cooldown = secs(2);
    sc.breaker.max_cooldown = secs(60);
    let e = engine(&config(vec![sc]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let mut probes = 0;
    for attempt in 1..=3 {
        let g = e.acquire(OWNER, call).await.unwrap();
        assert_eq!(g.attempt, attempt);
        probes += g.is_probe as u32;
        e.report(OWNER, g.permit, failure()).await.unwrap();
    }
    assert_eq!(
        probes, 2,
        "attempts 2 and 3 were probes after cooldowns, and burned attempts"
    );
    match e.acquire(OWNER, call).await {
        // DESIGN §6 (call-ending errors): retry_exhausted reports 0, though the
        // source is OPEN: no time gives the call more attempts.
        Err(EngineError::Exhausted {
            reason: Exhaustion::RetryExhausted,
            retry_after,
            ..
        }) => assert_eq!(retry_after, Duration::ZERO),
        other => panic!("expected retry_exhausted, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn mixed_reasons_take_the_quota_branch_with_reasons_as_they_are() {
    let mut sc = scope(
        "chat",
        vec![
            source("a"),
            polygate::config::SourceConfig {
                rpm: Some(2),
                ..source("b")
            },
        ],
    );
    sc.quota_full = Mode::FailFast;
    sc.circuit_open = Mode::Wait;
    let e = engine(&config(vec![sc]));
    // Use b's two requests, then open a.
    e.force_open("a", secs(60)).await.unwrap();
    for _ in 0..2 {
        let c0 = e.begin_call(OWNER, "chat", None).unwrap();
        let g = e.acquire(OWNER, c0).await.unwrap();
        assert_eq!(&*g.source, "b");
        e.report(OWNER, g.permit, success()).await.unwrap();
    }
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    match e.acquire(OWNER, call).await {
        Err(EngineError::Exhausted {
            reason: Exhaustion::QuotaExhausted,
            reasons: r,
            retry_after,
            ..
        }) => {
            assert_eq!(
                r,
                reasons(&[
                    ("a", SkipReason::CircuitOpen),
                    ("b", SkipReason::RateLimited)
                ])
            );
            // DESIGN §6 (call-ending errors), quota_exhausted: min over the sources
            // of when each certainly passes — a's OPEN ends in 60 s, b refills one
            // request (rpm 2) in 30 s.
            assert_eq!(retry_after, secs(30));
        }
        other => panic!("expected quota_exhausted, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn quota_wait_uses_plain_jitter_not_a_hint() {
    let mut sc = scope(
        "chat",
        vec![polygate::config::SourceConfig {
            rpm: Some(60),
            ..source("a")
        }],
    );
    sc.poll_interval = ms(100);
    let e = engine(&config(vec![sc]));
    // A 429 with retry_after blocks the quota for 3 s.
    let c0 = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, c0).await.unwrap();
    e.report(
        OWNER,
        g.permit,
        Outcome::RateLimited {
            retry_after: Some(secs(3)),
        },
    )
    .await
    .unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let t0 = Instant::now();
    let g = e.acquire(OWNER, call).await.unwrap();
    let took = t0.elapsed();
    assert_eq!(&*g.source, "a");
    // Polled every [50, 100] ms: granted within one poll of the block ending.
    assert!(took >= secs(3) && took <= secs(3) + ms(100), "{took:?}");
}

#[tokio::test(start_paused = true)]
async fn cancelled_wait_leaves_nothing_behind() {
    let mut sc = scope(
        "chat",
        vec![polygate::config::SourceConfig {
            tpm: Some(600),
            est_tokens: Some(100),
            ..source("a")
        }],
    );
    sc.circuit_open = Mode::Wait;
    let e = engine(&config(vec![sc]));
    e.force_open("a", secs(30)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let r = tokio::time::timeout(secs(5), e.acquire(OWNER, call)).await;
    assert!(r.is_err(), "still waiting after 5 s");
    let counts = e.live_counts();
    assert_eq!(
        (counts.permits, counts.probes, counts.pacer_in_flight),
        (0, 0, 0)
    );
    let st = e.status().await;
    let a = &st[0].sources[0];
    assert_eq!(
        a.shared.tokens_available,
        Some(600.0),
        "no reservation left"
    );
    assert_eq!(st[0].waiters, 0, "waiter count released");
    // The call is usable again (not stuck "acquiring").
    e.force_close("a").await.unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert!(!g.is_probe);
}

#[tokio::test(start_paused = true)]
async fn after_a_probe_succeeds_the_source_is_selectable_at_once() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.breaker.failure_threshold = 1;
    sc.breaker.cooldown = secs(10);
    let e = engine(&config(vec![sc]));
    let c1 = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, c1).await.unwrap();
    e.report(OWNER, g.permit, failure()).await.unwrap();
    tokio::time::advance(secs(11)).await;
    let probe = e.acquire(OWNER, c1).await.unwrap();
    assert!(probe.is_probe);
    // Another call meets the live lease: refused, retry_after 0, no memo entry.
    let c2 = e.begin_call(OWNER, "chat", None).unwrap();
    match e.acquire(OWNER, c2).await {
        Err(EngineError::CircuitOpen { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::ZERO)
        }
        other => panic!("expected CircuitOpen during the probe, got {other:?}"),
    }
    assert_eq!(
        e.status().await[0].sources[0].memo_remaining,
        Duration::ZERO
    );
    e.report(OWNER, probe.permit, success()).await.unwrap();
    let t0 = Instant::now();
    let g = e.acquire(OWNER, c2).await.unwrap();
    assert_eq!(t0.elapsed(), Duration::ZERO);
    assert!(!g.is_probe);
}

#[tokio::test(start_paused = true)]
async fn stall_clock_counts_only_time_outside_attempts() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.stall_window = secs(5);
    sc.circuit_open = Mode::Wait;
    sc.max_attempts = 10;
    let e = engine(&config(vec![sc]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    tokio::time::advance(secs(60)).await; // a long attempt: not stalled time
    e.report(OWNER, g.permit, failure()).await.unwrap();
    let g = e
        .acquire(OWNER, call)
        .await
        .expect("60 s attempting is not stalling");
    assert_eq!(&*g.source, "b");
    e.report(OWNER, g.permit, failure()).await.unwrap();
    tokio::time::advance(secs(6)).await; // stalled between attempts
    match e.acquire(OWNER, call).await {
        Err(EngineError::Exhausted {
            reason: Exhaustion::Stalled,
            ..
        }) => {}
        other => panic!("expected stalled, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_freed_pacer_slot_wakes_a_waiter_before_its_nap_ends() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.pacer.initial = 1.0;
    sc.pacer.min = 1.0;
    sc.poll_interval = secs(10);
    let e = engine(&config(vec![sc]));
    let c1 = e.begin_call(OWNER, "chat", None).unwrap();
    let held = e.acquire(OWNER, c1).await.unwrap();
    let c2 = e.begin_call(OWNER, "chat", None).unwrap();
    let e2 = e.clone();
    let t0 = Instant::now();
    let waiter = tokio::spawn(async move { e2.acquire(OWNER, c2).await });
    tokio::time::sleep(secs(1)).await;
    assert_eq!(e.status().await[0].waiters, 1);
    e.report(OWNER, held.permit, success()).await.unwrap();
    let g = waiter.await.unwrap().unwrap();
    assert_eq!(&*g.source, "a");
    assert!(
        t0.elapsed() < secs(2),
        "woken by the freed slot, not the 5–10 s nap: {:?}",
        t0.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn busy_unknown_and_owner_checks() {
    let e = engine(&config(vec![scope("chat", vec![source("a")])]));
    assert_eq!(
        e.begin_call(OWNER, "nope", None),
        Err(EngineError::UnknownScope {
            scope: "nope".into(),
            known: vec!["chat".into()],
        })
    );
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(e.acquire(OWNER, call).await, Err(EngineError::Busy(call)));
    assert_eq!(
        e.acquire(2, call).await,
        Err(EngineError::UnknownCall(call)),
        "other owner"
    );
    assert_eq!(
        e.report(2, g.permit, success()).await,
        Err(EngineError::UnknownPermit(g.permit)),
        "other owner"
    );
    e.report(OWNER, g.permit, success()).await.unwrap();
    assert_eq!(
        e.report(OWNER, g.permit, success()).await,
        Err(EngineError::UnknownPermit(g.permit)),
        "reported twice"
    );
    assert_eq!(
        e.force_open("zzz", secs(1)).await,
        Err(EngineError::UnknownSource("zzz".into()))
    );
}

#[tokio::test(start_paused = true)]
async fn release_owner_frees_permits_probes_and_calls() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.breaker.failure_threshold = 1;
    sc.breaker.cooldown = secs(1);
    let e = engine(&config(vec![sc]));
    let c = e.begin_call(7, "chat", None).unwrap();
    let g = e.acquire(7, c).await.unwrap();
    e.report(7, g.permit, failure()).await.unwrap(); // a opens
    tokio::time::advance(secs(2)).await;
    let c2 = e.begin_call(7, "chat", None).unwrap();
    let probe = e.acquire(7, c2).await.unwrap();
    assert!(probe.is_probe && &*probe.source == "a");
    let _other = e.acquire(7, c).await.unwrap();
    assert_eq!(e.live_counts().permits, 2);
    e.release_owner(7).await;
    let counts = e.live_counts();
    assert_eq!(
        (counts.calls, counts.permits, counts.pacer_in_flight),
        (0, 0, 0)
    );
    // The probe lease is free: another worker probes at once.
    let c3 = e.begin_call(8, "chat", None).unwrap();
    let g = e.acquire(8, c3).await.unwrap();
    assert!(g.is_probe && &*g.source == "a", "{g:?}");
}

#[tokio::test(start_paused = true)]
async fn unreported_permit_is_reclaimed_after_its_lease() {
    let e = engine(&config(vec![scope("chat", vec![source("a")])])); // timeout 10 s → lease 20 s
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    tokio::time::advance(secs(19)).await;
    assert_eq!(e.reclaim_expired().await, 0);
    tokio::time::advance(secs(2)).await;
    assert_eq!(e.reclaim_expired().await, 1);
    assert_eq!(e.live_counts().pacer_in_flight, 0);
    assert_eq!(
        e.report(OWNER, g.permit, success()).await,
        Err(EngineError::UnknownPermit(g.permit))
    );
    let g2 = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(g2.attempt, 2, "the reclaimed attempt counted");
}

#[tokio::test(start_paused = true)]
async fn health_selector_prefers_the_healthier_source() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.selector = Selector::Health;
    sc.breaker.failure_threshold = 100;
    let e = engine(&config(vec![sc]));
    // Equal health: config order decides.
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(&*g.source, "a");
    e.report(OWNER, g.permit, failure()).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    // A new call (no call-local demotion) still prefers b, the healthier one.
    for _ in 0..3 {
        let call = e.begin_call(OWNER, "chat", None).unwrap();
        let g = e.acquire(OWNER, call).await.unwrap();
        assert_eq!(&*g.source, "b");
        e.report(OWNER, g.permit, success()).await.unwrap();
        e.end_call(OWNER, call).await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_waits() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    let e = engine(&config(vec![sc]));
    e.force_open("a", secs(100)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let e2 = e.clone();
    let w = tokio::spawn(async move { e2.acquire(OWNER, call).await });
    tokio::time::sleep(secs(1)).await;
    e.shutdown();
    assert_eq!(w.await.unwrap(), Err(EngineError::ShuttingDown));
}

#[tokio::test(start_paused = true)]
async fn est_tokens_default_derives_from_quota() {
    let e = engine(&config(vec![scope(
        "chat",
        vec![polygate::config::SourceConfig {
            tpm: Some(30_000),
            rpm: Some(500),
            ..source("a")
        }],
    )]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    assert_eq!(
        e.acquire(OWNER, call).await.unwrap().est_tokens,
        60,
        "ceil(30000 / 500)"
    );
}

#[tokio::test(start_paused = true)]
async fn reload_applies_new_policy_to_new_and_waiting_calls() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    sc.stall_window = secs(600);
    let cfg0 = config(vec![sc.clone()]);
    let e = engine(&cfg0);
    e.force_open("a", secs(3600)).await.unwrap();
    // A call waits (cooldown 1 h, stall window 10 min).
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let e2 = e.clone();
    let t0 = Instant::now();
    let waiter = tokio::spawn(async move { e2.acquire(OWNER, call).await });
    tokio::time::sleep(secs(5)).await;
    // Reload: stall window 2 s (already 5 s stalled). The waiting call is woken, runs
    // its pass and ends `stalled` at once.
    let mut shorter = sc.clone();
    shorter.stall_window = secs(2);
    let changes = e.reload(&config(vec![shorter.clone()])).unwrap();
    assert_eq!(changes, vec!["scope chat: policy updated".to_string()]);
    match waiter.await.unwrap() {
        Err(EngineError::Exhausted {
            reason: Exhaustion::Stalled,
            ..
        }) => {}
        other => panic!("expected stalled after reload, got {other:?}"),
    }
    assert!(
        t0.elapsed() < secs(6),
        "woken by the reload: {:?}",
        t0.elapsed()
    );
    // New calls see fail_fast after another reload.
    let mut ff = shorter;
    ff.circuit_open = Mode::FailFast;
    e.reload(&config(vec![ff])).unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    assert!(matches!(
        e.acquire(OWNER, call).await,
        Err(EngineError::CircuitOpen { .. })
    ));
    assert_eq!(e.status().await[0].circuit_open, "fail_fast");
}

#[tokio::test(start_paused = true)]
async fn reload_updates_source_quota_and_refuses_topology_changes() {
    let sc = scope("chat", vec![source("a"), source("b")]);
    let e = engine(&config(vec![sc.clone()]));
    let mut quota = sc.clone();
    quota.sources[0].tpm = Some(600);
    quota.sources[0].est_tokens = Some(42);
    let changes = e.reload(&config(vec![quota])).unwrap();
    assert_eq!(
        changes,
        vec![
            "scope chat: policy updated".to_string(),
            "source a: quota/estimate/timeout updated".to_string()
        ]
    );
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    assert_eq!(e.acquire(OWNER, call).await.unwrap().est_tokens, 42);
    // Adding a source, dropping one, or reordering: refused, nothing changes.
    for bad in [
        scope("chat", vec![source("a"), source("b"), source("c")]),
        scope("chat", vec![source("a")]),
        scope("chat", vec![source("b"), source("a")]),
    ] {
        match e.reload(&config(vec![bad])) {
            Err(e @ ReloadError::TopologyChanged) => {
                assert!(e.to_string().contains("restart"), "{e}")
            }
            other => panic!("topology change must be refused: {other:?}"),
        }
    }
    let st = e.status().await;
    assert_eq!(st[0].sources[0].shared.tokens_available, Some(600.0 - 42.0));
}

#[tokio::test(start_paused = true)]
async fn the_pass_a_nap_was_timed_for_always_runs() {
    // Review finding: a budget check before every pass ended the call at the edge of
    // the window without trying the source that had just come out of cooldown.
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    sc.stall_window = secs(10);
    sc.poll_interval = ms(50);
    let e = engine(&config(vec![sc]));
    e.force_open("a", ms(9_990)).await.unwrap();
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e
        .acquire(OWNER, call)
        .await
        .expect("the source reopens inside the window: the probe must be granted");
    assert!(g.is_probe);
}

#[tokio::test(start_paused = true)]
async fn live_calls_per_owner_are_capped() {
    use polygate::engine::MAX_CALLS_PER_OWNER;
    let e = engine(&config(vec![scope("chat", vec![source("a")])]));
    let mut last = 0;
    for _ in 0..MAX_CALLS_PER_OWNER {
        last = e.begin_call(OWNER, "chat", None).unwrap();
    }
    match e.begin_call(OWNER, "chat", None) {
        Err(EngineError::InvalidArgument(m)) => assert!(m.contains("limit"), "{m}"),
        other => panic!("expected the cap, got {other:?}"),
    }
    // Another owner is unaffected; ending a call frees a place.
    e.begin_call(OWNER + 1, "chat", None).unwrap();
    e.end_call(OWNER, last).await.unwrap();
    e.begin_call(OWNER, "chat", None).unwrap();
    // Dropping the owner forgets its count.
    e.release_owner(OWNER).await;
    e.begin_call(OWNER, "chat", None).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_closes_the_breaker_wakes_every_waiter() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    sc.poll_interval = secs(10);
    sc.breaker.failure_threshold = 1;
    sc.breaker.cooldown = secs(1);
    let e = engine(&config(vec![sc]));
    let c0 = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, c0).await.unwrap();
    e.report(OWNER, g.permit, failure()).await.unwrap();
    tokio::time::advance(secs(2)).await;
    let probe = e.acquire(OWNER, c0).await.unwrap();
    assert!(probe.is_probe);
    let mut waiters = Vec::new();
    for owner in 10..13 {
        let e = e.clone();
        waiters.push(tokio::spawn(async move {
            let call = e.begin_call(owner, "chat", None).unwrap();
            e.acquire(owner, call).await
        }));
    }
    tokio::time::sleep(secs(1)).await;
    assert_eq!(e.status().await[0].waiters, 3);
    let t0 = Instant::now();
    e.report(OWNER, probe.permit, success()).await.unwrap();
    for w in waiters {
        let g = w.await.unwrap().unwrap();
        assert!(!g.is_probe);
    }
    assert!(
        t0.elapsed() < secs(1),
        "all woken at once, not by their 5-10 s naps: {:?}",
        t0.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn reload_keeps_first_scope_settings_for_a_shared_source() {
    let mut a = scope("a", vec![source("s")]);
    a.sources[0].est_tokens = Some(100);
    let mut b = scope("b", vec![source("s")]);
    b.sources[0].est_tokens = Some(5000);
    b.sources[0].timeout = secs(60);
    let cfg = config(vec![a, b]);
    let e = engine(&cfg);
    for _ in 0..2 {
        assert_eq!(
            e.reload(&cfg).unwrap(),
            Vec::<String>::new(),
            "nothing changed"
        );
    }
    let call = e.begin_call(OWNER, "a", None).unwrap();
    assert_eq!(
        e.acquire(OWNER, call).await.unwrap().est_tokens,
        100,
        "first scope's estimate"
    );
}

// ---------------------------------------------------------------- issue 9

/// The §6 retry-after of a call that ends `Exhausted(reason)`, or a panic.
async fn exhausted_after(
    e: &polygate::engine::Engine<polygate::backend::memory::MemoryBackend>,
    reason: Exhaustion,
) -> Duration {
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let r = e.acquire(OWNER, call).await;
    e.end_call(OWNER, call).await.unwrap();
    match r {
        Err(EngineError::Exhausted {
            reason: got,
            retry_after,
            ..
        }) if got == reason => retry_after,
        other => panic!("expected {reason:?}, got {other:?}"),
    }
}

#[track_caller]
fn assert_near(actual: Duration, expected: Duration, what: &str) {
    let diff = actual.abs_diff(expected);
    assert!(diff <= ms(1), "{what}: {actual:?}, expected {expected:?}");
}

/// DESIGN §6 (call-ending errors), quota_exhausted: a 429's block is the time until
/// the quota certainly passes, for this call and for the next within one poll (the
/// host-local quota hint answers then, with the same number).
#[tokio::test(start_paused = true)]
async fn quota_exhausted_after_a_429_reports_the_block() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.quota_full = Mode::FailFast;
    let e = engine(&config(vec![sc]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    let rl = Outcome::RateLimited {
        retry_after: Some(secs(3)),
    };
    e.report(OWNER, g.permit, rl).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    let first = exhausted_after(&e, Exhaustion::QuotaExhausted).await;
    assert_near(first, secs(3), "from the backend");
    tokio::time::advance(ms(10)).await;
    let second = exhausted_after(&e, Exhaustion::QuotaExhausted).await;
    assert_near(second, secs(3) - ms(10), "from the quota hint");
    tokio::time::advance(secs(3)).await;
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    assert_eq!(&*e.acquire(OWNER, call).await.unwrap().source, "a");
}

/// DESIGN §6 (call-ending errors), quota_exhausted: a token bucket in debt reports
/// the refill time of the debt plus this call's estimate.
#[tokio::test(start_paused = true)]
async fn quota_exhausted_in_debt_reports_the_refill_of_debt_and_estimate() {
    let mut sc = scope(
        "chat",
        vec![polygate::config::SourceConfig {
            tpm: Some(60), // one token per second
            est_tokens: Some(10),
            ..source("a")
        }],
    );
    sc.quota_full = Mode::FailFast;
    let e = engine(&config(vec![sc]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    let used = Outcome::Success {
        tokens: Some(100),
        split: None,
        count_attempt: true,
    };
    e.report(OWNER, g.permit, used).await.unwrap(); // level 60 − 100 = −40
    e.end_call(OWNER, call).await.unwrap();
    let wait = exhausted_after(&e, Exhaustion::QuotaExhausted).await;
    assert_near(wait, secs(50), "40 tokens of debt + the estimate of 10");
    assert_eq!(
        e.status().await[0].sources[0].quota_retry_after,
        secs(50),
        "status shows the same wait"
    );
}

/// DESIGN §6 (call-ending errors), stalled: the min over the sources of when each
/// certainly passes — here a 429 block shorter than the other source's cooldown.
#[tokio::test(start_paused = true)]
async fn stalled_reports_the_earliest_source_that_certainly_passes() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.circuit_open = Mode::Wait;
    sc.stall_window = secs(2);
    sc.poll_interval = ms(100);
    let e = engine(&config(vec![sc]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(&*g.source, "a");
    let rl = Outcome::RateLimited {
        retry_after: Some(secs(100)),
    };
    e.report(OWNER, g.permit, rl).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    e.force_open("b", secs(600)).await.unwrap();
    let t0 = Instant::now();
    let wait = exhausted_after(&e, Exhaustion::Stalled).await;
    let waited = t0.elapsed();
    assert!(
        waited > secs(2) && waited <= secs(2) + ms(200),
        "{waited:?}"
    );
    assert_near(wait, secs(100) - waited, "a's block, not b's cooldown");
}

/// DESIGN §7: a 429's retry_after blocks the quota for at most
/// `max_rate_limit_block` (default 10 min), not a day.
#[tokio::test(start_paused = true)]
async fn a_429_blocks_at_most_max_rate_limit_block() {
    for (cap, expected) in [(None, secs(600)), (Some(secs(30)), secs(30))] {
        let mut cfg = config(vec![scope("chat", vec![source("a")])]);
        if let Some(c) = cap {
            cfg.sidecar.max_rate_limit_block = c;
        }
        let e = engine(&cfg);
        let call = e.begin_call(OWNER, "chat", None).unwrap();
        let g = e.acquire(OWNER, call).await.unwrap();
        let day = Outcome::RateLimited {
            retry_after: Some(secs(86_400)),
        };
        e.report(OWNER, g.permit, day).await.unwrap();
        let st = e.status().await;
        assert_eq!(
            st[0].sources[0].shared.quota_blocked, expected,
            "cap {cap:?}"
        );
    }
}

/// DESIGN §18: a report's observed limits reach the backend through the engine: a
/// source that observes is lowered and its status shows the provider's word; a reset
/// of remaining 0 blocks at most `max_rate_limit_block`; a source that does not
/// observe ignores them.
#[tokio::test(start_paused = true)]
async fn observed_limits_lower_the_source_and_their_reset_is_capped() {
    use polygate::backend::{Dim, Observation};
    use polygate::config::ObserveLimits;
    for (observe, level, blocked) in [
        (ObserveLimits::On, 50.0, secs(30)),
        (ObserveLimits::Off, 999.0, secs(0)),
    ] {
        let mut cfg = config(vec![scope(
            "chat",
            vec![polygate::config::SourceConfig {
                tpm: Some(1_000),
                rpm: Some(100),
                observe_limits: observe,
                ..source("a")
            }],
        )]);
        cfg.sidecar.max_rate_limit_block = secs(30);
        let e = engine(&cfg);
        let call = e.begin_call(OWNER, "chat", Some(1)).unwrap();
        let g = e.acquire(OWNER, call).await.unwrap();
        let dim = |remaining: u64, reset: Option<Duration>| {
            Some(Dim {
                limit: Some(1_000),
                remaining: Some(remaining),
                reset,
            })
        };
        let o = Observation {
            dims: [dim(50, None), dim(0, Some(secs(86_400))), None, None],
            age: Duration::ZERO,
        };
        e.report_observed(
            OWNER,
            g.permit,
            Outcome::success(Some(1)),
            Some(Box::new(o)),
        )
        .await
        .unwrap();
        let st = e.status().await;
        let src = &st[0].sources[0];
        let tpm = src.shared.levels[0].unwrap();
        assert!((tpm - level).abs() < 0.5, "{observe:?}: tpm level {tpm}");
        assert_eq!(src.shared.quota_blocked, blocked, "{observe:?}");
        let seen = src.buckets()[0].observed;
        match observe {
            ObserveLimits::On => {
                let o = seen.expect("observed");
                assert_eq!((o.remaining, o.limit, o.removed), (50, Some(1_000), 949));
            }
            ObserveLimits::Off => assert_eq!(seen, None),
        }
    }
}

/// DESIGN §4/§8: a `count_attempt = false` success (its result was unusable) counts
/// as a failure for health, does not grow the pacer, stays out of the breaker window,
/// and moves the source to the back for the rest of the call.
#[tokio::test(start_paused = true)]
async fn an_unusable_success_is_a_failure_for_health_and_holds_the_pacer() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.selector = Selector::Health;
    let e = engine(&config(vec![sc]));
    let ceiling = |st: &[polygate::engine::ScopeStatus]| st[0].sources[0].pacer_ceiling;
    let before = ceiling(&e.status().await);
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(&*g.source, "a", "equal health: config order");
    let unusable = Outcome::Success {
        tokens: None,
        split: None,
        count_attempt: false,
    };
    e.report(OWNER, g.permit, unusable).await.unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    assert_eq!(&*g.source, "b", "the retry goes elsewhere");
    e.report(OWNER, g.permit, success()).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    let st = e.status().await;
    assert_eq!(ceiling(&st), before, "no pacer growth for a");
    let a = &st[0].sources[0].shared;
    assert_eq!(
        (a.window_successes, a.window_failures, a.streak),
        (0, 0, 0),
        "out of the breaker window"
    );
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    assert_eq!(
        &*e.acquire(OWNER, call).await.unwrap().source,
        "b",
        "a new call ranks b (healthy) before a (unusable answer)"
    );
}

/// DESIGN §4: health decays with a half-life of the breaker window, so a source that
/// failed once (or was slow once) is first again once that has aged, although the
/// selector sent it no traffic meanwhile.
#[tokio::test(start_paused = true)]
async fn health_forgets_with_a_half_life_of_the_window() {
    let mut sc = scope("chat", vec![source("a"), source("b")]);
    sc.selector = Selector::Health;
    sc.breaker.window = secs(10);
    let e = engine(&config(vec![sc]));
    let next = |e: Arc<polygate::engine::Engine<_>>| async move {
        let call = e.begin_call(OWNER, "chat", None).unwrap();
        let g = e.acquire(OWNER, call).await.unwrap();
        (call, g)
    };
    let (call, g) = next(e.clone()).await;
    assert_eq!(&*g.source, "a");
    e.report(OWNER, g.permit, failure()).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    for _ in 0..3 {
        let (call, g) = next(e.clone()).await;
        assert_eq!(&*g.source, "b", "a failed a moment ago");
        e.report(OWNER, g.permit, success()).await.unwrap();
        e.end_call(OWNER, call).await.unwrap();
    }
    tokio::time::advance(secs(20)).await; // two half-lives: a's failure weighs 1/4
    let (call, g) = next(e.clone()).await;
    assert_eq!(&*g.source, "b", "not aged enough yet");
    e.end_call(OWNER, call).await.unwrap();
    tokio::time::advance(secs(80)).await; // ten half-lives in all
    let (call, g) = next(e.clone()).await;
    assert_eq!(&*g.source, "a", "the failure has aged out");
    // Now slow: a success after 5 s, while b answers at once.
    tokio::time::advance(secs(5)).await;
    e.report(OWNER, g.permit, success()).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    let (call, g) = next(e.clone()).await;
    assert_eq!(&*g.source, "b", "equal success rates: b has no slow sample");
    e.report(OWNER, g.permit, success()).await.unwrap();
    e.end_call(OWNER, call).await.unwrap();
    tokio::time::advance(secs(150)).await;
    let (_, g) = next(e.clone()).await;
    assert_eq!(&*g.source, "a", "the slow sample has aged out too");
}

/// DESIGN §10: on a shared backend a memo entry is re-checked at most once a second;
/// when the backend's epoch went backwards (its state was lost) the entry is dropped
/// and the source used again, long before the memo deadline. A local backend, which
/// cannot lose its state under the engine, is never re-checked.
#[tokio::test(start_paused = true)]
async fn a_lost_shared_state_drops_the_memo_within_a_recheck() {
    use polygate::backend::memory::MemoryBackend;
    use polygate::clock::{Clock, TokioClock};
    use support::test_backend::TestBackend;

    for remote in [true, false] {
        let mut sc = scope("chat", vec![source("a"), source("b")]);
        sc.breaker.failure_threshold = 1;
        sc.breaker.cooldown = secs(60);
        let cfg = config(vec![sc]);
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let inner = MemoryBackend::new(clock.clone(), ["a", "b"]);
        let e = polygate::engine::Engine::new(&cfg, TestBackend::new(inner, remote, ms(0)), clock);
        let first = |e: Arc<polygate::engine::Engine<TestBackend>>| async move {
            let call = e.begin_call(OWNER, "chat", None).unwrap();
            let g = e.acquire(OWNER, call).await.unwrap();
            e.report(OWNER, g.permit, success()).await.unwrap();
            e.end_call(OWNER, call).await.unwrap();
            g.source.to_string()
        };
        let call = e.begin_call(OWNER, "chat", None).unwrap();
        let g = e.acquire(OWNER, call).await.unwrap();
        let opened = e.report(OWNER, g.permit, failure()).await.unwrap();
        assert_eq!(opened.state, State::Open);
        e.end_call(OWNER, call).await.unwrap();
        assert_eq!(first(e.clone()).await, "b", "a is memo-skipped");
        e.backend().inner.lose_state(); // FLUSHALL
        assert_eq!(
            first(e.clone()).await,
            "b",
            "within a second the memo is trusted"
        );
        tokio::time::advance(secs(1)).await;
        if remote {
            assert_eq!(
                first(e.clone()).await,
                "a",
                "re-checked: epoch went backwards"
            );
            let a = e.status().await[0].sources[0].clone();
            assert_eq!(
                (a.shared.state, a.shared.epoch, a.memo_remaining),
                (State::Closed, 0, Duration::ZERO)
            );
        } else {
            assert_eq!(
                first(e.clone()).await,
                "b",
                "a local backend is not re-checked"
            );
            assert!(e.status().await[0].sources[0].memo_remaining > secs(58));
        }
    }
}

/// DESIGN §6 (call-ending errors), stalled before any pass of the Acquire: what
/// this host knows — here the memo's remaining cooldown.
#[tokio::test(start_paused = true)]
async fn stalled_before_a_pass_reports_what_the_host_knows() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.breaker.failure_threshold = 1;
    sc.breaker.cooldown = secs(60);
    sc.stall_window = secs(2);
    let e = engine(&config(vec![sc]));
    let call = e.begin_call(OWNER, "chat", None).unwrap();
    let g = e.acquire(OWNER, call).await.unwrap();
    e.report(OWNER, g.permit, failure()).await.unwrap(); // opens a: memo 60 s
    tokio::time::advance(secs(3)).await; // the worker dawdles: stalled
    match e.acquire(OWNER, call).await {
        Err(EngineError::Exhausted {
            reason: Exhaustion::Stalled,
            retry_after,
            ..
        }) => assert_eq!(retry_after, secs(57)),
        other => panic!("expected stalled, got {other:?}"),
    }
}

/// A force_close (or reset) clears this host's memo *before* it wakes the waiters: a
/// waiter woken first would still see the memo of the old open and nap until that
/// open ended (an hour here). Two threads, many rounds: the lost wake-up showed in
/// about one round in ten before the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_an_open_source_are_released_by_force_close_and_reset_every_time() {
    let mut sc = scope("chat", vec![source("a")]);
    sc.circuit_open = Mode::Wait;
    sc.stall_window = secs(7200);
    let e = engine(&config(vec![sc]));
    for round in 0..100u64 {
        e.force_open("a", secs(3600)).await.unwrap();
        let waiters: Vec<_> = (0..4)
            .map(|i| {
                let e = e.clone();
                let owner = round * 10 + i;
                tokio::spawn(async move {
                    let call = e.begin_call(owner, "chat", None).unwrap();
                    let g = e.acquire(owner, call).await.unwrap();
                    e.report(owner, g.permit, success()).await.unwrap();
                    e.end_call(owner, call).await.unwrap();
                })
            })
            .collect();
        while e.status().await[0].waiters < 4 {
            tokio::task::yield_now().await;
        }
        if round % 2 == 0 {
            e.force_close("a").await.unwrap();
        } else {
            e.reset("a").await.unwrap();
        }
        for w in waiters {
            tokio::time::timeout(secs(10), w)
                .await
                .unwrap_or_else(|_| panic!("round {round}: a waiter missed the wake-up"))
                .unwrap();
        }
    }
}
