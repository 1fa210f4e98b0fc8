//! Contract cases of §18 `learn_rate = "aimd"`, run on every backend: a 429 nothing
//! predicted cuts the source's per-minute limits ×0.7 for every host sharing the
//! quota, and the factor recovers additively; a 429 while a block is in force (the
//! ledger knew), and a source that does not learn, cut nothing. The cases use a fast
//! recovery (20 % of the limit a second) so a real-time backend shows it in 1.6 s.

use std::time::Duration;

use polygate::backend::{
    Admit, AdmitRequest, AdmittedRate, Backend, Dim, Held, Observation, Outcome, QuotaParams,
    ReportRequest, SeenCut,
};

use super::{assert_level, bp, classes, ms, Harness, S1};

/// 10 requests per minute, learning with a recovery of 200,000 ppm a second.
fn q() -> QuotaParams {
    QuotaParams {
        rpm: Some(10),
        learn: 200_000,
        ..QuotaParams::default()
    }
}

async fn rpm_level<B: Backend>(b: &B, q: &QuotaParams) -> Option<f64> {
    b.snapshot(S1, &bp(), q).await.unwrap().levels[1]
}

async fn admit<B: Backend>(b: &B, q: &QuotaParams) -> Option<u64> {
    match b.admit(S1, AdmitRequest::new(&bp(), q, 0)).await.unwrap() {
        Admit::Admitted { epoch, .. } => Some(epoch),
        Admit::RateLimited { .. } => None,
        a => panic!("expected a grant or a quota refusal, got {a:?}"),
    }
}

async fn report_429<B: Backend>(b: &B, q: &QuotaParams, epoch: u64, retry: Option<Duration>) {
    let p = bp();
    let r = ReportRequest::new(
        &p,
        q,
        epoch,
        false,
        0u64,
        Outcome::RateLimited { retry_after: retry },
    );
    b.report(S1, r).await.unwrap();
}

pub async fn a_429_cuts_the_rate_on_every_host_and_it_recovers<H: Harness>(h: &H) {
    let one = h.fresh().await;
    let two = h.second(&one).await;
    let two = two.as_ref().unwrap_or(&one);
    let q = q();
    // One request taken (6 s of refill at 10/min), then the provider refuses it.
    let e = admit(&one, &q).await.expect("a full bucket admits");
    report_429(&one, &q, e, None).await;
    // The other host reads the limit cut to 7/min: 7 − 6 s × 7/60.
    assert_level(rpm_level(two, &q).await, 6.3, "cut ×0.7 on the other host");
    // Half a second later the factor reads 0.8 (0.7 + 0.5 s × 20 %/s): 8 − 5.5 s × 8/60.
    h.advance(ms(500)).await;
    assert_level(
        rpm_level(two, &q).await,
        7.27,
        "recovering: 0.8 of the limit",
    );
    // Recovery: 1.6 s at +20 %/s brings the factor back to whole: 10 − 4.4 s × 10/60.
    h.advance(ms(1_100)).await;
    assert_level(rpm_level(&one, &q).await, 9.27, "recovered to the limit");
    // A later 429 (over a second after the cut) cuts again, and the other host
    // admits what 7/min leaves: 7 − (4.4 + 6) s × 7/60 = 5.79, so five calls.
    let e = admit(two, &q).await.expect("room for one more");
    report_429(two, &q, e, None).await;
    let mut admitted = 0;
    while admit(&one, &q).await.is_some() {
        admitted += 1;
        assert!(admitted <= 8, "the cut did not lower the admitted rate");
    }
    assert_eq!(
        admitted, 5,
        "five calls fit a bucket cut to 7/min (eight would at 10/min)"
    );
}

pub async fn a_predicted_429_or_one_of_a_source_that_does_not_learn_cuts_nothing<H: Harness>(
    h: &H,
) {
    let b = h.fresh().await;
    let q = q();
    let first = admit(&b, &q).await.expect("admitted");
    let _second = admit(&b, &q).await.expect("admitted");
    // Another call's 429 already blocked the quota: this one was foretold.
    b.block_quota(S1, ms(300)).await.unwrap();
    report_429(&b, &q, first, None).await;
    assert_level(
        rpm_level(&b, &q).await,
        8.0,
        "no cut while blocked: 10 − 12 s × 10/60",
    );
    let plain = QuotaParams { learn: 0, ..q };
    let b = h.fresh().await;
    let e = admit(&b, &plain).await.expect("admitted");
    report_429(&b, &plain, e, None).await;
    assert_level(
        rpm_level(&b, &plain).await,
        9.0,
        "a source that does not learn",
    );
}

/// A grant: its epoch and what its admission saw of the learned factor.
#[derive(Clone, Copy)]
struct Grant {
    epoch: u64,
    rate: AdmittedRate,
}

async fn admit_t<B: Backend>(b: &B, q: &QuotaParams, t: u64) -> Grant {
    match b.admit(S1, AdmitRequest::new(&bp(), q, t)).await.unwrap() {
        Admit::Admitted { epoch, rate, .. } => Grant { epoch, rate },
        a => panic!("expected a grant, got {a:?}"),
    }
}

async fn report_429_t<B: Backend>(b: &B, q: &QuotaParams, g: Grant, t: u64) {
    let p = bp();
    let r = ReportRequest::new(
        &p,
        q,
        g.epoch,
        false,
        t,
        Outcome::RateLimited { retry_after: None },
    )
    .admitted_at(g.rate);
    b.report(S1, r).await.unwrap();
}

/// 60 tokens per minute (slow enough that a real-time backend's milliseconds do not
/// show), learning slowly (1,000 ppm a second).
fn tpm_60() -> QuotaParams {
    QuotaParams {
        tpm: Some(60),
        learn: 1_000,
        ..QuotaParams::default()
    }
}

/// A 429's token refund gives back what its reservation took, not 1/0.7 of it: the
/// report settles at the factor in force before its cut, then cuts. 60 tpm (slow
/// enough that a real-time backend's milliseconds do not show), two calls of 10
/// tokens in flight (20 s of refill); the 429 refunds its 10 s and cuts to 42 tpm:
/// 42 − 10 s × 0.7/s = 35 (a refund converted at the cut rate, 10 tokens = 14.3 s,
/// would leave 38).
pub async fn a_429_refunds_what_its_reservation_took_before_it_cuts<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = tpm_60();
    let a = admit_t(&b, &q, 10).await;
    let _other = admit_t(&b, &q, 10).await; // still in flight
    report_429_t(&b, &q, a, 10).await;
    let lvl = b.snapshot(S1, &bp(), &q).await.unwrap().levels[0];
    assert_level(
        lvl,
        35.0,
        "the 429's own reservation refunded, then the cut",
    );
}

/// A 429 reported after the factor was cut (the second of a burst: only the first
/// cuts) refunds what its reservation took at its admission's factor, not 1/0.7 of
/// it: three calls of 10 tokens at 60 tpm (30 s of refill), A's 429 refunds 10 s and
/// cuts to 42 tpm, B's refunds its 10 s: 42 − 10 s × 0.7/s = 35 (B's 10 tokens
/// converted at the cut rate, 14.3 s, would leave 38).
pub async fn a_second_429_refunds_what_it_took<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = tpm_60();
    let a = admit_t(&b, &q, 10).await;
    let bb = admit_t(&b, &q, 10).await;
    let _c = admit_t(&b, &q, 10).await; // still in flight
    report_429_t(&b, &q, a, 10).await; // refunds at factor 1, cuts to 42 tpm
    report_429_t(&b, &q, bb, 10).await; // within the second: no second cut
    let lvl = b.snapshot(S1, &bp(), &q).await.unwrap().levels[0];
    assert_level(lvl, 35.0, "B's refund is what B took");
}

/// 100 requests per minute, learning slowly (1,000 ppm a second).
fn rpm_100() -> QuotaParams {
    QuotaParams {
        rpm: Some(100),
        learn: 1_000,
        ..QuotaParams::default()
    }
}

/// A 429 of a call admitted before the last cut cuts nothing, however late it is
/// reported (a slow response: it says nothing of the rate after that cut, as classic
/// AIMD cuts only on the loss of a packet sent after the last cut); one of a call
/// admitted after it cuts. 100 rpm, a 429 keeps its request (1.2 s of refill for A
/// and B): A's 429 cuts to 70/min; 1.1 s later (past the once-a-second rule) B's 429
/// leaves it there: 70 − 0.1 s × 70/60 = 69.9 (a second cut: 48.9). C, admitted after
/// the cut (0.857 s at 70/min), gets a 429 on the other host that cuts to 49/min:
/// 49 − 0.957 s × 49/60 = 48.2.
pub async fn a_429_of_a_call_sent_before_the_last_cut_cuts_nothing<H: Harness>(h: &H) {
    let one = h.fresh().await;
    let two = h.second(&one).await;
    let two = two.as_ref().unwrap_or(&one);
    let q = rpm_100();
    let a = admit_t(&one, &q, 0).await;
    let b = admit_t(two, &q, 0).await;
    report_429_t(&one, &q, a, 0).await; // cuts to 0.7
    h.advance(ms(1_100)).await;
    report_429_t(two, &q, b, 0).await;
    let lvl = one.snapshot(S1, &bp(), &q).await.unwrap().levels[1];
    assert_level(lvl, 69.9, "B was sent before the cut: no second cut");
    let c = admit_t(&one, &q, 0).await;
    assert!(
        matches!(c.rate.cut, SeenCut::At(_)),
        "a grant under a cut carries its date: {:?}",
        c.rate
    );
    report_429_t(two, &q, c, 0).await;
    let lvl = one.snapshot(S1, &bp(), &q).await.unwrap().levels[1];
    assert_level(lvl, 48.2, "C was sent after it: its 429 cuts again");
}

/// Two 429s within a second, from two hosts, cut once (`CUT_EVERY`, `gate.lua`
/// `LCUT_EVERY`): 70 − 1.2 s × 70/60 = 68.6 (two cuts: 49 − 1.2 s × 49/60 = 48.0).
pub async fn two_429s_within_a_second_cut_once_across_hosts<H: Harness>(h: &H) {
    let one = h.fresh().await;
    let two = h.second(&one).await;
    let two = two.as_ref().unwrap_or(&one);
    let q = rpm_100();
    let e1 = admit_t(&one, &q, 0).await;
    let e2 = admit_t(two, &q, 0).await;
    report_429_t(&one, &q, e1, 0).await;
    report_429_t(two, &q, e2, 0).await;
    let lvl = one.snapshot(S1, &bp(), &q).await.unwrap().levels[1];
    assert_level(lvl, 68.6, "one cut for the 429s of one second");
}

/// §15's class limits apply to the limit as learned: 10 rpm cut to 7/min, batch
/// limited to 50 % of the bucket (30 s of its refill time) takes 3 calls of 8.6 s
/// (at the uncut 10/min, 6 s each, it would take 5).
pub async fn a_class_limit_follows_the_learned_rate<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        rpm: Some(10),
        learn: 1_000,
        ..QuotaParams::default()
    };
    let e = admit_t(&b, &q, 0).await;
    report_429_t(&b, &q, e, 0).await; // factor 0.7: 7/min
    let batch = classes(1_000_000, 0, 500_000, 1);
    let mut n = 0;
    loop {
        match b
            .admit(S1, AdmitRequest::new(&bp(), &q, 0).class(&batch))
            .await
            .unwrap()
        {
            Admit::Admitted { .. } => n += 1,
            Admit::ClassHeld {
                why: Held::Limit, ..
            } => break,
            a => panic!("after {n} grants: {a:?}"),
        }
        assert!(n < 10, "the class limit never held");
    }
    assert_eq!(n, 3, "batch's 50 % of a bucket cut to 7/min");
}

/// An `"auto"` limit the provider changes while the factor is cut is followed: 1000
/// → 1001 scales to 700 either way at 0.7, but the limit learned is the provider's.
pub async fn an_auto_limit_changed_while_cut_is_followed<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let q = QuotaParams {
        tpm: None,
        observe: true,
        auto: 1,
        learn: 200_000,
        ..QuotaParams::default()
    };
    let o = |l: u64| Observation {
        dims: [
            Some(Dim {
                limit: Some(l),
                remaining: Some(l),
                reset: None,
            }),
            None,
            None,
            None,
        ],
        age: Duration::ZERO,
    };
    let p = bp();
    let ok = |g: Grant| {
        ReportRequest::new(&p, &q, g.epoch, false, 10u64, Outcome::success(Some(10)))
            .admitted_at(g.rate)
    };
    let e = admit_t(&b, &q, 10).await;
    b.report(S1, ok(e).observed(&o(1_000))).await.unwrap();
    let e = admit_t(&b, &q, 10).await;
    report_429_t(&b, &q, e, 10).await; // factor 0.7
    let e = admit_t(&b, &q, 10).await;
    let seen = o(1_001);
    b.report(S1, ok(e).observed(&seen)).await.unwrap();
    h.advance(ms(1_600)).await; // whole again, the buckets refilled
    let lvl = b.snapshot(S1, &bp(), &q).await.unwrap().levels[0];
    assert_level(lvl, 1_001.0, "the limit the provider said last");
}
