//! Redis backend specifics against real, throwaway Redis servers (real time, short
//! waits): one script call per admission and per report, key layout and expiry,
//! NOSCRIPT recovery, degradation to local state and back, fail_closed, the admin
//! broadcast, a Redis Cluster. The breaker/quota semantics themselves are pinned by
//! the contract suite (`backend_redis_contract.rs`).

mod support;

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use polygate::backend::redis::{RedisBackend, RedisOptions};
use polygate::backend::{AdminEvent, AdminOp, AdmitRequest, ReportRequest};
use polygate::backend::{
    Admit, AdmittedRate, AnyBackend, Backend, BackendError, BreakerParams, Outcome, QuotaParams,
    SeenCut, State,
};
use polygate::clock::TokioClock;
use polygate::config::OnBackendError;
use support::redis_server::{RedisCluster, RedisServer};

const SOURCES: [&str; 3] = ["s1", "s2", "s3"];
static NEXT: AtomicU64 = AtomicU64::new(0);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn bp() -> BreakerParams {
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

fn qp() -> QuotaParams {
    QuotaParams {
        tpm: Some(60_000),
        rpm: Some(600),
        ..QuotaParams::default()
    }
}

fn prefix() -> String {
    format!(
        "t{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn opts(url: &str, prefix: &str, timeout: Duration, on: OnBackendError) -> RedisOptions {
    RedisOptions {
        url: url.to_string(),
        cluster_nodes: vec![],
        key_prefix: prefix.to_string(),
        timeout,
        on_backend_error: on,
        sources: SOURCES.iter().map(|s| s.to_string()).collect(),
        degraded_share: polygate::config::DegradedShare::Auto,
    }
}

async fn backend(
    srv: &RedisServer,
    prefix: &str,
    timeout: Duration,
    on: OnBackendError,
) -> RedisBackend {
    RedisBackend::connect(
        opts(&srv.url(), prefix, timeout, on),
        Arc::new(TokioClock::new()),
    )
    .await
    .expect("connect never fails on an unreachable Redis")
}

async fn admit_report<B: Backend>(b: &B, source: &str) {
    let Admit::Admitted {
        epoch, is_probe, ..
    } = b
        .admit(source, AdmitRequest::new(&bp(), &qp(), 10))
        .await
        .unwrap()
    else {
        panic!("admit refused")
    };
    let a = b
        .report(
            source,
            ReportRequest::new(
                &bp(),
                &qp(),
                epoch,
                is_probe,
                10,
                Outcome::Success {
                    tokens: Some(7),
                    split: None,
                    count_attempt: true,
                },
            ),
        )
        .await
        .unwrap();
    assert!(a.applied);
}

/// Captured tracing output of the whole test binary (a global subscriber: scoped
/// ones race with the callsite interest cache when tests run in parallel). Tests
/// filter lines by their own server's URL.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();

impl Logs {
    fn global() -> &'static Logs {
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let me = logs.clone();
            let sub = tracing_subscriber::fmt()
                .with_writer(move || me.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .finish();
            tracing::subscriber::set_global_default(sub).expect("no other global subscriber");
            logs
        })
    }

    fn count(&self, needle: &str, url: &str) -> usize {
        let s = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        s.lines()
            .filter(|l| l.contains(needle) && l.contains(url))
            .count()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------- round trips, keys

/// One script call (FCALL on Redis 7) per admission and per report, and the lean
/// script's command budget (issue 8): admit = TIME + HMGET q + HMGET b + HSET q;
/// report = TIME + HMGET b + HSET b, + HMGET q + HSET q as the charge (7 tokens)
/// differs from the reservation (10); no expiry command in steady traffic.
#[tokio::test]
async fn one_script_call_per_admit_and_per_report_within_the_command_budget() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    b.stop_heartbeat(); // its once-a-second script is not a call's cost
    admit_report(&b, "s1").await; // loads the library (Function not found once)
    srv.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..10 {
        admit_report(&b, "s1").await;
    }
    let calls = |c: &str| srv.command_calls(c);
    assert_eq!(calls("fcall"), 20, "one FCALL per admit and per report");
    assert_eq!(calls("evalsha") + calls("eval"), 0);
    assert_eq!(calls("function|load"), 0, "library already loaded");
    assert_eq!(
        [calls("time"), calls("hmget"), calls("hset")],
        [20, 40, 30],
        "TIME, HMGET, HSET per 10 admit + report pairs"
    );
    for c in [
        "pexpire",
        "pexpireat",
        "persist",
        "hdel",
        "del",
        "hgetall",
        "pttl",
    ] {
        assert_eq!(calls(c), 0, "no {c} in steady traffic");
    }
    let snap = b.snapshot("s1", &bp(), &qp()).await.unwrap();
    assert_eq!(snap.window_successes, 11);
}

/// §18 `learn_rate`: a learning source's admission costs the same commands (its
/// factor is one more field of the quota HMGET), a 429 writes the factor to the
/// quota hash's field `ar` in the report's own HSET, and the hash is kept until the
/// factor is whole again (0.3 of the limit at +0.1 %/s: 300 s, plus the minute's
/// slack), not just until its buckets read full (a minute).
#[tokio::test]
async fn a_learning_source_costs_the_same_commands_and_keeps_its_factor() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let b = backend(&srv, &p, ms(500), OnBackendError::FailClosed).await;
    b.stop_heartbeat();
    let q = QuotaParams {
        learn: 1_000,
        ..qp()
    };
    admit_report(&b, "s2").await; // loads the library
    srv.cli(&["CONFIG", "RESETSTAT"]);
    let admit = || async {
        match b
            .admit("s1", AdmitRequest::new(&bp(), &q, 10))
            .await
            .unwrap()
        {
            Admit::Admitted { epoch, .. } => epoch,
            a => panic!("expected a grant, got {a:?}"),
        }
    };
    let e = admit().await;
    let calls = |c: &str| srv.command_calls(c);
    assert_eq!(
        [calls("time"), calls("hmget"), calls("hset")],
        [1, 2, 1],
        "admit: TIME, HMGET q and b, HSET q"
    );
    let p = bp();
    let r = ReportRequest::new(
        &p,
        &q,
        e,
        false,
        10u64,
        Outcome::RateLimited { retry_after: None },
    );
    b.report("s1", r).await.unwrap();
    let qk = b.quota_key("s1");
    let ar = srv.cli(&["HGET", &qk, "ar"]);
    let ppm = ar.split_whitespace().next().unwrap_or_default();
    assert_eq!(ppm, "700000", "field ar after one cut: {ar:?}");
    let pttl: i64 = srv.cli(&["PTTL", &qk]).trim().parse().unwrap();
    assert!(
        (359_000..=360_200).contains(&pttl),
        "kept until whole (300 s) plus a minute: PTTL {pttl}"
    );
    // Every host reads the cut limits: 600 rpm × 0.7.
    let snap = b.snapshot("s1", &bp(), &q).await.unwrap();
    let rpm = snap.levels[1].unwrap();
    assert!((418.0..=420.0).contains(&rpm), "rpm level {rpm}");
}

/// The server's clock, µs (`TIME`).
fn server_us(srv: &RedisServer) -> i64 {
    let t = srv.cli(&["TIME"]);
    let mut it = t.split_whitespace().map(|x| x.parse::<i64>().unwrap());
    it.next().unwrap() * 1_000_000 + it.next().unwrap()
}

/// The learned factor in the quota hash's field `ar`: (ppm, at µs).
fn field_ar(srv: &RedisServer, b: &RedisBackend, source: &str) -> (i64, i64) {
    let ar = srv.cli(&["HGET", &b.quota_key(source), "ar"]);
    let mut it = ar.split_whitespace().map(|x| x.parse::<i64>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

/// A grant of 10 tokens on `s1`: its epoch and what its admission saw (§18).
async fn grant_s1(b: &RedisBackend, q: &QuotaParams) -> (u64, AdmittedRate) {
    let Admit::Admitted { epoch, rate, .. } = b
        .admit("s1", AdmitRequest::new(&bp(), q, 10))
        .await
        .unwrap()
    else {
        panic!("admit refused")
    };
    (epoch, rate)
}

/// A 429 of the grant `epoch` on `s1`, with what its admission saw (as the engine
/// reports it) or without.
async fn report_429_s1(b: &RedisBackend, q: &QuotaParams, epoch: u64, seen: Option<AdmittedRate>) {
    let p = bp();
    let mut r = ReportRequest::new(
        &p,
        q,
        epoch,
        false,
        10u64,
        Outcome::RateLimited { retry_after: None },
    );
    if let Some(rate) = seen {
        r = r.admitted_at(rate);
    }
    b.report("s1", r).await.unwrap();
}

async fn learning_429(b: &RedisBackend, q: &QuotaParams) {
    let (epoch, _) = grant_s1(b, q).await;
    report_429_s1(b, q, epoch, None).await;
}

/// A backend without heartbeat and a source learning fast (200,000 ppm a second) that
/// has had one 429 (its quota hash exists, cut to 0.7).
async fn learning_backend(srv: &RedisServer) -> (RedisBackend, QuotaParams) {
    let b = backend(srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    b.stop_heartbeat();
    let q = QuotaParams {
        learn: 200_000,
        ..qp()
    };
    learning_429(&b, &q).await;
    (b, q)
}

/// §18 `learn_rate` in `gate.lua`: a cut dated ahead of the server's clock (written by
/// a server whose clock was ahead, before a failover) is re-dated now on the next
/// write, so the factor recovers, and cuts again, from now rather than from when the
/// clock catches up (a minute here); and the factor never falls below 5 %.
#[tokio::test]
async fn a_learned_factor_dated_ahead_is_redated_and_has_a_floor() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, q) = learning_backend(&srv).await;
    let qk = b.quota_key("s1");
    let ahead = server_us(&srv) + 60_000_000;
    srv.cli(&["HSET", &qk, "ar", &format!("700000 {ahead}")]);
    learning_429(&b, &q).await; // a write: re-dated, and too soon to cut again
    let (ppm, at) = field_ar(&srv, &b, "s1");
    assert_eq!(ppm, 700_000, "no cut within a second of the re-dated one");
    assert!(
        at <= server_us(&srv),
        "re-dated to the server's now: {at} vs {ahead}"
    );
    tokio::time::sleep(ms(1_100)).await;
    learning_429(&b, &q).await;
    let (ppm, _) = field_ar(&srv, &b, "s1");
    // 0.7 of 0.7 + ≥ 1.1 s × 20 %/s (whole after 1.5 s): a cut from the recovered one.
    assert!(
        (644_000..=700_000).contains(&ppm) && ppm != 700_000,
        "cut again a second after the re-dating: {ppm}"
    );
    // The floor: a factor of 6 % cut ×0.7 stays at 5 %.
    let past = server_us(&srv) - 5_000_000;
    srv.cli(&["HSET", &qk, "ar", &format!("60000 {past}")]);
    let slow = QuotaParams { learn: 1, ..qp() };
    learning_429(&b, &slow).await;
    assert_eq!(field_ar(&srv, &b, "s1").0, 50_000, "never below 5 %");
}

/// The same re-dating is written by an admission the quota refuses: otherwise every
/// refused call re-dates it afresh, and the factor does not recover (from a re-dated
/// now that moves with the clock) while the quota refuses.
#[tokio::test]
async fn a_cut_dated_ahead_is_redated_by_a_refused_admission_too() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, q) = learning_backend(&srv).await;
    b.block_quota("s1", Duration::from_secs(10)).await.unwrap();
    let ahead = server_us(&srv) + 60_000_000;
    srv.cli(&["HSET", &b.quota_key("s1"), "ar", &format!("700000 {ahead}")]);
    let a = b
        .admit("s1", AdmitRequest::new(&bp(), &q, 10))
        .await
        .unwrap();
    assert!(matches!(a, Admit::RateLimited { .. }), "blocked: {a:?}");
    let (ppm, at) = field_ar(&srv, &b, "s1");
    assert_eq!(ppm, 700_000);
    assert!(
        at <= server_us(&srv),
        "re-dated by the refused admission: {at} vs {ahead}"
    );
}

#[tokio::test]
async fn keys_are_hash_tagged_and_expire() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let b = backend(&srv, &p, ms(500), OnBackendError::FailClosed).await;
    admit_report(&b, "s1").await;
    let bk = format!("{{{p}:s1}}:b");
    let qk = format!("{{{p}:s1}}:q");
    assert_eq!(b.breaker_key("s1"), bk);
    assert_eq!(b.quota_key("s1"), qk);
    let mut keys: Vec<String> = srv
        .cli(&["KEYS", &format!("*{p}*")])
        .lines()
        .map(str::to_string)
        .collect();
    keys.sort();
    // Beside the source's two keys, at most the prefix's heartbeat set (§10, hash
    // tag `{<prefix>}`: never a source's slot).
    let hk = polygate::backend::redis::hosts_key(&p);
    assert_eq!(hk, format!("{{{p}}}:hosts"));
    keys.retain(|k| *k != hk);
    assert_eq!(keys, vec![bk.clone(), qk.clone()]);
    assert_eq!(
        srv.cli(&["CLUSTER", "KEYSLOT", &bk]).trim(),
        srv.cli(&["CLUSTER", "KEYSLOT", &qk]).trim(),
        "one slot per source"
    );
    // Breaker, CLOSED without a streak: it may expire, 2 × the basis ahead
    // (basis 4 × max(window 60 s, max_cooldown, probe_ttl) = 240 s).
    let pttl: i64 = srv.cli(&["PTTL", &bk]).trim().parse().unwrap();
    assert!((475_000..=480_000).contains(&pttl), "breaker PTTL {pttl}");
    // Quota: full again in 100 ms (one request of 600 rpm), plus a minute.
    let pttl: i64 = srv.cli(&["PTTL", &qk]).trim().parse().unwrap();
    assert!((59_000..=60_200).contains(&pttl), "quota PTTL {pttl}");
    // OPEN is remembered without a TTL (the memory backend never forgets it either).
    b.force_open("s1", Duration::from_secs(1000)).await.unwrap();
    assert_eq!(srv.cli(&["PTTL", &bk]).trim(), "-1", "OPEN: no TTL");
    // A reset keeps the breaker hash (its epoch) and drops the quota hash.
    let before = b.snapshot("s1", &bp(), &qp()).await.unwrap().epoch;
    let a = b.reset("s1").await.unwrap();
    assert_eq!(a.epoch, before + 1);
    assert_eq!(srv.cli(&["EXISTS", &qk]).trim(), "0");
    assert_eq!(srv.cli(&["EXISTS", &bk]).trim(), "1");
}

#[tokio::test]
async fn durations_are_exact_server_time() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    let a = b.force_open("s1", ms(250)).await.unwrap();
    assert_eq!((a.state, a.retry_after), (State::Open, ms(250)));
    let a = b
        .force_open("s2", Duration::from_micros(1_234_567))
        .await
        .unwrap();
    assert_eq!(a.retry_after, Duration::from_micros(1_234_567));
    let e = b.try_enter("s1", &bp()).await.unwrap();
    assert!(!e.granted && e.retry_after < ms(250) && e.retry_after > ms(150));
}

#[tokio::test]
async fn unknown_source_is_refused() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::Local).await;
    let r = b.try_enter("nope", &bp()).await;
    assert_eq!(r, Err(BackendError::UnknownSource("nope".into())));
    assert!(!b.degraded("nope"));
}

#[tokio::test]
async fn two_hosts_share_one_breaker() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let h1 = backend(&srv, &p, ms(500), OnBackendError::FailClosed).await;
    let h2 = backend(&srv, &p, ms(500), OnBackendError::FailClosed).await;
    for _ in 0..3 {
        let e = h1.try_enter("s1", &bp()).await.unwrap();
        h1.record_failure("s1", e.epoch, &bp()).await.unwrap();
    }
    let e = h2.try_enter("s1", &bp()).await.unwrap();
    assert_eq!((e.granted, e.state), (false, State::Open));
    tokio::time::sleep(ms(110)).await;
    // Exactly one host gets the probe.
    let p = bp();
    let (a, b) = tokio::join!(h1.try_enter("s1", &p), h2.try_enter("s1", &p));
    let probes = [a.unwrap(), b.unwrap()]
        .iter()
        .filter(|e| e.is_probe)
        .count();
    assert_eq!(probes, 1);
}

/// An absurd token count floors the debt at −capacity (one minute's refill), and no
/// input yields an out-of-range PEXPIRE or an absurd TTL on the quota key.
#[tokio::test]
async fn huge_counts_and_durations_keep_sane_ttls() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    let qk = b.quota_key("s1");
    let q = qp();
    assert!(matches!(
        b.admit("s1", AdmitRequest::new(&bp(), &q, u64::MAX))
            .await
            .unwrap(),
        Admit::Admitted { .. }
    ));
    let pttl = |k: &str| -> i64 { srv.cli(&["PTTL", k]).trim().parse().unwrap() };
    // Full bucket − 2^53 tokens, floored at −60 000: two minutes to full, plus one.
    assert!(pttl(&qk) <= 180_100, "quota PTTL {}", pttl(&qk));
    let snap = b.snapshot("s1", &bp(), &q).await.unwrap();
    assert!(
        snap.tokens_available.unwrap() >= -60_000.0 && snap.tokens_available.unwrap() < -59_000.0,
        "{snap:?}"
    );
    for (reserved, charged) in [(10, u64::MAX), (u64::MAX, 0), (u64::MAX, u64::MAX / 3)] {
        b.settle(
            "s1",
            &q,
            reserved,
            polygate::backend::Settlement::charge(charged),
        )
        .await
        .unwrap();
        let t = b
            .snapshot("s1", &bp(), &q)
            .await
            .unwrap()
            .tokens_available
            .unwrap();
        assert!((-60_000.0..=60_000.0).contains(&t), "level {t}");
        assert!(pttl(&qk) <= 180_100, "quota PTTL {}", pttl(&qk));
    }
    // A block beyond all reason is capped (a week), not an overflow.
    b.block_quota("s1", Duration::MAX).await.unwrap();
    let week_ms = 7 * 86_400_000;
    assert!(
        pttl(&qk) <= week_ms + 60_100 && pttl(&qk) > week_ms,
        "{}",
        pttl(&qk)
    );
    let report = b
        .report(
            "s1",
            ReportRequest::new(
                &bp(),
                &q,
                0,
                false,
                u64::MAX,
                Outcome::RateLimited {
                    retry_after: Some(Duration::MAX),
                },
            ),
        )
        .await
        .unwrap();
    assert!(report.applied);
    assert!(pttl(&qk) <= week_ms + 3 * 60_000 + 100, "{}", pttl(&qk));
    // An absurd force_open is accepted (OPEN: persistent, like memory's).
    let a = b.force_open("s2", Duration::MAX).await.unwrap();
    assert_eq!(a.state, State::Open);
    assert_eq!(pttl(&b.breaker_key("s2")), -1);
}

/// The breaker hash's expiry follows its state (`gate.lua`, "Expiry"): none while
/// it holds what the memory backend would still remember (a streak, OPEN,
/// HALF_OPEN); once CLOSED again, no sooner than the level's decay plus the basis.
/// Expiry commands happen on those transitions only.
#[tokio::test]
async fn breaker_expiry_follows_its_state() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    let p = BreakerParams {
        failure_threshold: 1,
        ..bp()
    };
    let basis_ms: i64 = 4 * 60_000; // 4 × max(window 60 s, max_cooldown, probe_ttl)
    let bk = b.breaker_key("s1");
    let pttl = || -> i64 { srv.cli(&["PTTL", &bk]).trim().parse().unwrap() };
    let e = b.try_enter("s1", &p).await.unwrap();
    b.record_success("s1", e.epoch, true, &p).await.unwrap();
    assert!(pttl() > 2 * basis_ms - 5_000, "fresh: {}", pttl());
    // A failure opens it (streak channel, threshold 1): no TTL.
    let e = b.try_enter("s1", &p).await.unwrap();
    let a = b.record_failure("s1", e.epoch, &p).await.unwrap();
    assert_eq!(a.state, State::Open);
    assert_eq!(pttl(), -1, "OPEN");
    tokio::time::sleep(ms(110)).await;
    let probe = b.try_enter("s1", &p).await.unwrap();
    assert!(probe.is_probe);
    assert_eq!(pttl(), -1, "HALF_OPEN");
    let a = b.record_failure("s1", probe.epoch, &p).await.unwrap(); // k = 1
    tokio::time::sleep(a.retry_after + ms(10)).await;
    let probe = b.try_enter("s1", &p).await.unwrap();
    srv.cli(&["CONFIG", "RESETSTAT"]);
    let a = b.record_success("s1", probe.epoch, true, &p).await.unwrap();
    assert_eq!(a.state, State::Closed);
    // CLOSED with k = 1: not before the level decayed (400 ms) plus the basis.
    let t = pttl();
    assert!(t > 2 * basis_ms + 400 - 5_000, "after the close: {t}");
    assert_eq!(srv.command_calls("pexpireat"), 1);
    // Ten successes later nothing moved it again.
    srv.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..10 {
        let e = b.try_enter("s1", &p).await.unwrap();
        b.record_success("s1", e.epoch, true, &p).await.unwrap();
    }
    assert_eq!(
        srv.command_calls("pexpireat") + srv.command_calls("persist"),
        0
    );
    // A streak (here below the threshold of 3) is remembered without a TTL too.
    let p3 = bp();
    let e = b.try_enter("s1", &p3).await.unwrap();
    b.record_failure("s1", e.epoch, &p3).await.unwrap();
    assert_eq!(pttl(), -1, "streak 1");
    let e = b.try_enter("s1", &p3).await.unwrap();
    b.record_success("s1", e.epoch, true, &p3).await.unwrap();
    assert!(pttl() > basis_ms, "streak over: {}", pttl());
}

/// DESIGN §6 "on every backend alike": an idle breaker hash expires only once it
/// reads as the memory backend's would — CLOSED, level decayed to 0 — and only after
/// every permit it granted outlived its lease; it comes back fresh with epoch 0.
#[tokio::test]
async fn an_idle_breaker_expires_only_once_its_level_has_decayed() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    // cooldown 10 ms, cap 80 ms (k_max 3); basis 4 × max(20, 80, 20) ms = 320 ms.
    let p = BreakerParams {
        failure_threshold: 1,
        failure_rate: 0.5,
        min_calls: 100,
        window: ms(20),
        cooldown: ms(10),
        max_cooldown: ms(80),
        probe_ttl: ms(20),
    };
    let e = b.try_enter("s1", &p).await.unwrap();
    let mut a = b.record_failure("s1", e.epoch, &p).await.unwrap();
    for _ in 0..3 {
        tokio::time::sleep(a.retry_after + ms(5)).await;
        let probe = b.try_enter("s1", &p).await.unwrap();
        assert!(probe.is_probe);
        a = b.record_failure("s1", probe.epoch, &p).await.unwrap();
    }
    tokio::time::sleep(a.retry_after + ms(5)).await;
    let probe = b.try_enter("s1", &p).await.unwrap();
    let closed = b.record_success("s1", probe.epoch, true, &p).await.unwrap();
    let closed_at = Instant::now();
    assert_eq!(b.snapshot("s1", &p, &qp()).await.unwrap().cooldown_level, 3);
    // Its expiry is no sooner than the whole decay (3 × 80 ms) plus the basis.
    let bk = b.breaker_key("s1");
    let t: i64 = srv.cli(&["PTTL", &bk]).trim().parse().unwrap();
    // The TTL counts down from `closed_at`: on a loaded machine the snapshot above can
    // take tens of ms, so what has passed since is added back.
    let since = closed_at.elapsed().as_millis() as i64;
    assert!(
        t + since >= 3 * 80 + 2 * 320 - 20,
        "lives past the decay plus the basis: {t} ms left, {since} ms after closing"
    );
    // Two decay periods in: k = 1, as the memory backend has it.
    tokio::time::sleep(ms(170).saturating_sub(closed_at.elapsed())).await;
    let snap = b.snapshot("s1", &p, &qp()).await.unwrap();
    assert_eq!(
        (snap.state, snap.cooldown_level, snap.epoch),
        (State::Closed, 1, closed.epoch)
    );
    // Idle until it expires: it comes back as memory's would, epoch 0.
    let deadline = Instant::now() + Duration::from_secs(3);
    while srv.cli(&["EXISTS", &bk]).trim() == "1" {
        assert!(Instant::now() < deadline, "never expired");
        tokio::time::sleep(ms(50)).await;
    }
    assert!(
        closed_at.elapsed() >= ms(3 * 80 + 320),
        "not before decay + basis"
    );
    let snap = b.snapshot("s1", &p, &qp()).await.unwrap();
    assert_eq!(
        (snap.state, snap.cooldown_level, snap.epoch, snap.streak),
        (State::Closed, 0, 0, 0)
    );
}

// ---------------------------------------------------------------- script cache

#[tokio::test]
async fn a_flushed_function_library_is_loaded_again() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    admit_report(&b, "s1").await;
    assert!(srv.cli(&["FUNCTION", "FLUSH"]).contains("OK"));
    assert!(srv.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    admit_report(&b, "s1").await;
    assert_eq!(
        srv.command_calls("function|load"),
        2,
        "first use, then after the flush"
    );
    assert!(!b.degraded("s1"));
    assert_eq!(
        b.snapshot("s1", &bp(), &qp())
            .await
            .unwrap()
            .window_successes,
        2
    );
}

/// A server without Redis Functions (before 7.0; played here by renaming FCALL
/// away) gets the same script as EVALSHA, one per operation, with the same answers.
#[tokio::test]
async fn a_server_without_functions_runs_the_script_form() {
    let Some(srv) = RedisServer::start_with_args(&["--rename-command", "FCALL", ""]) else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(500), OnBackendError::FailClosed).await;
    b.stop_heartbeat(); // its script's commands are not a call's
    admit_report(&b, "s1").await; // FCALL refused once, then the script form
    srv.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..5 {
        admit_report(&b, "s1").await;
    }
    assert_eq!(
        srv.command_calls("evalsha"),
        10,
        "one EVALSHA per admit and per report"
    );
    assert_eq!(srv.command_calls("function|load"), 0);
    assert!(!b.degraded("s1"));
    let snap = b.snapshot("s1", &bp(), &qp()).await.unwrap();
    assert_eq!((snap.state, snap.window_successes), (State::Closed, 6));
}

#[tokio::test]
async fn redis_restart_reconnects_and_reloads_script() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(300), OnBackendError::FailClosed).await;
    admit_report(&b, "s1").await;
    srv.restart(); // empty server: no script cached, no keys
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        match b.admit("s1", AdmitRequest::new(&bp(), &qp(), 10)).await {
            Ok(Admit::Admitted { .. }) => break,
            Ok(a) => panic!("unexpected {a:?}"),
            Err(e) => {
                assert!(Instant::now() < deadline, "no recovery after restart: {e}");
                tokio::time::sleep(ms(50)).await;
            }
        }
    }
    admit_report(&b, "s2").await;
}

// ---------------------------------------------------------------- degradation

#[tokio::test]
async fn degrades_to_local_when_killed_and_restores_when_back() {
    let logs = Logs::global();
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let timeout = ms(200);
    let b = backend(&srv, &prefix(), timeout, OnBackendError::Local).await;
    admit_report(&b, "s1").await;
    assert!(!b.degraded("s1"));
    srv.kill();

    // Served locally, within the timeout, and marked degraded.
    let t0 = Instant::now();
    admit_report(&b, "s1").await;
    assert!(
        t0.elapsed() < timeout + ms(150),
        "first failure bounded: {:?}",
        t0.elapsed()
    );
    assert!(b.degraded("s1"));
    assert!(!b.degraded("s2"), "degradation is per source");
    // While degraded, calls do not wait on Redis.
    let t0 = Instant::now();
    for _ in 0..20 {
        admit_report(&b, "s1").await;
    }
    assert!(
        t0.elapsed() < ms(300),
        "degraded calls are local: {:?}",
        t0.elapsed()
    );
    assert_eq!(
        logs.count("source degraded to local state", &srv.url()),
        1,
        "one line per transition"
    );

    srv.restart();
    let deadline = Instant::now() + Duration::from_secs(4);
    while b.degraded("s1") {
        assert!(Instant::now() < deadline, "not restored after restart");
        admit_report(&b, "s1").await;
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(logs.count("redis reachable again", &srv.url()), 1);
    assert_eq!(logs.count("source degraded to local state", &srv.url()), 1);
    // Back on Redis: state lands in the (fresh) server.
    admit_report(&b, "s1").await;
    assert_eq!(srv.cli(&["EXISTS", &b.breaker_key("s1")]).trim(), "1");
}

/// A backend that serves locally when Redis goes away (`on_backend_error = "local"`),
/// `s1` learning slowly with one 429 on Redis (factor 0.7), and `s2` (a source that
/// does not learn: the whole level) used once.
async fn degradable_learning(srv: &RedisServer) -> (RedisBackend, QuotaParams) {
    let b = backend(srv, &prefix(), ms(200), OnBackendError::Local).await;
    let q = QuotaParams {
        learn: 1_000,
        ..qp()
    };
    learning_429(&b, &q).await;
    admit_report(&b, "s2").await;
    (b, q)
}

/// §10 × §18 `learn_rate`: a host that degrades keeps the factor learned from the
/// 429s (the admit and report replies carry it), so its local quota runs at its share
/// of the cut limit, not of the whole one: 600 rpm cut to 420 (a source that does not
/// learn, beside it, keeps its 600).
#[tokio::test]
async fn a_degraded_host_keeps_the_learned_factor() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let (b, q) = degradable_learning(&srv).await;
    srv.kill();
    let rpm = |s: &'static str, q: QuotaParams| {
        let b = &b;
        async move {
            let snap = b.snapshot(s, &bp(), &q).await.unwrap();
            assert!(b.degraded(s), "{s} served locally");
            snap.levels[1].unwrap()
        }
    };
    let cut = rpm("s1", q).await;
    let whole = rpm("s2", qp()).await;
    let ratio = cut / whole;
    assert!(
        (0.69..=0.71).contains(&ratio),
        "local rpm {cut} of {whole}: the factor 0.7 carried into degraded mode"
    );
}

#[tokio::test]
async fn stalled_redis_costs_at_most_the_timeout() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let timeout = ms(150);
    let b = backend(&srv, &prefix(), timeout, OnBackendError::Local).await;
    admit_report(&b, "s1").await;
    srv.pause(); // accepts, never answers
    let t0 = Instant::now();
    let r = b
        .admit("s1", AdmitRequest::new(&bp(), &qp(), 10))
        .await
        .unwrap();
    let took = t0.elapsed();
    srv.resume();
    assert!(matches!(r, Admit::Admitted { .. }), "served locally: {r:?}");
    assert!(
        took >= timeout && took < timeout + ms(150),
        "bounded by the timeout: {took:?}"
    );
    assert!(b.degraded("s1"));
    // Redis answers again: restored on the next try after the retry interval.
    let deadline = Instant::now() + Duration::from_secs(4);
    while b.degraded("s1") {
        assert!(Instant::now() < deadline, "not restored after SIGCONT");
        admit_report(&b, "s1").await;
        tokio::time::sleep(ms(50)).await;
    }
}

#[tokio::test]
async fn connect_succeeds_while_redis_is_down() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    srv.kill();
    let b = backend(&srv, &prefix(), ms(200), OnBackendError::Local).await;
    let e = b.try_enter("s1", &bp()).await.unwrap();
    assert!(e.granted);
    assert!(b.degraded("s1"));
    srv.restart();
    let deadline = Instant::now() + Duration::from_secs(4);
    while b.degraded("s1") {
        assert!(Instant::now() < deadline, "not restored once Redis came up");
        let _ = b.try_enter("s1", &bp()).await.unwrap();
        tokio::time::sleep(ms(50)).await;
    }
}

#[tokio::test]
async fn fail_closed_refuses_with_a_clear_error() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(200), OnBackendError::FailClosed).await;
    admit_report(&b, "s1").await;
    srv.kill();
    let t0 = Instant::now();
    let err = b
        .admit("s1", AdmitRequest::new(&bp(), &qp(), 10))
        .await
        .unwrap_err();
    assert!(t0.elapsed() < ms(400));
    let BackendError::Unavailable(msg) = &err else {
        panic!("expected Unavailable: {err:?}")
    };
    assert!(
        msg.contains("redis://127.0.0.1:") && msg.contains("unreachable"),
        "{msg}"
    );
    assert!(!b.degraded("s1"), "fail_closed never serves local state");
    // Within the retry interval the refusal is immediate.
    let t0 = Instant::now();
    assert!(b
        .report(
            "s1",
            ReportRequest::new(&bp(), &qp(), 0, false, 10, Outcome::Cancelled)
        )
        .await
        .is_err());
    assert!(t0.elapsed() < ms(50));
    srv.restart();
    let deadline = Instant::now() + Duration::from_secs(4);
    while b.try_enter("s1", &bp()).await.is_err() {
        assert!(Instant::now() < deadline, "not recovered");
        tokio::time::sleep(ms(50)).await;
    }
}

// ---------------------------------------------------------------- admin broadcast

async fn wait_subscribed(b: &RedisBackend) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !b.admin_subscribed() {
        assert!(
            Instant::now() < deadline,
            "admin subscriber never subscribed"
        );
        tokio::time::sleep(ms(10)).await;
    }
}

async fn next_event(rx: &mut tokio::sync::broadcast::Receiver<AdminEvent>) -> AdminEvent {
    tokio::time::timeout(Duration::from_secs(2), rx.recv())
        .await
        .expect("admin event within 2 s")
        .expect("channel open")
}

#[tokio::test]
async fn admin_ops_reach_other_hosts() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let h1 = backend(&srv, &p, ms(300), OnBackendError::Local).await;
    let h2 = backend(&srv, &p, ms(300), OnBackendError::Local).await;
    assert_eq!(h2.admin_channel(), format!("{p}:admin"));
    let mut rx = h2.admin_events();
    wait_subscribed(&h2).await;
    h1.force_open("s1", ms(500)).await.unwrap();
    h1.force_close("s2").await.unwrap();
    h1.reset("s3").await.unwrap();
    let got = [
        next_event(&mut rx).await,
        next_event(&mut rx).await,
        next_event(&mut rx).await,
    ];
    assert_eq!(
        got,
        [
            AdminEvent {
                source: "s1".into(),
                op: AdminOp::ForceOpen
            },
            AdminEvent {
                source: "s2".into(),
                op: AdminOp::ForceClose
            },
            AdminEvent {
                source: "s3".into(),
                op: AdminOp::Reset
            },
        ]
    );
    // Another prefix's channel is not ours.
    let other = backend(&srv, &prefix(), ms(300), OnBackendError::Local).await;
    other.force_close("s1").await.unwrap();
    // The subscriber comes back after a Redis restart.
    srv.restart();
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        tokio::time::sleep(ms(50)).await;
        if h2.admin_subscribed() && h1.force_close("s1").await.is_ok() && !h1.degraded("s1") {
            break;
        }
        assert!(Instant::now() < deadline, "subscriber did not come back");
    }
    let ev = next_event(&mut rx).await;
    assert_eq!(
        ev,
        AdminEvent {
            source: "s1".into(),
            op: AdminOp::ForceClose
        },
        "other prefix leaked or lost"
    );
}

/// An admin op on local state would be invisible to every other host: while Redis is
/// unreachable it is refused (in both modes), nothing changes, nothing is broadcast.
#[tokio::test]
async fn admin_ops_are_refused_while_redis_is_unreachable() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let local = backend(&srv, &p, ms(200), OnBackendError::Local).await;
    let closed = backend(&srv, &p, ms(200), OnBackendError::FailClosed).await;
    let mut rx = local.admin_events();
    srv.kill();
    for b in [&local, &closed] {
        let ops = [
            b.force_open("s1", Duration::from_secs(60)).await,
            b.force_close("s1").await,
            b.reset("s1").await,
        ];
        for r in ops {
            let Err(BackendError::Unavailable(msg)) = &r else {
                panic!("admin op must fail while redis is down: {r:?}")
            };
            assert!(
                msg.contains("admin operation not applied: shared backend unreachable")
                    && msg.contains(&srv.url()),
                "{msg}"
            );
        }
    }
    // Not even while the source is degraded (hot-path calls are served locally).
    assert!(local.degraded("s1"));
    assert!(matches!(
        local.force_close("s1").await,
        Err(BackendError::Unavailable(_))
    ));
    // The local breaker was not forced open: the hot path (served locally) admits.
    let e = local.try_enter("s1", &bp()).await.unwrap();
    assert_eq!((e.granted, e.state), (true, State::Closed));
    assert!(
        tokio::time::timeout(ms(300), rx.recv()).await.is_err(),
        "nothing broadcast"
    );
    // Back up: the next admin op goes through and restores the source.
    srv.restart();
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        match local.force_open("s1", Duration::from_secs(60)).await {
            Ok(a) => {
                assert_eq!(a.state, State::Open);
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "not recovered: {e}"),
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert!(!local.degraded("s1"));
    let e = loop {
        match closed.try_enter("s1", &bp()).await {
            Ok(e) => break e,
            Err(e) => assert!(Instant::now() < deadline, "not recovered: {e}"),
        }
        tokio::time::sleep(ms(50)).await;
    };
    assert_eq!(
        e.state,
        State::Open,
        "applied on redis, seen by the other host"
    );
}

/// A permit granted by the local fallback must be fenced on Redis after the restore
/// (and Redis's breaker left alone). The local fallback grants no probe (§10), so the
/// local permit is a plain one, granted while Redis's breaker is CLOSED.
#[tokio::test]
async fn local_permits_are_fenced_on_redis_after_restore() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(200), OnBackendError::Local).await;
    let e = b.try_enter("s1", &bp()).await.unwrap();
    assert!(e.granted && !e.is_probe);
    let redis_epoch = e.epoch;
    // Redis stalls (state kept). The call that finds Redis stalled is a read: it
    // still runs once Redis resumes, and must not move Redis's breaker.
    srv.pause();
    b.retry_after(&["s1"]).await.unwrap();
    assert!(b.degraded("s1"));
    let e = b.try_enter("s1", &bp()).await.unwrap();
    assert!(
        e.granted && !e.is_probe,
        "known CLOSED: served locally: {e:?}"
    );
    let local_epoch = e.epoch;
    srv.resume();
    let deadline = Instant::now() + Duration::from_secs(4);
    while b.degraded("s1") {
        assert!(Instant::now() < deadline, "not restored after SIGCONT");
        b.retry_after(&["s1"]).await.unwrap();
        tokio::time::sleep(ms(50)).await;
    }
    let a = b.record_failure("s1", local_epoch, &bp()).await.unwrap();
    assert!(!a.applied, "a local permit is fenced on redis: {a:?}");
    assert_eq!((a.state, a.epoch), (State::Closed, redis_epoch));
    assert!(
        local_epoch >= 1 << 62,
        "local epochs live elsewhere: {local_epoch}"
    );
    let snap = b.snapshot("s1", &bp(), &qp()).await.unwrap();
    assert_eq!(
        (snap.state, snap.epoch, snap.streak),
        (State::Closed, redis_epoch, 0)
    );
}

/// §10 (issue 21): degrading never forgets what the host knew. With Redis stalled
/// (SIGSTOP), a source this host last saw OPEN — force-opened for an hour, opened by
/// its breaker, blocked by a 429 — stays refused until that deadline; a source whose
/// probe is due (its deadline passed, or HALF_OPEN) gets no probe; a source last
/// seen CLOSED is served locally. Before the fix, the blank local state admitted
/// all of them.
#[tokio::test]
async fn degraded_mode_keeps_what_the_host_knew() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let sources = ["forced", "opened", "blocked", "due", "closed"];
    let o = RedisOptions {
        sources: sources.iter().map(|s| s.to_string()).collect(),
        ..opts(&srv.url(), &prefix(), ms(200), OnBackendError::Local)
    };
    let b = RedisBackend::connect(o, Arc::new(TokioClock::new()))
        .await
        .unwrap();
    let long = BreakerParams {
        cooldown: Duration::from_secs(60),
        max_cooldown: Duration::from_secs(600),
        ..bp()
    };
    let hour = Duration::from_secs(3600);
    b.force_open("forced", hour).await.unwrap();
    for _ in 0..3 {
        let e = b.try_enter("opened", &long).await.unwrap();
        b.record_failure("opened", e.epoch, &long).await.unwrap();
    }
    let e = b.try_enter("blocked", &bp()).await.unwrap();
    let r429 = Outcome::RateLimited {
        retry_after: Some(hour),
    };
    b.report(
        "blocked",
        ReportRequest::new(&bp(), &qp(), e.epoch, false, 0, r429),
    )
    .await
    .unwrap();
    for _ in 0..3 {
        let e = b.try_enter("due", &bp()).await.unwrap();
        b.record_failure("due", e.epoch, &bp()).await.unwrap();
    }
    assert!(b.try_enter("closed", &bp()).await.unwrap().granted);

    srv.pause();
    let admit = |s: &'static str, p: BreakerParams| {
        let b = &b;
        async move { b.admit(s, AdmitRequest::new(&p, &qp(), 10)).await.unwrap() }
    };
    match admit("forced", bp()).await {
        Admit::CircuitOpen {
            state: State::Open,
            retry_after,
            ..
        } => assert!(
            retry_after > hour - Duration::from_secs(60),
            "{retry_after:?}"
        ),
        a => panic!("force-opened for an hour: refused while redis is stalled: {a:?}"),
    }
    assert!(b.degraded("forced"), "served from local state");
    let p = b.peek("forced").await.unwrap();
    assert_eq!(p.state, State::Open, "the memo re-check reads it OPEN too");
    assert!(p.retry_after > hour - Duration::from_secs(60));
    match admit("opened", long).await {
        Admit::CircuitOpen {
            state: State::Open,
            retry_after,
            ..
        } => assert!(retry_after > Duration::from_secs(50), "{retry_after:?}"),
        a => panic!("opened by its breaker: refused: {a:?}"),
    }
    match admit("blocked", bp()).await {
        Admit::RateLimited { retry_after } => {
            assert!(
                retry_after > hour - Duration::from_secs(60),
                "{retry_after:?}"
            )
        }
        a => panic!("a 429 block holds while degraded: {a:?}"),
    }
    // Its 100 ms cooldown is over: a probe is due, and none is granted locally,
    // however often asked (neither by admit nor by try_enter).
    tokio::time::sleep(ms(150)).await;
    for _ in 0..5 {
        match admit("due", bp()).await {
            Admit::CircuitOpen {
                state: State::HalfOpen,
                retry_after,
                ..
            } => assert_eq!(retry_after, Duration::ZERO),
            a => panic!("no probe on a source whose shared state is unknown: {a:?}"),
        }
        let e = b.try_enter("due", &bp()).await.unwrap();
        assert!(!e.granted, "no probe by try_enter either: {e:?}");
    }
    assert!(
        matches!(
            admit("closed", bp()).await,
            Admit::Admitted {
                is_probe: false,
                ..
            }
        ),
        "a source last seen CLOSED is served locally"
    );
    srv.resume();
    // Redis answers again: its own state is served (still OPEN for the hour).
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        let a = admit("forced", bp()).await;
        if !b.degraded("forced") {
            assert!(
                matches!(a, Admit::CircuitOpen { state: State::Open, epoch, .. } if epoch < 1 << 62),
                "{a:?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "not restored after SIGCONT");
        tokio::time::sleep(ms(100)).await;
    }
}

/// A server error reply (here: a key of the wrong type, so the script fails) is not an
/// outage: no degradation, no retry loop, a protocol error carrying the server's text.
#[tokio::test]
async fn script_errors_are_protocol_errors_not_outages() {
    let logs = Logs::global();
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    for on in [OnBackendError::Local, OnBackendError::FailClosed] {
        let b = backend(&srv, &p, ms(500), on).await;
        srv.cli(&["SET", &b.breaker_key("s1"), "not a hash"]);
        for _ in 0..3 {
            let err = b
                .admit("s1", AdmitRequest::new(&bp(), &qp(), 10))
                .await
                .unwrap_err();
            let BackendError::Protocol(msg) = &err else {
                panic!("{on:?}: expected a protocol error: {err:?}")
            };
            assert!(msg.contains("WRONGTYPE") && msg.contains("admit"), "{msg}");
            assert!(
                !b.degraded("s1"),
                "{on:?}: redis answered, nothing degrades"
            );
        }
        let err = b.force_close("s1").await.unwrap_err();
        assert!(matches!(err, BackendError::Protocol(_)), "{err:?}");
        // Other sources are unaffected, and s1 works again once the key is fixed.
        admit_report(&b, "s2").await;
        srv.cli(&["DEL", &b.breaker_key("s1")]);
        admit_report(&b, "s1").await;
    }
    assert_eq!(logs.count("unreachable", &srv.url()), 0, "no outage logged");
}

#[tokio::test]
async fn any_backend_delegates() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = AnyBackend::Redis(backend(&srv, &prefix(), ms(300), OnBackendError::FailClosed).await);
    assert_eq!(b.name(), "redis");
    assert!(b.admin_events().is_some());
    admit_report(&b, "s1").await;
    assert_eq!(
        b.snapshot("s1", &bp(), &qp())
            .await
            .unwrap()
            .window_successes,
        1
    );
    let m = AnyBackend::Memory(polygate::backend::memory::MemoryBackend::new(
        Arc::new(TokioClock::new()),
        SOURCES,
    ));
    assert_eq!(m.name(), "memory");
    assert!(m.admin_events().is_none());
    admit_report(&m, "s1").await;
}

// ---------------------------------------------------------------- cluster

#[tokio::test]
async fn cluster_ops_admin_and_routing() {
    let Some(cl) = RedisCluster::start() else {
        return;
    };
    let p = prefix();
    let mk = |p: String| {
        let o = RedisOptions {
            url: String::new(),
            cluster_nodes: cl.urls(),
            key_prefix: p,
            timeout: ms(500),
            on_backend_error: OnBackendError::FailClosed,
            sources: SOURCES.iter().map(|s| s.to_string()).collect(),
            degraded_share: polygate::config::DegradedShare::Auto,
        };
        RedisBackend::connect(o, Arc::new(TokioClock::new()))
    };
    let h1 = mk(p.clone()).await.unwrap();
    let h2 = mk(p.clone()).await.unwrap();
    let mut rx = h2.admin_events();
    wait_subscribed(&h2).await;
    for s in SOURCES {
        admit_report(&h1, s).await;
        // Both keys live on the node owning the source's slot.
        let node = cl.node_for(&h1.breaker_key(s));
        assert_eq!(
            node.cli(&["EXISTS", &h1.breaker_key(s), &h1.quota_key(s)])
                .trim(),
            "2"
        );
    }
    cl.nodes.iter().for_each(|n| {
        n.cli(&["CONFIG", "RESETSTAT"]);
    });
    admit_report(&h1, "s2").await;
    assert_eq!(
        cl.command_calls("fcall"),
        2,
        "one FCALL per admit and per report"
    );
    // Admin broadcast crosses nodes (h2 subscribes on the first seed).
    for s in SOURCES {
        h1.force_close(s).await.unwrap();
        assert_eq!(
            next_event(&mut rx).await,
            AdminEvent {
                source: s.into(),
                op: AdminOp::ForceClose
            }
        );
    }
    let a = h1.force_open("s3", ms(300)).await.unwrap();
    assert_eq!(a.retry_after, ms(300));
    let r = h2.retry_after(&["s3"]).await.unwrap();
    assert!(r <= ms(300) && r > ms(200));
    assert_eq!(h2.retry_after(&["s1", "s3"]).await.unwrap(), Duration::ZERO);
    // Library reload on every node.
    for n in &cl.nodes {
        n.cli(&["FUNCTION", "FLUSH"]);
    }
    for s in ["s1", "s2"] {
        admit_report(&h2, s).await;
    }
}

#[tokio::test]
async fn cluster_node_down_degrades_only_its_sources() {
    let Some(mut cl) = RedisCluster::start() else {
        return;
    };
    let o = RedisOptions {
        url: String::new(),
        cluster_nodes: cl.urls(),
        key_prefix: prefix(),
        timeout: ms(200),
        on_backend_error: OnBackendError::Local,
        sources: SOURCES.iter().map(|s| s.to_string()).collect(),
        degraded_share: polygate::config::DegradedShare::Auto,
    };
    let b = RedisBackend::connect(o, Arc::new(TokioClock::new()))
        .await
        .unwrap();
    for s in SOURCES {
        admit_report(&b, s).await;
    }
    let port_of = |cl: &RedisCluster, s: &str| cl.node_for(&b.breaker_key(s)).port;
    let dead_port = port_of(&cl, "s1");
    let (down, up): (Vec<&str>, Vec<&str>) =
        SOURCES.iter().partition(|s| port_of(&cl, s) == dead_port);
    let i = cl.nodes.iter().position(|n| n.port == dead_port).unwrap();
    cl.nodes[i].kill();
    for _ in 0..3 {
        for s in SOURCES {
            let t0 = Instant::now();
            admit_report(&b, s).await;
            assert!(
                t0.elapsed() < ms(2 * 200 + 150),
                "{s}: bounded: {:?}",
                t0.elapsed()
            );
        }
    }
    for s in &down {
        assert!(b.degraded(s), "{s} lives on the dead node");
    }
    for s in &up {
        assert!(!b.degraded(s), "{s} lives on a live node");
    }
    // The node comes back with its slots (nodes.conf survives): its sources return.
    cl.nodes[i].restart();
    let t0 = Instant::now();
    while down.iter().any(|s| b.degraded(s)) {
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "not restored after the node came back"
        );
        for s in &down {
            admit_report(&b, s).await;
        }
        tokio::time::sleep(ms(50)).await;
    }
    eprintln!("restored after {:?}", t0.elapsed());
}

#[tokio::test]
async fn any_backend_from_config() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let toml = format!(
        r#"
[sidecar]
backend = "redis"
redis_url = "{}"
key_prefix = "{}"
on_backend_error = "fail_closed"
redis_timeout = "300ms"

[[scopes.chat.sources]]
name = "a"
timeout = "1s"
[[scopes.chat.sources]]
name = "b"
timeout = "1s"

[[scopes.embed.sources]]
name = "a"
timeout = "1s"
"#,
        srv.url(),
        prefix()
    );
    let cfg = polygate::config::parse_str(&toml, std::iter::empty()).expect("config");
    let o = RedisOptions::from_config(&cfg);
    assert_eq!(
        o.sources,
        vec!["a".to_string(), "b".to_string()],
        "deduplicated"
    );
    assert_eq!(
        (o.timeout, o.on_backend_error),
        (ms(300), OnBackendError::FailClosed)
    );
    let b = AnyBackend::from_config(&cfg, Arc::new(TokioClock::new()))
        .await
        .unwrap();
    assert_eq!(b.name(), "redis");
    admit_report(&b, "a").await;
    assert!(matches!(
        b.try_enter("s1", &bp()).await,
        Err(BackendError::UnknownSource(_))
    ));
}

/// §10 heartbeats: every backend (host) on a key prefix keeps a heartbeat under
/// `{<prefix>}:hosts`, refreshed every second; each host reads the live count with
/// no round trip of its own on a call's path, and a host that stops falls out of
/// the count within the TTL. Another prefix is another fleet.
#[tokio::test]
async fn heartbeats_count_live_hosts_and_expire() {
    use polygate::backend::redis::{hosts_key, HEARTBEAT_EVERY, HEARTBEAT_TTL};
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let a = backend(&srv, &p, ms(500), OnBackendError::Local).await;
    let b = backend(&srv, &p, ms(500), OnBackendError::Local).await;
    let c = backend(&srv, &p, ms(500), OnBackendError::Local).await;
    let other = backend(&srv, &prefix(), ms(500), OnBackendError::Local).await;
    let live = |x: &RedisBackend| x.degraded_share().expect("redis shows a share").live_hosts;
    let deadline = Instant::now() + HEARTBEAT_EVERY * 4;
    while live(&a) != 3 || live(&c) != 3 {
        assert!(
            Instant::now() < deadline,
            "3 hosts never counted: {}",
            live(&a)
        );
        tokio::time::sleep(ms(50)).await;
    }
    let v = a.degraded_share().unwrap();
    assert!(
        (v.share - 1.0 / 3.0).abs() < 1e-9,
        "auto: 1 / live hosts: {v:?}"
    );
    assert_eq!(live(&other), 1, "another prefix is another fleet");
    assert_eq!(srv.cli(&["ZCARD", &hosts_key(&p)]).trim(), "3");
    let ttl: i64 = srv.cli(&["PTTL", &hosts_key(&p)]).trim().parse().unwrap();
    assert!(ttl > 0 && ttl <= HEARTBEAT_TTL.as_millis() as i64, "{ttl}");
    // One host stops: it no longer counts once its heartbeat expired.
    drop(c);
    let stopped = Instant::now();
    while live(&a) != 2 || live(&b) != 2 {
        assert!(
            stopped.elapsed() < HEARTBEAT_TTL + HEARTBEAT_EVERY * 3,
            "a stopped host still counted after {:?}",
            stopped.elapsed()
        );
        tokio::time::sleep(ms(50)).await;
    }
    assert!(stopped.elapsed() >= HEARTBEAT_TTL - HEARTBEAT_EVERY * 2);
    // Redis stalls: the last count stands.
    srv.pause();
    tokio::time::sleep(HEARTBEAT_TTL).await;
    assert_eq!(live(&a), 2, "the share is the fleet last seen");
    srv.resume();
}

/// §10 degraded share: two hosts on one Redis, rpm = 10 (a 10-request bucket, one
/// request back every 6 s). While Redis is stalled each host admits only its share
/// of the bucket (auto: 1 / 2 live hosts = 5), so together they admit the limit —
/// not twice it, as two hosts each enforcing the whole limit locally did.
#[tokio::test]
async fn a_degraded_host_uses_only_its_share_of_each_quota() {
    use polygate::backend::redis::HEARTBEAT_EVERY;
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let a = backend(&srv, &p, ms(200), OnBackendError::Local).await;
    let b = backend(&srv, &p, ms(200), OnBackendError::Local).await;
    let deadline = Instant::now() + HEARTBEAT_EVERY * 4;
    while a.degraded_share().unwrap().live_hosts != 2 || b.degraded_share().unwrap().live_hosts != 2
    {
        assert!(Instant::now() < deadline, "2 hosts never counted");
        tokio::time::sleep(ms(50)).await;
    }
    let q = QuotaParams {
        rpm: Some(10),
        ..QuotaParams::default()
    };
    srv.pause();
    let mut admitted = 0;
    for h in [&a, &b] {
        for _ in 0..20 {
            if let Admit::Admitted { .. } = h
                .admit("s1", AdmitRequest::new(&bp(), &q, 0))
                .await
                .unwrap()
            {
                admitted += 1;
            }
        }
        assert!(h.degraded("s1"));
        let snap = h.snapshot("s1", &bp(), &q).await.unwrap();
        assert!(
            snap.requests_available.unwrap() < 1.0,
            "each host's share is spent: {snap:?}"
        );
    }
    srv.resume();
    assert_eq!(admitted, 10, "together: the limit, 5 each");
}

/// A fixed `degraded_share` applies whatever the host count.
#[tokio::test]
async fn a_fixed_degraded_share_applies_as_configured() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let o = RedisOptions {
        degraded_share: polygate::config::DegradedShare::Fraction(0.3),
        ..opts(&srv.url(), &prefix(), ms(200), OnBackendError::Local)
    };
    let b = RedisBackend::connect(o, Arc::new(TokioClock::new()))
        .await
        .unwrap();
    assert_eq!(b.degraded_share().unwrap().share, 0.3);
    let q = QuotaParams {
        rpm: Some(10),
        ..QuotaParams::default()
    };
    srv.pause();
    let mut admitted = 0;
    for _ in 0..10 {
        if let Admit::Admitted { .. } = b
            .admit("s1", AdmitRequest::new(&bp(), &q, 0))
            .await
            .unwrap()
        {
            admitted += 1;
        }
    }
    srv.resume();
    assert_eq!(admitted, 3, "0.3 of 10");
}

/// §10: a host that last saw the shared quota refuse takes it as spent when it
/// degrades: its local buckets start empty and it gets its share of the refill, not
/// a fresh full bucket on top of what the fleet already used.
#[tokio::test]
async fn a_quota_last_seen_spent_starts_empty_when_degraded() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let b = backend(&srv, &prefix(), ms(200), OnBackendError::Local).await;
    let q = QuotaParams {
        rpm: Some(60),
        ..QuotaParams::default()
    };
    let admit = || async {
        b.admit("s1", AdmitRequest::new(&bp(), &q, 0))
            .await
            .unwrap()
    };
    let mut spent = false;
    for _ in 0..70 {
        if let Admit::RateLimited { .. } = admit().await {
            spent = true;
            break;
        }
    }
    assert!(spent, "60 rpm: the shared bucket refuses after 60");
    srv.pause();
    let first = admit().await;
    assert!(b.degraded("s1"));
    assert!(
        matches!(first, Admit::RateLimited { retry_after } if retry_after <= ms(1000)),
        "empty, one request's refill away: {first:?}"
    );
    tokio::time::sleep(ms(1100)).await;
    let mut n = 0;
    for _ in 0..10 {
        if let Admit::Admitted { .. } = admit().await {
            n += 1;
        }
    }
    srv.resume();
    assert_eq!(
        n, 1,
        "a second's refill: one request, not a fresh bucket of 60"
    );
}

/// §18 on Redis: a quota hash that holds a learned "auto" limit is kept an hour past
/// its last write, not the minute a full bucket gets (after which a learned source
/// went back to one call at a time). Calls in flight alone do not keep it: a report
/// that never arrives leaves its count, which holds an unlearned "auto" source to
/// one call at a time, and that must clear within the minute.
#[tokio::test]
async fn a_learned_limit_keeps_the_quota_hash_and_a_lost_report_does_not() {
    use polygate::backend::{Dim, Observation};
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let p = prefix();
    let b = backend(&srv, &p, ms(500), OnBackendError::FailClosed).await;
    let pttl = |k: &str| -> i64 { srv.cli(&["PTTL", k]).trim().parse().unwrap() };
    let hour = 3_600_000;
    let bp = bp();
    let auto = QuotaParams {
        tpm: None,
        observe: true,
        auto: 1,
        ..qp()
    };
    let admit = |s: &'static str| {
        let (b, bp, q) = (&b, &bp, &auto);
        async move { b.admit(s, AdmitRequest::new(bp, q, 10)).await.unwrap() }
    };
    // Unlearned, one call in flight whose report is lost (its host died): the next
    // call waits for it, but only until the hash expires, a minute on.
    let Admit::Admitted { .. } = admit("s1").await else {
        panic!("the first call of an unlearned source is admitted")
    };
    let Admit::RateLimited { .. } = admit("s1").await else {
        panic!("one call at a time until the first response")
    };
    let qk = b.quota_key("s1");
    assert!(
        (0..=61_000).contains(&pttl(&qk)),
        "a lost report held the source for PTTL {} ms",
        pttl(&qk)
    );
    // Learned from the provider's limit header: kept an hour.
    let Admit::Admitted { epoch, .. } = admit("s2").await else {
        panic!("the first call of an unlearned source is admitted")
    };
    let qk2 = b.quota_key("s2");
    assert!(pttl(&qk2) <= 61_000, "unlearned: PTTL {}", pttl(&qk2));
    let o = Observation {
        dims: [
            Some(Dim {
                limit: Some(1_000),
                remaining: Some(990),
                reset: None,
            }),
            None,
            None,
            None,
        ],
        age: Duration::ZERO,
    };
    let r =
        ReportRequest::new(&bp, &auto, epoch, false, 10, Outcome::success(Some(10))).observed(&o);
    assert!(b.report("s2", r).await.unwrap().applied);
    assert!(pttl(&qk2) > hour - 5_000, "learned: PTTL {}", pttl(&qk2));
    // And it is learned: calls are admitted side by side.
    for _ in 0..2 {
        let Admit::Admitted { .. } = admit("s2").await else {
            panic!("a learned source admits calls side by side")
        };
    }
}

/// §18 across a degradation: a permit admitted on Redis under its last cut, whose 429
/// reaches the host once Redis is gone (no cut made anywhere since), cuts the local
/// fallback's factor. The local factor is seeded from Redis's reading, dated on this
/// host's clock: the permit's cut, dated on Redis's, is no date of it and must not
/// read as "a cut since". 0.7 × 0.7 = 0.49 of a source that does not learn.
#[tokio::test]
async fn a_redis_permit_reported_while_degraded_cuts_the_local_factor() {
    let Some(mut srv) = RedisServer::start() else {
        return;
    };
    let (b, q) = degradable_learning(&srv).await;
    tokio::time::sleep(ms(1_100)).await;
    let (epoch, rate) = grant_s1(&b, &q).await;
    assert!(
        matches!(rate.cut, SeenCut::At(_)),
        "under the cut: {rate:?}"
    );
    srv.kill();
    tokio::time::sleep(ms(1_100)).await; // past a second from the seed's reading
    report_429_s1(&b, &q, epoch, Some(rate)).await;
    assert!(b.degraded("s1"));
    let cut = b.snapshot("s1", &bp(), &q).await.unwrap().levels[1].unwrap();
    let whole = b.snapshot("s2", &bp(), &qp()).await.unwrap().levels[1].unwrap();
    let f = cut / whole;
    assert!((0.48..=0.50).contains(&f), "the local factor cut: {f}");
}

/// The other way: a permit the local fallback admitted (Redis paused), reported once
/// Redis answers again (no cut made on Redis since), cuts the shared factor: its cut,
/// dated on this host's clock, is no date of Redis's.
#[tokio::test]
async fn a_local_permit_reported_after_restore_cuts_the_shared_factor() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let (b, q) = degradable_learning(&srv).await;
    tokio::time::sleep(ms(1_100)).await;
    srv.pause();
    let (epoch, rate) = grant_s1(&b, &q).await;
    assert!(b.degraded("s1"), "admitted locally");
    srv.resume();
    tokio::time::sleep(ms(1_200)).await; // the retry interval: the report asks Redis
    report_429_s1(&b, &q, epoch, Some(rate)).await;
    assert!(!b.degraded("s1"), "reported on Redis");
    let (ppm, _) = field_ar(&srv, &b, "s1");
    assert!(ppm < 500_000, "the shared factor cut (0.7 × ~0.7): {ppm}");
}
