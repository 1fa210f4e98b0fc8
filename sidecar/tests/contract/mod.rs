//! The backend contract suite (§6, §7, §10): written once, run against every backend.
//!
//! A backend test file implements [`Harness`] and invokes [`contract_tests!`], which
//! expands to one `#[tokio::test]` per case. Cases use short durations (cooldown
//! 100 ms) so a real-time backend (Redis, whose clock is `TIME`) runs them with real
//! waits; a manual-clock backend advances its clock instead. Duration assertions
//! allow `tolerance()` *below* the exact value (real time only ever moves further
//! than asked) and 1 ms above.
//!
//! Every `retry_after` assertion is made together with the state and the `applied` /
//! `granted` flag, so a case cannot pass on the wrong branch.

#![allow(dead_code)]

mod learned_rate;
mod observed;
mod provider;
mod tenants;
pub use learned_rate::*;
pub use observed::*;
pub use provider::*;
pub use tenants::*;

use std::future::Future;
use std::time::Duration;

use std::sync::Arc;

use polygate::backend::{
    Admit, AdmitRequest, Applied, Backend, BreakerParams, ClassShares, ClassTag, Entry,
    FailureKind, Held, Outcome, QuotaParams, ReportRequest, Reserve, Settlement, Share, State,
    Trip,
};

/// What a backend test file provides.
pub trait Harness: Sync {
    /// The backend under test.
    type B: Backend;
    /// A backend with fresh state that knows the sources `s1`..`s4`.
    fn fresh(&self) -> impl Future<Output = Self::B> + Send;
    /// Let `d` pass on the backend's clock.
    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send;
    /// How far below an exact expected duration a reading may be.
    fn tolerance(&self) -> Duration;
    /// The backend after its shared state was lost (§10: FLUSHALL, a restart without
    /// persistence, failover to an empty replica); for memory, a restarted process.
    fn lose_state(&self, b: Self::B) -> impl Future<Output = Self::B> + Send;
    /// A second host's backend on `b`'s shared state (§15's cross-host cases), or
    /// `None` where one process is the whole deployment (memory: the cases then run
    /// both "hosts" on `b`).
    fn second(&self, b: &Self::B) -> impl Future<Output = Option<Self::B>> + Send {
        let _ = b;
        async { None }
    }
}

pub const S1: &str = "s1";
pub const S2: &str = "s2";
pub const S3: &str = "s3";
pub const SOURCES: [&str; 4] = ["s1", "s2", "s3", "s4"];

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Breaker parameters of the suite: streak 3, rate 0.5 over ≥ 10 samples, a long
/// window (so real-time runs never cross a bucket edge by accident), cooldown 100 ms
/// capped at 400 ms, probe lease 150 ms.
pub fn bp() -> BreakerParams {
    BreakerParams {
        failure_threshold: 3,
        failure_rate: 0.5,
        min_calls: 10,
        window: Duration::from_secs(60),
        cooldown: ms(100),
        max_cooldown: ms(400),
        probe_ttl: ms(150),
    }
}

/// Quota parameters: 60 tokens and 2 requests per minute (refill 1 token/s, so the
/// few milliseconds a real-time run takes refill < 1 token).
pub fn qp() -> QuotaParams {
    QuotaParams {
        tpm: Some(60),
        rpm: Some(2),
        ..QuotaParams::default()
    }
}

pub fn qp_tokens_only() -> QuotaParams {
    QuotaParams {
        tpm: Some(60),
        rpm: None,
        ..QuotaParams::default()
    }
}

#[track_caller]
pub fn assert_dur<H: Harness>(h: &H, actual: Duration, expected: Duration, what: &str) {
    let lo = expected.saturating_sub(h.tolerance());
    let hi = expected + ms(1);
    assert!(
        actual >= lo && actual <= hi,
        "{what}: {actual:?} not within [{lo:?}, {hi:?}] (expected {expected:?})"
    );
}

#[track_caller]
pub fn assert_level(actual: Option<f64>, expected: f64, what: &str) {
    let a = actual.unwrap_or_else(|| panic!("{what}: bucket missing"));
    assert!(
        (a - expected).abs() < 0.5,
        "{what}: level {a} != {expected}"
    );
}

async fn fail_n<B: Backend>(b: &B, source: &str, n: u32) -> Applied {
    let mut last = None;
    for _ in 0..n {
        let e = b.try_enter(source, &bp()).await.unwrap();
        assert!(e.granted, "fail_n: entry refused early: {e:?}");
        last = Some(b.record_failure(source, e.epoch, &bp()).await.unwrap());
    }
    last.expect("n > 0")
}

async fn succeed_n<B: Backend>(b: &B, source: &str, n: u32) {
    for _ in 0..n {
        let e = b.try_enter(source, &bp()).await.unwrap();
        assert!(e.granted);
        assert!(
            b.record_success(source, e.epoch, true, &bp())
                .await
                .unwrap()
                .applied
        );
    }
}

/// Open `source` via the streak channel and wait out the cooldown, then take the
/// probe. Returns the probe entry.
async fn open_then_probe<H: Harness>(h: &H, b: &H::B, source: &str) -> Entry {
    let a = fail_n(b, source, 3).await;
    assert_eq!(a.state, State::Open);
    h.advance(ms(110)).await;
    let e = b.try_enter(source, &bp()).await.unwrap();
    assert!(e.granted && e.is_probe, "expected probe: {e:?}");
    assert_eq!(e.state, State::HalfOpen);
    e
}

// ---------------------------------------------------------------- breaker: basics

pub async fn closed_grants_without_probe<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (e.granted, e.is_probe, e.state, e.retry_after),
        (true, false, State::Closed, Duration::ZERO)
    );
}

pub async fn cold_start_streak_opens<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let before = b.try_enter(S1, &bp()).await.unwrap().epoch;
    let a = fail_n(&b, S1, 2).await;
    assert_eq!((a.applied, a.state), (true, State::Closed));
    let a = fail_n(&b, S1, 1).await;
    assert_eq!((a.applied, a.state), (true, State::Open));
    // The transition log's reason and level (§12) come with the answer.
    assert_eq!((a.trip, a.level), (Some(Trip::Streak), 0));
    assert!(a.epoch > before, "opening bumps the epoch");
    // First streak open lasts exactly `cooldown` (k stays 0).
    assert_dur(h, a.retry_after, ms(100), "retry_after at open");
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!((e.granted, e.state), (false, State::Open));
    assert_dur(h, e.retry_after, ms(100), "try_enter rejected in OPEN");
    h.advance(ms(40)).await;
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!((e.granted, e.state), (false, State::Open));
    assert_dur(h, e.retry_after, ms(60), "retry_after counts down");
}

pub async fn success_resets_streak<H: Harness>(h: &H) {
    let b = h.fresh().await;
    fail_n(&b, S1, 2).await;
    succeed_n(&b, S1, 1).await;
    let a = fail_n(&b, S1, 2).await;
    assert_eq!(a.state, State::Closed, "streak restarted after a success");
    let a = fail_n(&b, S1, 1).await;
    assert_eq!(a.state, State::Open);
}

pub async fn healthy_window_vetoes_streak<H: Harness>(h: &H) {
    let b = h.fresh().await;
    succeed_n(&b, S1, 20).await;
    // 5 consecutive failures: streak ≥ 3, but 5/25 = 0.2 < 0.5 over ≥ 10 samples.
    let a = fail_n(&b, S1, 5).await;
    assert_eq!((a.applied, a.state), (true, State::Closed));
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.streak, snap.window_successes, snap.window_failures),
        (5, 20, 5)
    );
}

pub async fn rate_channel_opens_and_grows_level<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let p = BreakerParams {
        failure_threshold: 100,
        ..bp()
    };
    // Alternate so no streak forms: 4 ok + 5 fail = 9 samples < min_calls.
    for i in 0..9 {
        let e = b.try_enter(S1, &p).await.unwrap();
        let a = if i % 2 == 0 {
            b.record_failure(S1, e.epoch, &p).await.unwrap()
        } else {
            b.record_success(S1, e.epoch, true, &p).await.unwrap()
        };
        assert_eq!(
            a.state,
            State::Closed,
            "no open below min_calls (sample {i})"
        );
    }
    // 10th sample: 5 ok + 5 fail, rate 0.5 ≥ 0.5.
    let e = b.try_enter(S1, &p).await.unwrap();
    let a = b.record_success(S1, e.epoch, true, &p).await.unwrap();
    assert_eq!(a.state, State::Closed);
    let e = b.try_enter(S1, &p).await.unwrap();
    let a = b.record_failure(S1, e.epoch, &p).await.unwrap();
    assert_eq!(
        (a.applied, a.state),
        (true, State::Open),
        "6/11 failures opens"
    );
    assert_eq!((a.trip, a.level), (Some(Trip::FailureRate), 1));
    // Rate open grows k to 1: 2 × cooldown.
    assert_dur(h, a.retry_after, ms(200), "rate-channel open duration");
    let snap = b.snapshot(S1, &p, &qp()).await.unwrap();
    assert_eq!(snap.cooldown_level, 1);
}

pub async fn count_attempt_false_stays_out_of_window<H: Harness>(h: &H) {
    let b = h.fresh().await;
    fail_n(&b, S1, 2).await;
    let e = b.try_enter(S1, &bp()).await.unwrap();
    let a = b.record_success(S1, e.epoch, false, &bp()).await.unwrap();
    assert!(a.applied);
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.streak, snap.window_successes, snap.window_failures),
        (0, 0, 2),
        "streak reset, success not counted"
    );
}

// ---------------------------------------------------------------- half-open and probe

pub async fn probe_after_cooldown_then_half_open_rejects_with_zero<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let opened = fail_n(&b, S1, 3).await;
    h.advance(ms(110)).await;
    let probe = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (
            probe.granted,
            probe.is_probe,
            probe.state,
            probe.retry_after
        ),
        (true, true, State::HalfOpen, Duration::ZERO),
        "try_enter granted as probe reports 0"
    );
    assert!(probe.epoch > opened.epoch);
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (e.granted, e.is_probe, e.state, e.retry_after),
        (false, false, State::HalfOpen, Duration::ZERO),
        "try_enter rejected in HALF_OPEN reports 0"
    );
}

pub async fn probe_success_closes<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let probe = open_then_probe(h, &b, S1).await;
    let a = b
        .record_success(S1, probe.epoch, true, &bp())
        .await
        .unwrap();
    assert_eq!(
        (a.applied, a.state, a.retry_after),
        (true, State::Closed, Duration::ZERO)
    );
    assert!(a.epoch > probe.epoch);
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (e.granted, e.is_probe, e.state),
        (true, false, State::Closed)
    );
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.streak, snap.window_failures),
        (0, 0),
        "close starts a fresh window"
    );
}

pub async fn probe_failure_reopens_with_doubled_cooldown<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let probe = open_then_probe(h, &b, S1).await;
    let a = b.record_failure(S1, probe.epoch, &bp()).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::Open));
    assert_dur(h, a.retry_after, ms(200), "k=1 after a probe failure");
}

pub async fn cooldown_doubles_up_to_cap<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let mut probe = open_then_probe(h, &b, S1).await;
    for (expect, wait) in [(200u64, 210u64), (400, 410), (400, 410)] {
        let a = b.record_failure(S1, probe.epoch, &bp()).await.unwrap();
        assert_eq!(a.state, State::Open);
        assert_dur(h, a.retry_after, ms(expect), "open duration");
        h.advance(ms(wait)).await;
        probe = b.try_enter(S1, &bp()).await.unwrap();
        assert!(probe.is_probe);
    }
    // §6 k_max: cooldown 100 ms × 2^2 reaches max_cooldown 400 ms, so the third
    // reopen at the cap leaves k at 2, not 3.
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.state, snap.cooldown_level, snap.epoch),
        (State::HalfOpen, 2, probe.epoch),
        "level stops at k_max"
    );
    // A reload that lowers the cap (k_max 1) lowers the stored level with it.
    let lower = BreakerParams {
        max_cooldown: ms(200),
        ..bp()
    };
    let a = b.record_failure(S1, probe.epoch, &lower).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::Open));
    assert_dur(h, a.retry_after, ms(200), "capped by the new max_cooldown");
    let snap = b.snapshot(S1, &lower, &qp()).await.unwrap();
    assert_eq!((snap.state, snap.cooldown_level), (State::Open, 1));
}

pub async fn cooldown_level_decays_while_closed<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let probe = open_then_probe(h, &b, S1).await;
    let a = b.record_failure(S1, probe.epoch, &bp()).await.unwrap(); // k = 1
    h.advance(a.retry_after + ms(10)).await;
    let probe = b.try_enter(S1, &bp()).await.unwrap();
    let a = b
        .record_success(S1, probe.epoch, true, &bp())
        .await
        .unwrap();
    assert_eq!(a.state, State::Closed);
    assert_eq!(
        b.snapshot(S1, &bp(), &qp()).await.unwrap().cooldown_level,
        1
    );
    // Closed for one whole max_cooldown (400 ms): k decays by one.
    h.advance(ms(420)).await;
    assert_eq!(
        b.snapshot(S1, &bp(), &qp()).await.unwrap().cooldown_level,
        0
    );
    // A streak open now lasts the base cooldown again.
    let a = fail_n(&b, S1, 3).await;
    assert_dur(h, a.retry_after, ms(100), "decayed level");
}

pub async fn expired_lease_regranted_and_old_holder_fenced<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let first = open_then_probe(h, &b, S1).await;
    h.advance(ms(160)).await; // probe_ttl 150 ms: the holder vanished
    let second = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (second.granted, second.is_probe, second.state),
        (true, true, State::HalfOpen)
    );
    assert!(
        second.epoch > first.epoch,
        "a re-granted probe has its own epoch"
    );
    let late = b
        .record_success(S1, first.epoch, true, &bp())
        .await
        .unwrap();
    assert_eq!(
        (late.applied, late.state, late.retry_after),
        (false, State::HalfOpen, Duration::ZERO),
        "record_success fenced out in HALF_OPEN reports 0"
    );
    let a = b
        .record_success(S1, second.epoch, true, &bp())
        .await
        .unwrap();
    assert_eq!((a.applied, a.state), (true, State::Closed));
}

pub async fn rate_limited_probe_releases_lease<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let probe = open_then_probe(h, &b, S1).await;
    let a = b
        .report(
            S1,
            ReportRequest::new(
                &bp(),
                &QuotaParams::default(),
                probe.epoch,
                true,
                0,
                Outcome::RateLimited { retry_after: None },
            ),
        )
        .await
        .unwrap();
    assert_eq!(
        (a.applied, a.state, a.retry_after),
        (true, State::HalfOpen, Duration::ZERO)
    );
    let next = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (next.granted, next.is_probe),
        (true, true),
        "next caller may probe at once"
    );
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(snap.cooldown_level, 0, "429 is not a failure");
}

pub async fn cancelled_probe_releases_lease<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let probe = open_then_probe(h, &b, S1).await;
    let a = b.release_probe(S1, probe.epoch).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::HalfOpen));
    let next = b.try_enter(S1, &bp()).await.unwrap();
    assert!(next.granted && next.is_probe);
    // The same through report(Cancelled).
    let a = b
        .report(
            S1,
            ReportRequest::new(
                &bp(),
                &QuotaParams::default(),
                next.epoch,
                true,
                0,
                Outcome::Cancelled,
            ),
        )
        .await
        .unwrap();
    assert_eq!((a.applied, a.state), (true, State::HalfOpen));
    assert!(b.try_enter(S1, &bp()).await.unwrap().is_probe);
}

pub async fn rate_limited_is_not_failure<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams::default();
    fail_n(&b, S1, 2).await;
    for _ in 0..5 {
        let e = b.try_enter(S1, &bp()).await.unwrap();
        let a = b
            .report(
                S1,
                ReportRequest::new(
                    &bp(),
                    &q,
                    e.epoch,
                    false,
                    0,
                    Outcome::RateLimited { retry_after: None },
                ),
            )
            .await
            .unwrap();
        assert_eq!((a.applied, a.state), (true, State::Closed));
    }
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.streak, snap.window_failures, snap.window_successes),
        (2, 2, 0),
        "429 touches neither streak nor window"
    );
    let a = fail_n(&b, S1, 1).await;
    assert_eq!(a.state, State::Open, "streak continued across the 429s");
}

// ---------------------------------------------------------------- fencing and the §6 table

pub async fn fenced_outcomes_in_open_report_remaining_cooldown<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let stale = b.try_enter(S1, &bp()).await.unwrap();
    let opened = fail_n(&b, S1, 3).await;
    assert_eq!(opened.state, State::Open);
    h.advance(ms(30)).await;
    let a = b
        .record_success(S1, stale.epoch, true, &bp())
        .await
        .unwrap();
    assert_eq!((a.applied, a.state), (false, State::Open));
    assert_dur(
        h,
        a.retry_after,
        ms(70),
        "record_success fenced out in OPEN",
    );
    let a = b.record_failure(S1, stale.epoch, &bp()).await.unwrap();
    assert_eq!((a.applied, a.state), (false, State::Open));
    assert_dur(
        h,
        a.retry_after,
        ms(70),
        "record_failure fenced out in OPEN",
    );
    let a = b.release_probe(S1, stale.epoch).await.unwrap();
    assert_eq!((a.applied, a.state), (false, State::Open));
    assert_dur(h, a.retry_after, ms(70), "release_probe fenced out in OPEN");
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.cooldown_level, snap.epoch),
        (0, opened.epoch),
        "fenced ops change nothing"
    );
}

pub async fn fenced_outcomes_in_closed_and_half_open_report_zero<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let stale = b.try_enter(S1, &bp()).await.unwrap();
    let probe = open_then_probe(h, &b, S1).await;
    for a in [
        b.record_failure(S1, stale.epoch, &bp()).await.unwrap(),
        b.release_probe(S1, stale.epoch).await.unwrap(),
    ] {
        assert_eq!(
            (a.applied, a.state, a.retry_after),
            (false, State::HalfOpen, Duration::ZERO)
        );
    }
    b.record_success(S1, probe.epoch, true, &bp())
        .await
        .unwrap();
    for a in [
        b.record_success(S1, probe.epoch, true, &bp())
            .await
            .unwrap(),
        b.record_failure(S1, probe.epoch, &bp()).await.unwrap(),
        b.release_probe(S1, probe.epoch).await.unwrap(),
    ] {
        assert_eq!(
            (a.applied, a.state, a.retry_after),
            (false, State::Closed, Duration::ZERO),
            "stale probe epoch after close"
        );
    }
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!((snap.streak, snap.window_failures), (0, 0));
}

pub async fn retry_after_query_is_min_over_sources<H: Harness>(h: &H) {
    let b = h.fresh().await;
    b.force_open(S1, ms(300)).await.unwrap();
    b.force_open(S2, ms(200)).await.unwrap();
    let r = b.retry_after(&[S1, S2]).await.unwrap();
    assert_dur(h, r, ms(200), "min over two OPEN sources");
    let r = b.retry_after(&[S1, S2, S3]).await.unwrap();
    assert_eq!(r, Duration::ZERO, "a CLOSED source makes it 0");
    // HALF_OPEN reports 0 as well.
    fail_n(&b, S3, 3).await;
    h.advance(ms(110)).await;
    assert!(b.try_enter(S3, &bp()).await.unwrap().is_probe);
    let r = b.retry_after(&[S1, S3]).await.unwrap();
    assert_eq!(r, Duration::ZERO, "HALF_OPEN counts as 0");
    let r = b.retry_after(&[S1]).await.unwrap();
    assert_dur(h, r, ms(190), "single OPEN source");
}

// ---------------------------------------------------------------- admin

pub async fn admin_force_open_close_reset<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let before = b.try_enter(S1, &bp()).await.unwrap();
    let a = b.force_open(S1, ms(250)).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::Open));
    assert_dur(h, a.retry_after, ms(250), "force_open duration");
    assert!(a.epoch > before.epoch);
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!((e.granted, e.state), (false, State::Open));
    let a = b.force_close(S1).await.unwrap();
    assert_eq!(
        (a.applied, a.state, a.retry_after),
        (true, State::Closed, Duration::ZERO)
    );
    assert!(b.try_enter(S1, &bp()).await.unwrap().granted);
    // Build up a level, then reset.
    let probe = open_then_probe(h, &b, S1).await;
    b.record_failure(S1, probe.epoch, &bp()).await.unwrap();
    assert!(b.reserve(S1, &qp(), 50).await.unwrap() == Reserve::Reserved);
    let a = b.reset(S1).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::Closed));
    assert!(a.epoch > probe.epoch, "reset never rewinds the epoch");
    let snap = b.snapshot(S1, &bp(), &qp()).await.unwrap();
    assert_eq!((snap.cooldown_level, snap.streak), (0, 0));
    assert_level(snap.tokens_available, 60.0, "reset refills tokens");
    assert_level(snap.requests_available, 2.0, "reset refills requests");
    let stale = b.record_failure(S1, probe.epoch, &bp()).await.unwrap();
    assert!(!stale.applied, "permits from before the reset are fenced");
}

// ---------------------------------------------------------------- quota

pub async fn quota_reserve_and_settle_net_to_zero<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    assert_eq!(b.reserve(S1, &q, 40).await.unwrap(), Reserve::Reserved);
    assert_eq!(b.reserve(S1, &q, 10).await.unwrap(), Reserve::Reserved);
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        10.0,
        "after reserving",
    );
    // Transient failure: the token deposit nets to zero.
    b.settle(S1, &q, 40, Settlement::RefundTokens)
        .await
        .unwrap();
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        50.0,
        "refund",
    );
    // Success charging exactly the estimate: nothing moves.
    b.settle(S1, &q, 10, Settlement::charge(10)).await.unwrap();
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        50.0,
        "exact charge",
    );
    // Success with fewer tokens: the difference comes back.
    assert_eq!(b.reserve(S1, &q, 30).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, 30, Settlement::charge(5)).await.unwrap();
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        45.0,
        "partial refund",
    );
}

pub async fn quota_debt_delays_admission<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    assert_eq!(b.reserve(S1, &q, 50).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, 50, Settlement::charge(100)).await.unwrap();
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        -40.0,
        "debt",
    );
    match b.reserve(S1, &q, 1).await.unwrap() {
        Reserve::Denied { retry_after } => {
            // 41 tokens at 1 token/s.
            assert!(
                retry_after > Duration::from_secs(39),
                "refill estimate {retry_after:?}"
            );
        }
        r => panic!("debt must refuse: {r:?}"),
    }
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        -40.0,
        "denial takes nothing",
    );
}

pub async fn quota_debt_is_floored_at_minus_capacity<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    assert_eq!(b.reserve(S1, &q, 50).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, 50, Settlement::charge(u64::MAX / 4))
        .await
        .unwrap();
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        -60.0,
        "debt floor",
    );
    match b.reserve(S1, &q, 1).await.unwrap() {
        // From −60 back to 1 token at 1 token/s: about a minute, not an eternity.
        Reserve::Denied { retry_after } => {
            assert!(retry_after <= Duration::from_secs(62), "{retry_after:?}")
        }
        r => panic!("debt must refuse: {r:?}"),
    }
}

pub async fn quota_oversized_estimate_passes_when_full<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    assert_eq!(b.reserve(S1, &q, 100).await.unwrap(), Reserve::Reserved);
    assert_level(
        b.snapshot(S1, &bp(), &q).await.unwrap().tokens_available,
        -40.0,
        "oversized",
    );
}

pub async fn quota_request_bucket_and_refund_all<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        tpm: None,
        rpm: Some(2),
        ..QuotaParams::default()
    };
    assert_eq!(b.reserve(S1, &q, 0).await.unwrap(), Reserve::Reserved);
    assert_eq!(b.reserve(S1, &q, 0).await.unwrap(), Reserve::Reserved);
    assert!(matches!(
        b.reserve(S1, &q, 0).await.unwrap(),
        Reserve::Denied { .. }
    ));
    // Cancelled before sending: the request comes back.
    b.settle(S1, &q, 0, Settlement::RefundAll).await.unwrap();
    assert_eq!(b.reserve(S1, &q, 0).await.unwrap(), Reserve::Reserved);
    // A transient failure keeps the request spent.
    b.settle(S1, &q, 0, Settlement::RefundTokens).await.unwrap();
    assert!(matches!(
        b.reserve(S1, &q, 0).await.unwrap(),
        Reserve::Denied { .. }
    ));
}

pub async fn quota_block_from_429<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp();
    assert_eq!(b.reserve(S1, &q, 5).await.unwrap(), Reserve::Reserved);
    let e = b.try_enter(S1, &bp()).await.unwrap();
    let a = b
        .report(
            S1,
            ReportRequest::new(
                &bp(),
                &q,
                e.epoch,
                false,
                5,
                Outcome::RateLimited {
                    retry_after: Some(ms(120)),
                },
            ),
        )
        .await
        .unwrap();
    assert_eq!((a.applied, a.state), (true, State::Closed));
    match b.reserve(S1, &q, 1).await.unwrap() {
        Reserve::Denied { retry_after } => assert_dur(h, retry_after, ms(120), "429 block"),
        r => panic!("blocked quota must refuse: {r:?}"),
    }
    // A shorter block never shortens the existing one.
    b.block_quota(S1, ms(10)).await.unwrap();
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_dur(h, snap.quota_blocked, ms(120), "block only moves forward");
    assert_level(snap.tokens_available, 60.0, "a 429 refunds the tokens");
    h.advance(ms(130)).await;
    assert_eq!(b.reserve(S1, &q, 1).await.unwrap(), Reserve::Reserved);
}

// ---------------------------------------------------------------- combined operations

pub async fn admit_releases_reservation_when_breaker_refuses<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    b.force_open(S1, ms(300)).await.unwrap();
    match b.admit(S1, AdmitRequest::new(&bp(), &q, 25)).await.unwrap() {
        Admit::CircuitOpen {
            state, retry_after, ..
        } => {
            assert_eq!(state, State::Open);
            assert_dur(h, retry_after, ms(300), "admit refused by breaker");
        }
        a => panic!("expected CircuitOpen: {a:?}"),
    }
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_level(snap.tokens_available, 60.0, "reservation released");
    let q2 = QuotaParams {
        tpm: None,
        rpm: Some(2),
        ..QuotaParams::default()
    };
    b.admit(S2, AdmitRequest::new(&bp(), &q2, 0)).await.unwrap();
    b.force_open(S2, ms(300)).await.unwrap();
    b.admit(S2, AdmitRequest::new(&bp(), &q2, 0)).await.unwrap();
    let snap = b.snapshot(S2, &bp(), &q2).await.unwrap();
    assert_level(snap.requests_available, 1.0, "request released too");
}

pub async fn admit_quota_refusal_does_not_touch_breaker<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    fail_n(&b, S1, 3).await;
    h.advance(ms(110)).await; // cooldown over: a try_enter would take the probe
    b.block_quota(S1, ms(500)).await.unwrap();
    match b.admit(S1, AdmitRequest::new(&bp(), &q, 5)).await.unwrap() {
        Admit::RateLimited { .. } => {}
        a => panic!("expected RateLimited: {a:?}"),
    }
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_eq!(
        snap.state,
        State::Open,
        "breaker not consulted, no probe taken"
    );
}

pub async fn admit_grants_probe_and_report_settles<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    let Admit::Admitted {
        epoch, is_probe, ..
    } = b.admit(S1, AdmitRequest::new(&bp(), &q, 20)).await.unwrap()
    else {
        panic!("fresh source must admit")
    };
    assert!(!is_probe);
    let a = b
        .report(
            S1,
            ReportRequest::new(
                &bp(),
                &q,
                epoch,
                false,
                20,
                Outcome::Success {
                    tokens: Some(12),
                    split: None,
                    count_attempt: true,
                },
            ),
        )
        .await
        .unwrap();
    assert_eq!((a.applied, a.state), (true, State::Closed));
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_level(snap.tokens_available, 48.0, "charged the actual tokens");
    assert_eq!(snap.window_successes, 1);
    let Admit::Admitted { epoch, .. } =
        b.admit(S1, AdmitRequest::new(&bp(), &q, 20)).await.unwrap()
    else {
        panic!()
    };
    let a = b
        .report(
            S1,
            ReportRequest::new(
                &bp(),
                &q,
                epoch,
                false,
                20,
                Outcome::failure(FailureKind::ServerError),
            ),
        )
        .await
        .unwrap();
    assert!(a.applied);
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_level(snap.tokens_available, 48.0, "failure refunds the tokens");
    assert_eq!((snap.window_failures, snap.streak), (1, 1));
}

// ---------------------------------------------------------------- issue 9

/// Breaker params where the level takes longer to decay than an idle hash's basis:
/// cooldown 10 ms, cap 80 ms (k_max 3), window and probe lease 20 ms.
fn bp_fast() -> BreakerParams {
    BreakerParams {
        failure_threshold: 1,
        failure_rate: 0.5,
        min_calls: 100,
        window: ms(20),
        cooldown: ms(10),
        max_cooldown: ms(80),
        probe_ttl: ms(20),
    }
}

/// DESIGN §6 (call-ending errors), quota row: a quota refusal's retry_after is the
/// time until the bucket holds this call's estimate (refill after debt) or the 429
/// block ends, whichever is later; the breaker is not consulted.
pub async fn quota_refusal_reports_the_later_of_refill_and_block<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only(); // one token per second
    let before = b.snapshot(S1, &bp(), &q).await.unwrap().epoch;
    assert_eq!(b.reserve(S1, &q, 50).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, 50, Settlement::charge(90)).await.unwrap(); // level −30
    let refused = |a: Admit| match a {
        Admit::RateLimited { retry_after } => retry_after,
        a => panic!("expected a quota refusal: {a:?}"),
    };
    let wait = refused(b.admit(S1, AdmitRequest::new(&bp(), &q, 10)).await.unwrap());
    assert_dur(h, wait, Duration::from_secs(40), "debt 30 + estimate 10");
    let wait = refused(
        b.admit(S1, AdmitRequest::new(&bp(), &q, 1_000))
            .await
            .unwrap(),
    );
    assert_dur(
        h,
        wait,
        Duration::from_secs(90),
        "an oversized estimate needs a full bucket",
    );
    b.block_quota(S1, ms(300)).await.unwrap();
    let wait = refused(b.admit(S1, AdmitRequest::new(&bp(), &q, 10)).await.unwrap());
    assert_dur(
        h,
        wait,
        Duration::from_secs(40),
        "refill is later than the block",
    );
    b.block_quota(S1, Duration::from_secs(120)).await.unwrap();
    let wait = refused(b.admit(S1, AdmitRequest::new(&bp(), &q, 10)).await.unwrap());
    assert_dur(
        h,
        wait,
        Duration::from_secs(120),
        "the block is later than the refill",
    );
    match b.reserve(S1, &q, 10).await.unwrap() {
        Reserve::Denied { retry_after } => {
            assert_dur(h, retry_after, Duration::from_secs(120), "reserve agrees")
        }
        r => panic!("blocked: {r:?}"),
    }
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_eq!(
        (
            snap.state,
            snap.epoch,
            snap.cooldown_level,
            snap.retry_after
        ),
        (State::Closed, before, 0, Duration::ZERO),
        "the breaker was not consulted"
    );
    assert_level(snap.tokens_available, -30.0, "refusals take nothing");
}

/// DESIGN §7: a non-transient failure (`bad_result`, `error`: the upstream answered)
/// is charged its reported tokens, else the estimate; a transient one (`timeout`,
/// `connection`, `server_error`) refunds the reservation.
pub async fn failures_are_charged_or_refunded_by_kind<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp_tokens_only();
    let p = BreakerParams {
        failure_threshold: 100,
        ..bp()
    };
    let mut level = 60.0;
    let cases = [
        (FailureKind::BadResult, Some(5), 5.0),
        (FailureKind::Error, None, 20.0),
        (FailureKind::Error, Some(0), 0.0),
        (FailureKind::Timeout, Some(15), 0.0),
        (FailureKind::Connection, None, 0.0),
        (FailureKind::ServerError, Some(15), 0.0),
    ];
    for (i, (kind, tokens, charged)) in cases.into_iter().enumerate() {
        let Admit::Admitted { epoch, .. } =
            b.admit(S1, AdmitRequest::new(&p, &q, 20)).await.unwrap()
        else {
            panic!("admit {i}")
        };
        let a = b
            .report(
                S1,
                ReportRequest::new(
                    &p,
                    &q,
                    epoch,
                    false,
                    20,
                    Outcome::Failure {
                        kind,
                        tokens,
                        split: None,
                    },
                ),
            )
            .await
            .unwrap();
        assert_eq!(
            (a.applied, a.state, a.retry_after),
            (true, State::Closed, Duration::ZERO)
        );
        level -= charged;
        let snap = b.snapshot(S1, &p, &q).await.unwrap();
        assert_level(
            snap.tokens_available,
            level,
            &format!("{kind:?} {tokens:?}"),
        );
        assert_eq!(snap.window_failures, i as u64 + 1, "each is a failure");
    }
}

/// DESIGN §6 k decay "on every backend alike": idle state comes back with the level
/// the memory backend decays to — never dropped early — and, once it reads as fresh,
/// a shared backend may forget it (epoch 0; no live permit carries an epoch then).
pub async fn idle_breaker_keeps_the_decayed_level<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let p = bp_fast();
    let e = b.try_enter(S1, &p).await.unwrap();
    let mut a = b.record_failure(S1, e.epoch, &p).await.unwrap();
    for _ in 0..3 {
        h.advance(a.retry_after + ms(5)).await;
        let probe = b.try_enter(S1, &p).await.unwrap();
        assert!(probe.is_probe, "{probe:?}");
        a = b.record_failure(S1, probe.epoch, &p).await.unwrap();
    }
    assert_dur(h, a.retry_after, ms(80), "k = 3 reaches the cap");
    h.advance(a.retry_after + ms(5)).await;
    let probe = b.try_enter(S1, &p).await.unwrap();
    let closed = b.record_success(S1, probe.epoch, true, &p).await.unwrap();
    assert_eq!((closed.applied, closed.state), (true, State::Closed));
    let snap = b.snapshot(S1, &p, &qp()).await.unwrap();
    assert_eq!(
        (snap.state, snap.cooldown_level, snap.epoch),
        (State::Closed, 3, closed.epoch)
    );
    // Two whole max_cooldowns CLOSED: one level left.
    h.advance(ms(170)).await;
    let snap = b.snapshot(S1, &p, &qp()).await.unwrap();
    assert_eq!(
        (
            snap.state,
            snap.cooldown_level,
            snap.epoch,
            snap.retry_after
        ),
        (State::Closed, 1, closed.epoch, Duration::ZERO)
    );
    // Long idle: decayed to 0 everywhere; Redis has let the hash expire by now.
    h.advance(ms(1_100)).await;
    let snap = b.snapshot(S1, &p, &qp()).await.unwrap();
    assert_eq!(
        (
            snap.state,
            snap.cooldown_level,
            snap.streak,
            snap.window_failures
        ),
        (State::Closed, 0, 0, 0)
    );
    assert!(
        snap.epoch == closed.epoch || snap.epoch == 0,
        "kept, or forgotten whole: {} (closed at {})",
        snap.epoch,
        closed.epoch
    );
    let e = b.try_enter(S1, &p).await.unwrap();
    assert_eq!((e.granted, e.is_probe), (true, false));
    let a = b.record_failure(S1, e.epoch, &p).await.unwrap();
    assert_eq!((a.applied, a.state), (true, State::Open));
    assert_dur(
        h,
        a.retry_after,
        ms(10),
        "a streak open at k = 0 lasts the base cooldown",
    );
}

/// DESIGN §10: when the shared state is lost, the epoch goes backwards — the tell a
/// host uses to drop its memo entry. `peek` shows it without changing anything, and
/// permits from before the loss are fenced.
pub async fn lost_state_shows_as_an_epoch_going_backwards<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let stale = b.try_enter(S1, &bp()).await.unwrap();
    let opened = fail_n(&b, S1, 3).await;
    let peek = b.peek(S1).await.unwrap();
    assert_eq!((peek.state, peek.epoch), (State::Open, opened.epoch));
    assert_dur(h, peek.retry_after, ms(100), "peek: OPEN's until − now");
    assert!(opened.epoch > 0);
    let b = h.lose_state(b).await;
    let peek = b.peek(S1).await.unwrap();
    assert_eq!(
        (peek.state, peek.epoch, peek.retry_after),
        (State::Closed, 0, Duration::ZERO),
        "fresh, and the epoch went backwards"
    );
    let late = b.record_failure(S1, opened.epoch, &bp()).await.unwrap();
    assert_eq!(
        (late.applied, late.state, late.epoch, late.retry_after),
        (false, State::Closed, 0, Duration::ZERO),
        "a permit from before the loss is fenced"
    );
    assert!(
        !b.record_success(S1, stale.epoch + 5, true, &bp())
            .await
            .unwrap()
            .applied
    );
    let e = b.try_enter(S1, &bp()).await.unwrap();
    assert_eq!(
        (e.granted, e.is_probe, e.state),
        (true, false, State::Closed)
    );
}

/// DESIGN §7: a 429's block is bounded on every backend alike (the engine cuts it to
/// `max_rate_limit_block` first; a backend bounds it at 7 days whoever drives it).
pub async fn a_429_block_is_bounded_alike<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = qp();
    let e = b.try_enter(S1, &bp()).await.unwrap();
    let month = Outcome::RateLimited {
        retry_after: Some(Duration::from_secs(30 * 86_400)),
    };
    let a = b
        .report(S1, ReportRequest::new(&bp(), &q, e.epoch, false, 5, month))
        .await
        .unwrap();
    assert_eq!(
        (a.applied, a.state, a.epoch, a.retry_after),
        (true, State::Closed, e.epoch, Duration::ZERO),
        "a 429 is no breaker verdict"
    );
    let week = polygate::gate::quota::MAX_QUOTA_BLOCK;
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_dur(h, snap.quota_blocked, week, "capped block");
    match b.admit(S1, AdmitRequest::new(&bp(), &q, 1)).await.unwrap() {
        Admit::RateLimited { retry_after } => assert_dur(h, retry_after, week, "admit"),
        a => panic!("blocked: {a:?}"),
    }
}

// ---------------------------------------------------------------- §15 priority classes

/// Ten requests a minute (one per 6 s: a real-time run refills nothing that matters).
fn qp_rpm10() -> QuotaParams {
    QuotaParams {
        rpm: Some(10),
        ..QuotaParams::default()
    }
}

/// interactive (reserve `r`), batch (limit `l`), saturation `sat`; the tag of class
/// `index`.
fn classes(sat: u64, r: u64, l: u64, index: usize) -> ClassTag {
    ClassTag {
        shares: Arc::new(ClassShares {
            saturation_ppm: sat,
            classes: vec![
                Share {
                    name: "interactive".into(),
                    reserve_ppm: r,
                    limit_ppm: 1_000_000,
                },
                Share {
                    name: "batch".into(),
                    reserve_ppm: 0,
                    limit_ppm: l,
                },
            ],
        }),
        index,
    }
}

/// §15 across two hosts: below saturation batch uses idle capacity; above it, batch
/// cannot take what interactive's unused reserve holds — wherever it asks — and is
/// told when that certainly frees (§6); interactive still gets its reserve, then the
/// bucket itself refuses.
pub async fn class_reserve_holds_capacity_across_hosts<H: Harness>(h: &H) {
    let one = h.fresh().await;
    let two = h.second(&one).await;
    let hosts: [&H::B; 2] = [&one, two.as_ref().unwrap_or(&one)];
    let q = qp_rpm10();
    // saturation 50 %, interactive reserve 30 % (3 of 10).
    let batch = classes(500_000, 300_000, 1_000_000, 1);
    let interactive = classes(500_000, 300_000, 1_000_000, 0);
    for i in 0..7 {
        let a = hosts[i % 2]
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
            .await
            .unwrap();
        assert!(matches!(a, Admit::Admitted { .. }), "batch {i}: {a:?}");
    }
    match hosts[1]
        .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
        .await
        .unwrap()
    {
        Admit::ClassHeld { why, retry_after } => {
            assert_eq!(why, Held::Reserve);
            // 8 of 10 in use would leave 2 < 3 reserved: certainly free once the
            // bucket holds the whole reserve after this one (8 + 3 − 10 = 1 request,
            // 6 s) — sooner than draining to saturation (3 requests, 18 s).
            assert_dur(h, retry_after, Duration::from_secs(6), "reserve wait");
        }
        other => panic!("batch past saturation must be held: {other:?}"),
    }
    for i in 0..3 {
        let a = hosts[(i + 1) % 2]
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&interactive))
            .await
            .unwrap();
        assert!(
            matches!(a, Admit::Admitted { .. }),
            "interactive {i}: {a:?}"
        );
    }
    match hosts[0]
        .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&interactive))
        .await
        .unwrap()
    {
        Admit::RateLimited { retry_after } => {
            assert_dur(h, retry_after, Duration::from_secs(6), "bucket wait")
        }
        other => panic!("the bucket is empty: {other:?}"),
    }
    // A scope without classes on the same source sees the bucket only.
    assert!(matches!(
        hosts[1]
            .admit(S1, AdmitRequest::new(&bp(), &q, 0))
            .await
            .unwrap(),
        Admit::RateLimited { .. }
    ));
}

/// §15: `limit` caps a class always (saturated or not), on every host; what the
/// class settles back (a cancellation refunds the request) is its to use again; the
/// other class is not capped by it.
pub async fn class_limit_caps_always_and_settles_back<H: Harness>(h: &H) {
    let one = h.fresh().await;
    let two = h.second(&one).await;
    let hosts: [&H::B; 2] = [&one, two.as_ref().unwrap_or(&one)];
    let q = qp_rpm10();
    // batch limit 20 % (2 of 10); saturation 100 % so no reserve applies.
    let batch = classes(1_000_000, 0, 200_000, 1);
    let interactive = classes(1_000_000, 0, 200_000, 0);
    let mut epochs = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        match host
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
            .await
            .unwrap()
        {
            Admit::Admitted { epoch, .. } => epochs.push(epoch),
            other => panic!("batch {i}: {other:?}"),
        }
    }
    match hosts[0]
        .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
        .await
        .unwrap()
    {
        Admit::ClassHeld { why, retry_after } => {
            assert_eq!(why, Held::Limit);
            assert_dur(h, retry_after, Duration::from_secs(6), "limit wait");
        }
        other => panic!("batch at its limit must be held: {other:?}"),
    }
    assert!(matches!(
        hosts[1]
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&interactive))
            .await
            .unwrap(),
        Admit::Admitted { .. }
    ));
    // One batch permit cancelled before sending: its request comes back to batch.
    hosts[1]
        .report(
            S1,
            ReportRequest::new(&bp(), &q, epochs[0], false, 0, Outcome::Cancelled).class("batch"),
        )
        .await
        .unwrap();
    assert!(matches!(
        hosts[0]
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
            .await
            .unwrap(),
        Admit::Admitted { .. }
    ));
    assert!(matches!(
        hosts[1]
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
            .await
            .unwrap(),
        Admit::ClassHeld {
            why: Held::Limit,
            ..
        }
    ));
}

/// Expands to one `#[tokio::test]` per contract case. `$harness` is an expression
/// (it may `.await`) producing the harness.
#[macro_export]
macro_rules! contract_tests {
    ($harness:expr) => {
        $crate::contract_tests!(@cases $harness;
            closed_grants_without_probe,
            cold_start_streak_opens,
            success_resets_streak,
            healthy_window_vetoes_streak,
            rate_channel_opens_and_grows_level,
            count_attempt_false_stays_out_of_window,
            probe_after_cooldown_then_half_open_rejects_with_zero,
            probe_success_closes,
            probe_failure_reopens_with_doubled_cooldown,
            cooldown_doubles_up_to_cap,
            cooldown_level_decays_while_closed,
            expired_lease_regranted_and_old_holder_fenced,
            rate_limited_probe_releases_lease,
            cancelled_probe_releases_lease,
            rate_limited_is_not_failure,
            fenced_outcomes_in_open_report_remaining_cooldown,
            fenced_outcomes_in_closed_and_half_open_report_zero,
            retry_after_query_is_min_over_sources,
            admin_force_open_close_reset,
            quota_reserve_and_settle_net_to_zero,
            quota_debt_delays_admission,
            quota_debt_is_floored_at_minus_capacity,
            quota_oversized_estimate_passes_when_full,
            quota_request_bucket_and_refund_all,
            quota_block_from_429,
            admit_releases_reservation_when_breaker_refuses,
            admit_quota_refusal_does_not_touch_breaker,
            admit_grants_probe_and_report_settles,
            quota_refusal_reports_the_later_of_refill_and_block,
            failures_are_charged_or_refunded_by_kind,
            idle_breaker_keeps_the_decayed_level,
            lost_state_shows_as_an_epoch_going_backwards,
            a_429_block_is_bounded_alike,
            burst_sets_capacity_and_buckets_start_full,
            burst_capacity_is_never_below_one_request,
            an_oversized_reservation_needs_a_full_bucket_and_leaves_debt,
            input_and_output_buckets_settle_the_split_or_in_proportion,
            estimate_charging_keeps_the_reservation_whatever_is_reported,
            per_day_buckets_hold_a_day_and_ignore_burst,
            quota_retry_after_is_the_longest_wait_over_the_buckets,
            one_report_s_debt_is_bounded_by_max_rate_limit_block,
            class_reserve_holds_capacity_across_hosts,
            class_limit_caps_always_and_settles_back,
            observed_limits_lower_and_never_raise,
            observed_limits_subtract_calls_in_flight,
            a_source_that_does_not_observe_ignores_observations,
            remaining_zero_blocks_until_the_reset_capped,
            an_observation_older_than_one_applied_is_ignored,
            auto_admits_one_at_a_time_then_learns_and_follows_the_limit,
            auto_input_and_output_buckets_charge_their_share,
            a_429_cuts_the_rate_on_every_host_and_it_recovers,
            a_predicted_429_or_one_of_a_source_that_does_not_learn_cuts_nothing,
            a_429_refunds_what_its_reservation_took_before_it_cuts,
            a_second_429_refunds_what_it_took,
            a_429_of_a_call_sent_before_the_last_cut_cuts_nothing,
            two_429s_within_a_second_cut_once_across_hosts,
            a_class_limit_follows_the_learned_rate,
            an_auto_limit_changed_while_cut_is_followed,
            tenant_limit_refuses_before_the_source_and_takes_nothing,
            source_refusal_gives_the_tenant_everything_back,
            settlements_give_back_tokens_and_dollars,
            a_dollar_budget_refuses_until_its_window_ends,
            concurrent_admissions_never_exceed_the_tenant,
            a_refilled_ledger_reads_as_fresh,
        );
    };
    (@cases $harness:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                let h = $harness;
                contract::$case(&h).await;
            }
        )*
    };
}
