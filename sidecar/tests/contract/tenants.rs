//! §19 contract cases: a tenant's ledger beside the source's gates, the same on every
//! backend (memory, one Redis, a Redis Cluster where the ledger lives in its own
//! slot and is reserved in a step of its own).

use std::sync::Arc;

use polygate::backend::{
    Admit, AdmitRequest, Backend, Charge, LedgerView, Outcome, QuotaParams, ReportRequest,
    Settlement, TenantLimit, TenantParams, Tokens,
};
use polygate::gate::{TenantAdmit, TenantKey, TenantSettle};

use super::{bp, ms, qp, Harness, S1, S2};

/// The scope every case charges its tenants in.
const SCOPE: &str = "chat";

fn key(tenant: &str) -> TenantKey<'_> {
    TenantKey {
        scope: SCOPE,
        tenant,
    }
}

/// A tenant with `rpm` requests per minute (no other limit).
fn rpm(n: u64) -> TenantParams {
    TenantParams {
        q: QuotaParams {
            rpm: Some(n),
            ..QuotaParams::default()
        },
        ..TenantParams::default()
    }
}

fn ask<'a>(tenant: &'a str, p: &'a TenantParams, tokens: u64, cost: u64) -> TenantAdmit<'a> {
    TenantAdmit {
        key: key(tenant),
        params: p,
        charge: Charge {
            tokens: Tokens::from(tokens),
            cost,
        },
        max_tenants: 1000,
    }
}

/// A source without buckets: only the tenant can refuse.
fn open() -> QuotaParams {
    QuotaParams::default()
}

async fn admit<B: Backend>(b: &B, source: &str, q: &QuotaParams, t: TenantAdmit<'_>) -> Admit {
    b.admit(
        source,
        AdmitRequest::new(&bp(), q, t.charge.tokens).tenant(t),
    )
    .await
    .expect("admit")
}

async fn view<B: Backend>(b: &B, tenant: &str, p: &TenantParams) -> LedgerView {
    b.tenant_snapshot(key(tenant), p)
        .await
        .expect("tenant snapshot")
        .unwrap_or(LedgerView {
            levels: [None; 4],
            spent_day: 0,
            spent_month: 0,
            in_flight: 0,
        })
}

fn day_of(a: &Admit) -> u32 {
    match a {
        Admit::Admitted { tenant_day, .. } => *tenant_day,
        other => panic!("expected an admission, got {other:?}"),
    }
}

/// The tenant's bucket refuses with its name and a wait; a refusal takes nothing from
/// the source (its rpm bucket still has what the admissions left).
pub async fn tenant_limit_refuses_before_the_source_and_takes_nothing<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let t = rpm(2);
    let q = QuotaParams {
        rpm: Some(10),
        ..QuotaParams::default()
    };
    for _ in 0..2 {
        let a = admit(&b, S1, &q, ask("acme", &t, 5, 0)).await;
        assert!(matches!(a, Admit::Admitted { .. }), "{a:?}");
    }
    match admit(&b, S1, &q, ask("acme", &t, 5, 0)).await {
        Admit::TenantLimited { limit, retry_after } => {
            assert_eq!(limit, TenantLimit::Rpm);
            // 2 per minute: the next request refills in 30 s.
            assert!(
                retry_after > ms(25_000) && retry_after <= ms(30_001),
                "{retry_after:?}"
            );
        }
        other => panic!("the tenant's rpm must refuse: {other:?}"),
    }
    let snap = b.snapshot(S1, &bp(), &q).await.unwrap();
    super::assert_level(snap.requests_available, 8.0, "the refusal took no request");
    // Another tenant is not held back by this one.
    let a = admit(&b, S1, &q, ask("globex", &t, 5, 0)).await;
    assert!(matches!(a, Admit::Admitted { .. }), "{a:?}");
    let v = view(&b, "acme", &t).await;
    assert_eq!(v.in_flight, 2);
    super::assert_level(v.levels[1], 0.0, "acme's rpm");
}

/// The source refusing (its quota, its breaker) takes nothing from the tenant: on a
/// Cluster the tenant's first step is given back.
pub async fn source_refusal_gives_the_tenant_everything_back<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let t = TenantParams {
        q: QuotaParams {
            rpm: Some(10),
            tpm: Some(1000),
            ..QuotaParams::default()
        },
        usd_per_day: Some(1_000_000),
        ..TenantParams::default()
    };
    let q = qp(); // 2 requests per minute
    for _ in 0..2 {
        let a = admit(&b, S1, &q, ask("acme", &t, 10, 100)).await;
        assert!(matches!(a, Admit::Admitted { .. }), "{a:?}");
    }
    let a = admit(&b, S1, &q, ask("acme", &t, 10, 100)).await;
    assert!(matches!(a, Admit::RateLimited { .. }), "{a:?}");
    let v = view(&b, "acme", &t).await;
    assert_eq!(v.in_flight, 2, "the refused admission holds nothing");
    assert_eq!(v.spent_day, 200);
    super::assert_level(v.levels[0], 980.0, "tpm");
    super::assert_level(v.levels[1], 8.0, "rpm");
}

/// A settlement gives the tenant back what its usage did not take: tokens by §7's
/// table, dollars by the difference between the estimate and the cost; a refund
/// gives everything back.
pub async fn settlements_give_back_tokens_and_dollars<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let t = TenantParams {
        q: QuotaParams {
            tpm: Some(1000),
            rpm: Some(10),
            ..QuotaParams::default()
        },
        usd_per_day: Some(10_000),
        usd_per_month: Some(100_000),
    };
    let q = open();
    let a = admit(&b, S1, &q, ask("acme", &t, 100, 600)).await;
    let (epoch, day) = match a {
        Admit::Admitted {
            epoch, tenant_day, ..
        } => (epoch, tenant_day),
        other => panic!("{other:?}"),
    };
    let settle = TenantSettle {
        key: key("acme"),
        params: &t,
        charge: Charge {
            tokens: Tokens::from(100),
            cost: 600,
        },
        how: Settlement::charge(40),
        cost: 250,
        day,
    };
    let outcome = Outcome::Success {
        tokens: Some(40),
        split: None,
        count_attempt: true,
    };
    b.report(
        S1,
        ReportRequest::new(&bp(), &q, epoch, false, 100, outcome).tenant(settle),
    )
    .await
    .expect("report");
    let v = view(&b, "acme", &t).await;
    assert_eq!((v.in_flight, v.spent_day, v.spent_month), (0, 250, 250));
    super::assert_level(v.levels[0], 960.0, "tpm charged the usage");
    super::assert_level(v.levels[1], 9.0, "rpm charged one request");
    // The tenant step alone and its refund net to zero (an abandoned permit's path
    // keeps the estimate instead).
    let r = b.tenant_reserve(ask("acme", &t, 200, 1000)).await.unwrap();
    let day = day_of(&r);
    let v = view(&b, "acme", &t).await;
    assert_eq!((v.in_flight, v.spent_day), (1, 1250));
    b.tenant_settle(TenantSettle {
        key: key("acme"),
        params: &t,
        charge: Charge {
            tokens: Tokens::from(200),
            cost: 1000,
        },
        how: Settlement::RefundAll,
        cost: 0,
        day,
    })
    .await
    .unwrap();
    let v = view(&b, "acme", &t).await;
    assert_eq!((v.in_flight, v.spent_day, v.spent_month), (0, 250, 250));
    super::assert_level(v.levels[0], 960.0, "the refund gave the tokens back");
    super::assert_level(v.levels[1], 9.0, "and the request");
}

/// A dollar budget refuses when spent plus the estimate passes it, until its window
/// ends (never a bucket's refill); usage above the estimate is charged after the fact.
pub async fn a_dollar_budget_refuses_until_its_window_ends<H: Harness>(h: &H) {
    let b = h.fresh().await;
    let t = TenantParams {
        usd_per_day: Some(1_000),
        ..TenantParams::default()
    };
    let q = open();
    let a = admit(&b, S1, &q, ask("acme", &t, 10, 600)).await;
    let day = day_of(&a);
    match admit(&b, S2, &q, ask("acme", &t, 10, 600)).await {
        Admit::TenantLimited { limit, retry_after } => {
            assert_eq!(limit, TenantLimit::UsdPerDay);
            let secs_left = 86_400 - (unix_now() % 86_400);
            assert!(
                retry_after.as_secs().abs_diff(secs_left) <= 2,
                "until midnight UTC: {retry_after:?} vs {secs_left} s"
            );
        }
        other => panic!("the budget must refuse: {other:?}"),
    }
    // Charged more than estimated: 900 spent, a call of 100 still fits, one of 101 not.
    b.tenant_settle(TenantSettle {
        key: key("acme"),
        params: &t,
        charge: Charge {
            tokens: Tokens::from(10),
            cost: 600,
        },
        how: Settlement::charge(10),
        cost: 900,
        day,
    })
    .await
    .unwrap();
    assert_eq!(view(&b, "acme", &t).await.spent_day, 900);
    let over = admit(&b, S1, &q, ask("acme", &t, 1, 101)).await;
    assert!(matches!(over, Admit::TenantLimited { .. }), "{over:?}");
    let fits = admit(&b, S1, &q, ask("acme", &t, 1, 100)).await;
    assert!(matches!(fits, Admit::Admitted { .. }), "{fits:?}");
    // An estimate above the whole budget never fits, on a fresh tenant too.
    let huge = admit(&b, S1, &q, ask("initech", &t, 1, 1_001)).await;
    assert!(matches!(huge, Admit::TenantLimited { .. }), "{huge:?}");
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Concurrent admissions of one tenant from two hosts never exceed its limit: of 40
/// at once on a tenant allowed 10, exactly 10 pass (§19: exact across the fleet).
pub async fn concurrent_admissions_never_exceed_the_tenant<H: Harness>(h: &H) {
    let b = Arc::new(h.fresh().await);
    let other = h.second(&b).await.map(Arc::new);
    let t = rpm(10);
    let q = open();
    let mut tasks = Vec::new();
    for i in 0..40 {
        let host = match (&other, i % 2) {
            (Some(o), 1) => o.clone(),
            _ => b.clone(),
        };
        let t = t;
        let q = q;
        tasks.push(async move {
            let source = if i % 3 == 0 { S2 } else { S1 };
            matches!(
                admit(&*host, source, &q, ask("acme", &t, 1, 0)).await,
                Admit::Admitted { .. }
            )
        });
    }
    let admitted = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .filter(|a| *a)
        .count();
    assert_eq!(admitted, 10, "exactly the tenant's 10 requests per minute");
    assert_eq!(view(&*b, "acme", &t).await.in_flight, 10);
}

/// A ledger whose buckets refilled and that has nothing in flight reads as fresh
/// (the backend may forget it).
pub async fn a_refilled_ledger_reads_as_fresh<H: Harness>(h: &H) {
    let b = h.fresh().await;
    // 60 000 000 tokens a minute: 1 000 refill in 1 ms.
    let t = TenantParams {
        q: QuotaParams {
            tpm: Some(60_000_000),
            ..QuotaParams::default()
        },
        ..TenantParams::default()
    };
    let q = open();
    let a = admit(&b, S1, &q, ask("acme", &t, 1000, 0)).await;
    let (epoch, day) = match a {
        Admit::Admitted {
            epoch, tenant_day, ..
        } => (epoch, tenant_day),
        other => panic!("{other:?}"),
    };
    let settle = TenantSettle {
        key: key("acme"),
        params: &t,
        charge: Charge {
            tokens: Tokens::from(1000),
            cost: 0,
        },
        how: Settlement::charge(1000),
        cost: 0,
        day,
    };
    let outcome = Outcome::Success {
        tokens: Some(1000),
        split: None,
        count_attempt: true,
    };
    b.report(
        S1,
        ReportRequest::new(&bp(), &q, epoch, false, 1000, outcome).tenant(settle),
    )
    .await
    .unwrap();
    h.advance(ms(20)).await;
    let v = view(&b, "acme", &t).await;
    assert_eq!(v.in_flight, 0);
    super::assert_level(v.levels[0], 60_000_000.0, "refilled");
}
