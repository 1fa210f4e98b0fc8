//! §19 on Redis, beyond the contract suite: a tenant's admission and report stay one
//! script call each on one server (the ledger is the third key), the ledger's key is
//! hash-tagged and expires, and `gate.lua`'s calendar is `gate::tenant`'s.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use polygate::backend::redis::{RedisBackend, RedisOptions};
use polygate::backend::{
    Admit, AdmitRequest, Backend, BreakerParams, Charge, Outcome, QuotaParams, ReportRequest,
    Settlement, TenantParams, Tokens,
};
use polygate::clock::TokioClock;
use polygate::config::OnBackendError;
use polygate::gate::tenant::calendar;
use polygate::gate::{TenantAdmit, TenantKey, TenantSettle};
use support::redis_server::RedisServer;

static NEXT: AtomicU64 = AtomicU64::new(0);

fn bp() -> BreakerParams {
    BreakerParams {
        failure_threshold: 3,
        failure_rate: 0.5,
        min_calls: 10,
        window: Duration::from_secs(60),
        cooldown: Duration::from_millis(100),
        max_cooldown: Duration::from_millis(400),
        probe_ttl: Duration::from_millis(150),
    }
}

async fn backend(srv: &RedisServer) -> (RedisBackend, String) {
    let prefix = format!(
        "tt{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let opts = RedisOptions {
        url: srv.url(),
        cluster_nodes: vec![],
        key_prefix: prefix.clone(),
        timeout: Duration::from_secs(2),
        on_backend_error: OnBackendError::FailClosed,
        sources: vec!["s1".into()],
        degraded_share: polygate::config::DegradedShare::Auto,
    };
    let b = RedisBackend::connect(opts, Arc::new(TokioClock::new()))
        .await
        .expect("connect");
    (b, prefix)
}

fn tenant() -> TenantParams {
    TenantParams {
        q: QuotaParams {
            tpm: Some(100_000),
            rpm: Some(1000),
            ..QuotaParams::default()
        },
        usd_per_day: Some(1_000_000_000),
        usd_per_month: None,
    }
}

const KEY: TenantKey<'static> = TenantKey {
    scope: "chat",
    tenant: "acme",
};

async fn admit_report(b: &RedisBackend, t: &TenantParams) {
    admit_then(b, t, 7, 700, || {}).await
}

/// An admission of 10 tokens at 1000 n$, `between()`, and its report settled at
/// `tokens` and `cost`.
async fn admit_then(
    b: &RedisBackend,
    t: &TenantParams,
    tokens: u64,
    cost: u64,
    between: impl FnOnce(),
) {
    let q = QuotaParams {
        tpm: Some(60_000),
        ..QuotaParams::default()
    };
    let charge = Charge {
        tokens: Tokens::from(10),
        cost: 1000,
    };
    let ask = TenantAdmit {
        key: KEY,
        params: t,
        charge,
        max_tenants: 10,
    };
    let a = b
        .admit("s1", AdmitRequest::new(&bp(), &q, 10).tenant(ask))
        .await
        .unwrap();
    let Admit::Admitted {
        epoch, tenant_day, ..
    } = a
    else {
        panic!("admit refused: {a:?}")
    };
    between();
    let settle = TenantSettle {
        key: KEY,
        params: t,
        charge,
        how: Settlement::charge(tokens),
        cost,
        day: tenant_day,
    };
    let outcome = Outcome::Success {
        tokens: Some(tokens),
        split: None,
        count_attempt: true,
    };
    let r = b
        .report(
            "s1",
            ReportRequest::new(&bp(), &q, epoch, false, 10, outcome).tenant(settle),
        )
        .await
        .unwrap();
    assert!(r.applied);
}

/// §19 costs no round trip: with a tenant, an admission and a report are still one
/// FCALL each (the ledger rides as the third key), and the ledger's key is
/// `{prefix:t:scope:tenant}` with an expiry.
#[tokio::test]
async fn a_tenant_adds_no_round_trip_and_its_ledger_expires() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, prefix) = backend(&srv).await;
    b.stop_heartbeat();
    let t = tenant();
    admit_report(&b, &t).await; // loads the library
    srv.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..10 {
        admit_report(&b, &t).await;
    }
    assert_eq!(
        srv.command_calls("fcall"),
        20,
        "one FCALL per admit and report"
    );
    let key = format!("{{{prefix}:t:chat:acme}}");
    let ttl: i64 = srv.cli(&["PTTL", &key]).trim().parse().expect("PTTL");
    assert!(ttl > 0, "the ledger {key} must expire (PTTL {ttl})");
    // Expiry no sooner than the end of the day the spend is in.
    let to_midnight_ms = (86_400 - (unix_now() % 86_400)) * 1000;
    assert!(
        ttl as u64 + 2000 >= to_midnight_ms,
        "{ttl} ms < {to_midnight_ms} ms"
    );
    let v = b.tenant_snapshot(KEY, &t).await.unwrap().expect("a ledger");
    assert_eq!(v.in_flight, 0);
    assert_eq!(v.spent_day, 11 * 700, "each call settled to its cost");
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The script's calendar (month of a day, end of that month) is the Rust one, over
/// leap years, century rules and the months' ends.
#[tokio::test]
async fn the_scripts_calendar_is_gate_tenants() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, _) = backend(&srv).await;
    let mut days: Vec<u32> = (0..800).map(|i| i * 173).collect(); // to ~2349
    for (y, m) in [
        (2000, 2),
        (2000, 3),
        (2024, 2),
        (2024, 3),
        (2100, 2),
        (2100, 3),
        (2026, 12),
    ] {
        let first = calendar::first_day(y, m);
        days.extend([first.saturating_sub(1), first, first + 27, first + 28]);
    }
    for d in days {
        let (month, end_us) = b.tenant_calendar(d).await.unwrap();
        assert_eq!(
            (month, end_us),
            (calendar::month_of(d), calendar::month_end_s(d) * 1_000_000),
            "day {d}"
        );
    }
}

/// A settlement with nothing to give back (usage and cost as estimated) moves the
/// ledger's in-flight count alone (`HINCRBY`, the ledger not loaded), and never leaves
/// a ledger without an expiry: when the ledger expired under the call, the count the
/// `HINCRBY` would make is dropped with the hash it made.
#[tokio::test]
async fn an_exact_settlement_moves_the_count_alone() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, prefix) = backend(&srv).await;
    b.stop_heartbeat();
    let t = tenant();
    let key = format!("{{{prefix}:t:chat:acme}}");
    admit_then(&b, &t, 10, 1000, || {}).await;
    srv.cli(&["CONFIG", "RESETSTAT"]);
    admit_then(&b, &t, 10, 1000, || {}).await;
    assert_eq!(srv.command_calls("hincrby"), 1, "the exact report's count");
    assert_eq!(
        srv.command_calls("hmget"),
        4,
        "the admit's three and the report's breaker: not the ledger"
    );
    let v = b.tenant_snapshot(KEY, &t).await.unwrap().expect("a ledger");
    assert_eq!((v.in_flight, v.spent_day), (0, 2000));
    let ttl: i64 = srv.cli(&["PTTL", &key]).trim().parse().expect("PTTL");
    assert!(ttl > 0, "the ledger {key} keeps its expiry (PTTL {ttl})");
    // The ledger goes away while the call is in flight: its report makes none.
    admit_then(&b, &t, 10, 1000, || {
        srv.cli(&["DEL", &key]);
    })
    .await;
    assert_eq!(
        srv.cli(&["EXISTS", &key]).trim(),
        "0",
        "no ledger without expiry"
    );
    // And a settlement that gives back still loads and writes it, as before.
    admit_then(&b, &t, 4, 400, || {}).await;
    let v = b.tenant_snapshot(KEY, &t).await.unwrap().expect("a ledger");
    assert_eq!((v.in_flight, v.spent_day), (0, 400));
    let ttl: i64 = srv.cli(&["PTTL", &key]).trim().parse().expect("PTTL");
    assert!(ttl > 0, "PTTL {ttl}");
}

/// §19: a tenant's ledger is per scope, whatever the bytes of the names: tenant `b:c`
/// of scope `a` and tenant `c` of scope `a:b` (a scope is any TOML key, a tenant id
/// any 128 bytes a worker sends) never share a Redis hash, as the memory backend
/// keeps them apart. Before, `{prefix:t:<scope>:<tenant>}` joined them into one key.
#[tokio::test]
async fn tenants_of_scopes_whose_names_contain_colons_keep_their_own_ledgers() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, _) = backend(&srv).await;
    let p = TenantParams {
        usd_per_day: Some(1_000),
        ..tenant()
    };
    let one = TenantKey {
        scope: "a",
        tenant: "b:c",
    };
    let other = TenantKey {
        scope: "a:b",
        tenant: "c",
    };
    let charge = Charge {
        tokens: Tokens::from(1),
        cost: 900,
    };
    let ask = |key| TenantAdmit {
        key,
        params: &p,
        charge,
        max_tenants: 10,
    };
    let a = b.tenant_reserve(ask(one)).await.unwrap();
    assert!(matches!(a, Admit::Admitted { .. }), "{a:?}");
    let v = b.tenant_snapshot(other, &p).await.unwrap();
    assert!(
        v.is_none_or(|v| v.spent_day == 0 && v.in_flight == 0),
        "the other scope's tenant never made a call: {v:?}"
    );
    let a = b.tenant_reserve(ask(other)).await.unwrap();
    assert!(
        matches!(a, Admit::Admitted { .. }),
        "refused by the other scope's spend: {a:?}"
    );
}
