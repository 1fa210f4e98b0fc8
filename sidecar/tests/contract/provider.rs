//! Contract cases of §7a (quotas as each provider counts them), run on every backend
//! like the rest of the suite: burst capacity and its start level, the one-request
//! floor, an oversized reservation into a full bucket only, the debt floor, input
//! and output buckets with the proportional split, estimate charging, per-day
//! buckets, and `retry_after` as the longest wait over the buckets. Rates are chosen
//! so a real-time backend refills well under one unit while a case runs.

use std::time::Duration;

use polygate::backend::{
    Admit, AdmitRequest, Backend, Outcome, QuotaParams, ReportRequest, Reserve, Settlement, Split,
    Tokens,
};

use super::{assert_dur, assert_level, bp, ms, Harness, S1};

fn tok(total: u64, input: u64, output: u64) -> Tokens {
    Tokens {
        total,
        input,
        output,
    }
}

async fn levels<B: Backend>(b: &B, q: &QuotaParams) -> [Option<f64>; 6] {
    b.snapshot(S1, &bp(), q).await.unwrap().levels
}

/// `actual` is `expected`, or up to `refill` above it: what a real-time backend
/// refills while the case runs.
#[track_caller]
fn assert_near(actual: Option<f64>, expected: f64, refill: f64, what: &str) {
    let a = actual.unwrap_or_else(|| panic!("{what}: bucket missing"));
    assert!(
        a > expected - 0.5 && a < expected + refill + 0.5,
        "{what}: level {a} not within [{expected}, {expected} + {refill}]"
    );
}

#[track_caller]
fn denied(r: Reserve, what: &str) -> Duration {
    match r {
        Reserve::Denied { retry_after } => retry_after,
        r => panic!("{what}: expected a denial, got {r:?}"),
    }
}

pub async fn burst_sets_capacity_and_buckets_start_full<H: Harness>(h: &H) {
    let b = h.fresh().await;
    // 1,200 rpm with a 100 ms burst: 2 requests held, one more every 50 ms.
    let q = QuotaParams {
        rpm: Some(1_200),
        tpm: Some(600_000),
        burst: ms(100),
        ..QuotaParams::default()
    };
    let l = levels(&b, &q).await;
    assert_level(l[1], 2.0, "rpm bucket starts full at its burst capacity");
    assert_level(l[0], 1_000.0, "tpm bucket: 600,000 x 0.1 s / 60 s");
    assert_eq!(b.reserve(S1, &q, 1).await.unwrap(), Reserve::Reserved);
    assert_eq!(b.reserve(S1, &q, 1).await.unwrap(), Reserve::Reserved);
    let wait = denied(b.reserve(S1, &q, 1).await.unwrap(), "third request");
    assert_dur(h, wait, ms(50), "one request refills in 50 ms");
    h.advance(ms(55)).await;
    assert_eq!(b.reserve(S1, &q, 1).await.unwrap(), Reserve::Reserved);
}

pub async fn burst_capacity_is_never_below_one_request<H: Harness>(h: &H) {
    let b = h.fresh().await;
    // 30 rpm over 1 s would hold half a request: it holds one.
    let q = QuotaParams {
        rpm: Some(30),
        burst: Duration::from_secs(1),
        ..QuotaParams::default()
    };
    assert_level(levels(&b, &q).await[1], 1.0, "capacity 1");
    assert_eq!(b.reserve(S1, &q, 0).await.unwrap(), Reserve::Reserved);
    let wait = denied(b.reserve(S1, &q, 0).await.unwrap(), "second request");
    assert_dur(h, wait, Duration::from_secs(2), "30 rpm: one every 2 s");
}

pub async fn an_oversized_reservation_needs_a_full_bucket_and_leaves_debt<H: Harness>(h: &H) {
    let b = h.fresh().await;
    // 60,000 tpm over 100 ms: 100 tokens held, 1 token per ms.
    let q = QuotaParams {
        tpm: Some(60_000),
        burst: ms(100),
        ..QuotaParams::default()
    };
    assert_eq!(b.reserve(S1, &q, 40).await.unwrap(), Reserve::Reserved);
    let wait = denied(b.reserve(S1, &q, 250).await.unwrap(), "not full");
    assert_dur(h, wait, ms(40), "until the bucket is full again");
    h.advance(ms(45)).await;
    assert_eq!(b.reserve(S1, &q, 250).await.unwrap(), Reserve::Reserved);
    assert_near(levels(&b, &q).await[0], -150.0, 20.0, "left in debt");
    let wait = denied(b.reserve(S1, &q, 1).await.unwrap(), "in debt");
    assert_dur(h, wait, ms(151), "debt plus one token at 1 token/ms");
    // The floor is one minute's limit, not the (small) burst capacity: an absurd
    // count delays by at most a minute more, and a big estimate is not forgiven.
    b.settle(S1, &q, 0, Settlement::charge(u64::MAX / 4))
        .await
        .unwrap();
    assert_near(
        levels(&b, &q).await[0],
        -60_000.0,
        20.0,
        "floored at -limit",
    );
}

pub async fn input_and_output_buckets_settle_the_split_or_in_proportion<H: Harness>(h: &H) {
    let b = h.fresh().await;
    // 600,000 itpm / 60,000 otpm: 10 input and 1 output token per ms.
    let q = QuotaParams {
        itpm: Some(600_000),
        otpm: Some(60_000),
        ..QuotaParams::default()
    };
    assert_eq!(
        b.reserve(S1, &q, tok(150_000, 100_000, 50_000))
            .await
            .unwrap(),
        Reserve::Reserved
    );
    let l = levels(&b, &q).await;
    assert_near(l[2], 500_000.0, 1_000.0, "input reserved");
    assert_near(l[3], 10_000.0, 100.0, "output reserved");
    // A reported split settles each side to it.
    let how = Settlement::Charge {
        tokens: 120_000,
        split: Some(Split {
            input: 90_000,
            output: 30_000,
        }),
    };
    b.settle(S1, &q, tok(150_000, 100_000, 50_000), how)
        .await
        .unwrap();
    let l = levels(&b, &q).await;
    assert_near(l[2], 510_000.0, 1_000.0, "input charged 90,000");
    assert_near(l[3], 30_000.0, 100.0, "output charged 30,000");
    // A total alone splits in proportion to the reservation (60 : 40).
    let r = tok(50_000, 30_000, 20_000);
    assert_eq!(b.reserve(S1, &q, r).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, r, Settlement::charge(25_000))
        .await
        .unwrap();
    let l = levels(&b, &q).await;
    assert_near(l[2], 495_000.0, 1_000.0, "input charged 15,000");
    assert_near(l[3], 20_000.0, 100.0, "output charged 10,000");
    // The output bucket alone refuses, with its own wait.
    let wait = denied(
        b.reserve(S1, &q, tok(30_000, 0, 30_000)).await.unwrap(),
        "output short",
    );
    assert_dur(
        h,
        wait,
        Duration::from_secs(10),
        "10,000 output tokens at 1/ms",
    );
    // A report settles the same way in one step.
    let e = b.try_enter(S1, &bp()).await.unwrap();
    let r = tok(1_000, 500, 500);
    assert_eq!(b.reserve(S1, &q, r).await.unwrap(), Reserve::Reserved);
    let ok = Outcome::Success {
        tokens: None,
        split: Some(Split {
            input: 0,
            output: 1_000,
        }),
        count_attempt: true,
    };
    b.report(S1, ReportRequest::new(&bp(), &q, e.epoch, false, r, ok))
        .await
        .unwrap();
    let l = levels(&b, &q).await;
    assert_near(l[2], 495_000.0, 1_000.0, "input refunded");
    assert_near(l[3], 19_000.0, 100.0, "output charged 1,000");
}

pub async fn estimate_charging_keeps_the_reservation_whatever_is_reported<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        tpm: Some(60),
        otpm: Some(60),
        charge_estimate: true,
        ..QuotaParams::default()
    };
    let r = tok(40, 10, 30);
    assert_eq!(b.reserve(S1, &q, r).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, r, Settlement::charge(5)).await.unwrap();
    let l = levels(&b, &q).await;
    assert_level(l[0], 20.0, "a smaller usage is not refunded");
    assert_level(l[3], 30.0, "nor on the output side");
    let e = b.try_enter(S1, &bp()).await.unwrap();
    let big = Outcome::Success {
        tokens: Some(1_000),
        split: None,
        count_attempt: true,
    };
    let r2 = tok(10, 5, 5);
    assert_eq!(b.reserve(S1, &q, r2).await.unwrap(), Reserve::Reserved);
    b.report(S1, ReportRequest::new(&bp(), &q, e.epoch, false, r2, big))
        .await
        .unwrap();
    assert_level(
        levels(&b, &q).await[0],
        10.0,
        "a larger usage is not debited",
    );
    // Nothing sent: refunds still apply.
    b.settle(S1, &q, r, Settlement::RefundAll).await.unwrap();
    assert_level(
        levels(&b, &q).await[0],
        50.0,
        "a cancellation gives it back",
    );
    let _ = h;
}

pub async fn per_day_buckets_hold_a_day_and_ignore_burst<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        rpd: Some(2),
        tpd: Some(1_000),
        burst: Duration::from_secs(1),
        // A day's debt allowed (§12's bound is its own case below).
        max_debt: Duration::from_secs(86_400),
        ..QuotaParams::default()
    };
    let l = levels(&b, &q).await;
    assert_level(l[5], 2.0, "rpd: a day's worth, burst does not apply");
    assert_level(l[4], 1_000.0, "tpd: a day's worth");
    assert_eq!(b.reserve(S1, &q, 600).await.unwrap(), Reserve::Reserved);
    b.settle(S1, &q, 600, Settlement::charge(1_100))
        .await
        .unwrap();
    assert_level(levels(&b, &q).await[4], -100.0, "tpd in debt");
    let wait = denied(b.reserve(S1, &q, 1).await.unwrap(), "tpd in debt");
    // 101 tokens at 1,000 per day.
    assert_dur(
        h,
        wait,
        Duration::from_micros(101 * 86_400_000),
        "a day's refill",
    );
    let q = QuotaParams {
        rpd: Some(2),
        ..QuotaParams::default()
    };
    assert_eq!(b.reserve(S1, &q, 0).await.unwrap(), Reserve::Reserved);
    let wait = denied(b.reserve(S1, &q, 0).await.unwrap(), "rpd spent");
    assert_dur(
        h,
        wait,
        Duration::from_secs(12 * 3600),
        "half a day per request",
    );
}

pub async fn quota_retry_after_is_the_longest_wait_over_the_buckets<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let t0 = std::time::Instant::now();
    // Over a 100 ms burst: 2 requests held, one back every 50 ms; 10 tokens held,
    // one back every 10 ms; 1,000 input tokens held, 10 back every ms.
    let q = QuotaParams {
        rpm: Some(1_200),
        tpm: Some(6_000),
        itpm: Some(600_000),
        burst: ms(100),
        ..QuotaParams::default()
    };
    assert_eq!(
        b.reserve(S1, &q, tok(6, 6, 0)).await.unwrap(),
        Reserve::Reserved
    );
    assert_eq!(
        b.reserve(S1, &q, tok(4, 4, 0)).await.unwrap(),
        Reserve::Reserved
    );
    // Requests short by one (50 ms), tokens short by 8 (80 ms), input fine.
    let wait = denied(b.reserve(S1, &q, tok(8, 8, 0)).await.unwrap(), "two short");
    assert_dur(h, wait, ms(80), "the token bucket is the longer wait");
    // Tokens short by 2 (20 ms): now the request bucket is the longer.
    let wait = denied(b.reserve(S1, &q, tok(2, 2, 0)).await.unwrap(), "two short");
    assert_dur(h, wait, ms(50), "the request bucket is the longer wait");
    let l = levels(&b, &q).await;
    // Empty after the two reservations, refilling one token per 10 ms since: a
    // refusal that took its 8 or 2 tokens would show as debt (a loaded machine may
    // have let more than 10 ms pass, so the upper bound follows the clock).
    let refilled = t0.elapsed().as_secs_f64() * 100.0;
    let tpm = l[0].unwrap();
    assert!(
        tpm > -0.5 && tpm < 1.0 + refilled,
        "a refusal takes nothing (tpm): {l:?} after {refilled:.1} tokens' refill"
    );
    assert!(
        l[2].unwrap() > 989.0,
        "a refusal takes nothing (itpm): {l:?}"
    );
}

/// §12: the debt one report creates is clamped, in every bucket (per-day ones
/// included), to what refills within `max_rate_limit_block`: a success reporting
/// 10^9 tokens on a source with `tpd = 20M` leaves it usable again within that bound
/// (before the clamp: a level of −20M, every host refused for about two days).
pub async fn one_report_s_debt_is_bounded_by_max_rate_limit_block<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        tpd: Some(20_000_000),
        ..QuotaParams::default()
    };
    let block = Duration::from_secs(600);
    assert_eq!(q.max_debt, block, "the default is max_rate_limit_block's");
    let Admit::Admitted {
        epoch, is_probe, ..
    } = b.admit(S1, AdmitRequest::new(&bp(), &q, 0)).await.unwrap()
    else {
        panic!("a fresh source admits")
    };
    let huge = Outcome::success(Some(1_000_000_000));
    b.report(S1, ReportRequest::new(&bp(), &q, epoch, is_probe, 0, huge))
        .await
        .unwrap();
    // 10 minutes of a day's refill: 20M × 600 / 86,400 ≈ 138,889 tokens.
    let taken = 20_000_000.0 * 600.0 / 86_400.0;
    assert_near(levels(&b, &q).await[4], 20_000_000.0 - taken, 1.0, "tpd");
    // A reservation needing the whole bucket waits the clamped debt, no longer.
    match b
        .admit(S1, AdmitRequest::new(&bp(), &q, 20_000_000))
        .await
        .unwrap()
    {
        Admit::RateLimited { retry_after } => assert_dur(h, retry_after, block, "whole bucket"),
        a => panic!("the debt holds a whole-bucket reservation: {a:?}"),
    }

    // Every token bucket, with a shorter bound: each takes at most 30 s of its own
    // refill from one report, whatever the split.
    let b = h.fresh().await;
    let q = QuotaParams {
        tpm: Some(6_000),
        itpm: Some(6_000),
        otpm: Some(600),
        tpd: Some(8_640_000),
        max_debt: Duration::from_secs(30),
        ..QuotaParams::default()
    };
    let r = tok(10, 5, 5);
    assert_eq!(b.reserve(S1, &q, r).await.unwrap(), Reserve::Reserved);
    let how = Settlement::Charge {
        tokens: 1_000_000_000,
        split: Some(Split {
            input: 600_000_000,
            output: 400_000_000,
        }),
    };
    b.settle(S1, &q, r, how).await.unwrap();
    let l = levels(&b, &q).await;
    // reservation + 30 s of refill: tpm 10 + 3,000; itpm 5 + 3,000; otpm 5 + 300;
    // tpd 10 + 3,000 (100 per second too).
    assert_near(l[0], 6_000.0 - 3_010.0, 10.0, "tpm");
    assert_near(l[2], 6_000.0 - 3_005.0, 10.0, "itpm");
    assert_near(l[3], 600.0 - 305.0, 1.0, "otpm");
    assert_near(l[4], 8_640_000.0 - 3_010.0, 10.0, "tpd");
    // A reservation that fits only after every bucket is full again: ~30 s.
    let wait = denied(
        b.reserve(S1, &q, tok(6_000, 6_000, 0)).await.unwrap(),
        "debt",
    );
    assert!(
        wait > Duration::from_secs(29) && wait <= Duration::from_millis(30_101),
        "the wait is the clamped debt plus the reservation's refill: {wait:?}"
    );
}
