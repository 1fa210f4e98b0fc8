//! Contract cases of §18 (limits learned from the provider), run on every backend: an
//! observation lowers a bucket to `remaining − in flight` and never raises it; calls
//! still in flight on the source (on any host) are subtracted; `remaining = 0` with a
//! reset blocks the quota until then; an observation dated before one already applied
//! is ignored; a source that does not observe ignores observations; an `"auto"`
//! bucket admits one call at a time until it learns the provider's limit, then
//! follows it. Rates are per minute, so a real-time backend refills well under one
//! unit while a case runs.

use std::time::Duration;

use polygate::backend::{
    Admit, AdmitRequest, Backend, Dim, Observation, Outcome, QuotaParams, ReportRequest, Reserve,
    Tokens,
};

use super::{assert_dur, assert_level, bp, ms, Harness, S1};

/// 120 tokens and 30 requests per minute (2 and 0.5 a second: a real-time backend
/// refills under half a unit in the 250 ms a slow case may take), observing.
fn q() -> QuotaParams {
    QuotaParams {
        tpm: Some(120),
        rpm: Some(30),
        observe: true,
        ..QuotaParams::default()
    }
}

/// An observation of tokens (and requests) `remaining`, made `age` before the report.
fn obs(tokens: Option<u64>, requests: Option<u64>, age: Duration) -> Observation {
    let dim = |r: Option<u64>| {
        r.map(|remaining| Dim {
            limit: None,
            remaining: Some(remaining),
            reset: None,
        })
    };
    Observation {
        dims: [dim(tokens), dim(requests), None, None],
        age,
    }
}

async fn levels<B: Backend>(b: &B, q: &QuotaParams) -> [Option<f64>; 6] {
    b.snapshot(S1, &bp(), q).await.unwrap().levels
}

/// Admit one call of `tokens`; its epoch.
async fn admit<B: Backend>(b: &B, q: &QuotaParams, tokens: impl Into<Tokens>) -> u64 {
    match b
        .admit(S1, AdmitRequest::new(&bp(), q, tokens))
        .await
        .unwrap()
    {
        Admit::Admitted { epoch, .. } => epoch,
        a => panic!("expected a grant, got {a:?}"),
    }
}

/// Report a success of `tokens` (reserved `tokens`) with observation `o`.
async fn report<B: Backend>(b: &B, q: &QuotaParams, epoch: u64, tokens: u64, o: &Observation) {
    let p = bp();
    let r =
        ReportRequest::new(&p, q, epoch, false, tokens, Outcome::success(Some(tokens))).observed(o);
    assert!(b.report(S1, r).await.unwrap().applied);
}

pub async fn observed_limits_lower_and_never_raise<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = q();
    let e = admit(&b, &q, 10).await;
    // The provider says 40 tokens and 10 requests are left: another consumer used
    // what PolyGate did not see.
    report(&b, &q, e, 10, &obs(Some(40), Some(10), Duration::ZERO)).await;
    let l = levels(&b, &q).await;
    assert_level(l[0], 40.0, "tpm lowered to remaining");
    assert_level(l[1], 10.0, "rpm lowered to remaining");
    let seen = b.snapshot(S1, &bp(), &q).await.unwrap().seen;
    let t = seen[0].expect("tokens observed");
    assert_eq!(t.remaining, 40);
    assert!(
        (69..=70).contains(&t.removed),
        "110 -> 40 removed 70, got {}",
        t.removed
    );
    // More left than PolyGate thinks: nothing is raised.
    let e = admit(&b, &q, 10).await;
    report(&b, &q, e, 10, &obs(Some(120), Some(30), Duration::ZERO)).await;
    let l = levels(&b, &q).await;
    assert_level(l[0], 30.0, "never raised by an observation");
    assert_level(l[1], 9.0, "never raised by an observation");
}

pub async fn observed_limits_subtract_calls_in_flight<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let other = h.second(&b).await;
    let q = q();
    // Two calls of 5 tokens still in flight (one on another host where there is
    // one), then a third reports with 30 tokens left upstream.
    let _ = admit(other.as_ref().unwrap_or(&b), &q, 5).await;
    let _ = admit(&b, &q, 5).await;
    let e = admit(&b, &q, 10).await;
    report(&b, &q, e, 10, &obs(Some(30), None, Duration::ZERO)).await;
    assert_level(
        levels(&b, &q).await[0],
        20.0,
        "30 left upstream − 10 reserved by calls in flight",
    );
}

pub async fn a_source_that_does_not_observe_ignores_observations<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        observe: false,
        ..q()
    };
    let e = admit(&b, &q, 10).await;
    report(&b, &q, e, 10, &obs(Some(0), Some(0), Duration::ZERO)).await;
    let l = levels(&b, &q).await;
    assert_level(l[0], 110.0, "ignored");
    assert_level(l[1], 29.0, "ignored");
}

pub async fn remaining_zero_blocks_until_the_reset_capped<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = q();
    let e = admit(&b, &q, 10).await;
    let o = Observation {
        dims: [
            None,
            Some(Dim {
                limit: Some(30),
                remaining: Some(0),
                reset: Some(ms(300)),
            }),
            None,
            None,
        ],
        age: Duration::ZERO,
    };
    report(&b, &q, e, 10, &o).await;
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    assert_dur(h, snap.quota_blocked, ms(300), "blocked until the reset");
    match b.reserve(S1, &q, 1).await.unwrap() {
        Reserve::Denied { retry_after } => {
            assert!(retry_after >= ms(250), "blocked: {retry_after:?}")
        }
        r => panic!("expected the block, got {r:?}"),
    }
    // The engine caps a reset at max_rate_limit_block before the backend sees it
    // (tests/engine.rs); the backend keeps what it is given, no more.
    let capped = b.snapshot(S1, &bp(), &q).await.unwrap().quota_blocked;
    assert!(capped <= ms(301));
}

pub async fn an_observation_older_than_one_applied_is_ignored<H: Harness>(h: &H) {
    let b = h.fresh().await;
    h.advance(ms(100)).await; // (a manual clock starts at 0)
    let q = q();
    let e = admit(&b, &q, 10).await;
    report(&b, &q, e, 10, &obs(Some(40), None, Duration::ZERO)).await;
    // A streamed response's headers, seen 80 ms ago, arrive after: stale.
    let e = admit(&b, &q, 10).await;
    report(&b, &q, e, 10, &obs(Some(10), None, ms(80))).await;
    assert_level(
        levels(&b, &q).await[0],
        30.0,
        "the older observation is ignored",
    );
    // A newer one applies.
    let e = admit(&b, &q, 10).await;
    report(&b, &q, e, 10, &obs(Some(10), None, Duration::ZERO)).await;
    assert_level(levels(&b, &q).await[0], 10.0, "a newer one applies");
}

pub async fn auto_admits_one_at_a_time_then_learns_and_follows_the_limit<H: Harness>(h: &H) {
    let b = h.fresh().await;
    // tpm = "auto": bit 0.
    let q = QuotaParams {
        tpm: None,
        observe: true,
        auto: 1,
        ..QuotaParams::default()
    };
    let e = admit(&b, &q, 10).await;
    match b.admit(S1, AdmitRequest::new(&bp(), &q, 10)).await.unwrap() {
        Admit::RateLimited { .. } => {}
        a => panic!("one call at a time until the first response, got {a:?}"),
    }
    let learn = |limit: u64, remaining: u64| Observation {
        dims: [
            Some(Dim {
                limit: Some(limit),
                remaining: Some(remaining),
                reset: None,
            }),
            None,
            None,
            None,
        ],
        age: Duration::ZERO,
    };
    report(&b, &q, e, 10, &learn(120, 100)).await;
    assert_level(
        levels(&b, &q).await[0],
        100.0,
        "learned 120, lowered to 100",
    );
    // Now learned: concurrent calls are admitted.
    let e1 = admit(&b, &q, 10).await;
    let e2 = admit(&b, &q, 10).await;
    // The provider's limit changes: followed. The bucket keeps its deficit in time
    // (40 taken at 120/min is 20 s of refill: 20 tokens at 60/min), so its level is
    // 40, below remaining − in flight (60 − 10).
    report(&b, &q, e1, 10, &learn(60, 60)).await;
    let l = levels(&b, &q).await[0].expect("tpm learned");
    assert!(
        (39.5..=41.0).contains(&l),
        "capacity follows the new limit: level {l}"
    );
    let e3 = admit(&b, &q, 10).await;
    report(&b, &q, e2, 10, &learn(60, 60)).await;
    report(&b, &q, e3, 10, &learn(60, 60)).await;
}

/// `"auto"` input and output buckets (`itpm`, `otpm`: bits 2 and 3) charge their
/// share like configured ones once learned: the reservation's input and output are
/// taken at admission and the reported split settled. (On Redis the split was sent
/// only for configured `itpm` / `otpm`, so a learned one was never charged.)
pub async fn auto_input_and_output_buckets_charge_their_share<H: Harness>(h: &H) {
    use polygate::backend::Split;
    let b = h.fresh().await;
    let q = QuotaParams {
        observe: true,
        auto: 0b1100,
        ..QuotaParams::default()
    };
    let dim = |limit: u64| {
        Some(Dim {
            limit: Some(limit),
            remaining: Some(limit),
            reset: None,
        })
    };
    let learn = Observation {
        dims: [None, None, dim(120), dim(60)],
        age: Duration::ZERO,
    };
    let tok = Tokens {
        total: 30,
        input: 20,
        output: 10,
    };
    let e = admit(&b, &q, tok).await;
    let p = bp();
    let r = ReportRequest::new(&p, &q, e, false, tok, Outcome::success(Some(30))).observed(&learn);
    assert!(b.report(S1, r).await.unwrap().applied);
    let near = |l: Option<f64>, want: f64, what: &str| {
        let l = l.unwrap_or_else(|| panic!("{what}: not learned"));
        assert!((l - want).abs() < 2.0, "{what}: level {l}, want {want}");
    };
    let l = levels(&b, &q).await;
    near(l[2], 120.0, "itpm learned, full");
    near(l[3], 60.0, "otpm learned, full");
    let e = admit(&b, &q, tok).await;
    let l = levels(&b, &q).await;
    near(l[2], 100.0, "itpm holds the reservation's 20 input tokens");
    near(l[3], 50.0, "otpm holds the reservation's 10 output tokens");
    let used = Outcome::Success {
        tokens: Some(70),
        split: Some(Split {
            input: 40,
            output: 30,
        }),
        count_attempt: true,
    };
    let r = ReportRequest::new(&p, &q, e, false, tok, used);
    assert!(b.report(S1, r).await.unwrap().applied);
    let l = levels(&b, &q).await;
    near(l[2], 80.0, "itpm charged the reported 40");
    near(l[3], 30.0, "otpm charged the reported 30");
}
