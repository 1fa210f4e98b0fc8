//! §18 on Redis (issue 29 #4): a source that observes keeps in-flight counts in its
//! quota hash, and a host killed with calls in flight must not leave its counts there
//! until the hash expires. Each host's share is kept apart (`h:<host>`), and a host
//! that sees another's heartbeat expire drops that host's counts from every quota
//! hash; a late report of the dropped host's calls takes nothing more. On one server
//! and on a Redis Cluster (the quota hash and the heartbeat set are in other slots).

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use polygate::backend::redis::{RedisBackend, RedisOptions};
use polygate::backend::{
    Admit, AdmitRequest, Backend, BreakerParams, Outcome, QuotaParams, ReportRequest,
};
use polygate::clock::TokioClock;
use polygate::config::{DegradedShare, OnBackendError};
use support::redis_server::{RedisCluster, RedisServer};

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

/// A source that observes (§18): it keeps in-flight counts.
fn observing() -> QuotaParams {
    QuotaParams {
        tpm: Some(60_000),
        rpm: Some(1000),
        observe: true,
        ..QuotaParams::default()
    }
}

async fn host(url: String, nodes: Vec<String>, prefix: &str) -> RedisBackend {
    let opts = RedisOptions {
        url,
        cluster_nodes: nodes,
        key_prefix: prefix.to_string(),
        timeout: Duration::from_secs(2),
        on_backend_error: OnBackendError::FailClosed,
        sources: vec!["s1".into()],
        degraded_share: DegradedShare::Auto,
    };
    RedisBackend::connect(opts, Arc::new(TokioClock::new()))
        .await
        .expect("connect")
}

/// Admit one call of 10 tokens; its epoch.
async fn admit(b: &RedisBackend) -> u64 {
    match b
        .admit("s1", AdmitRequest::new(&bp(), &observing(), 10))
        .await
        .unwrap()
    {
        Admit::Admitted { epoch, .. } => epoch,
        a => panic!("admit refused: {a:?}"),
    }
}

async fn report(b: &RedisBackend, epoch: u64) {
    let outcome = Outcome::Success {
        tokens: Some(10),
        split: None,
        count_attempt: true,
    };
    b.report(
        "s1",
        ReportRequest::new(&bp(), &observing(), epoch, false, 10, outcome),
    )
    .await
    .unwrap();
}

/// `(tokens, requests)` in flight as the quota hash counts them, and its per-host
/// fields with a share above zero (a live host's share at zero stays, `0 0 0 0 since`).
type Read = dyn Fn() -> ((u64, u64), Vec<String>);

fn reader(cli: impl Fn(&[&str]) -> String + 'static, key: String) -> Box<Read> {
    Box::new(move || {
        let v = cli(&["HMGET", &key, "ft", "fr"]);
        let n: Vec<u64> = v.lines().map(|l| l.trim().parse().unwrap_or(0)).collect();
        let all: Vec<String> = cli(&["HGETALL", &key])
            .lines()
            .map(|l| l.trim().to_string())
            .collect();
        let fields = all
            .chunks(2)
            .filter(|kv| {
                kv.len() == 2
                    && kv[0].starts_with("h:")
                    && kv[1].split(' ').take(4).any(|n| n != "0")
            })
            .map(|kv| kv[0].clone())
            .collect();
        ((n[0], n.get(1).copied().unwrap_or(0)), fields)
    })
}

async fn killed_host_s_counts_are_dropped(a: RedisBackend, b: RedisBackend, read: Box<Read>) {
    let mine = admit(&a).await;
    let mut theirs = Vec::new();
    for _ in 0..3 {
        theirs.push(admit(&b).await);
    }
    let (counts, hosts) = read();
    assert_eq!(counts, (40, 4), "both hosts' calls in flight");
    assert_eq!(hosts.len(), 2, "one share per host: {hosts:?}");

    // b stops beating with its calls in flight, as a kill -9 leaves it.
    b.stop_heartbeat();
    let t0 = Instant::now();
    while read().0 != (10, 1) {
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "b's counts still there after {:?}: {:?}",
            t0.elapsed(),
            read()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Within the heartbeat TTL (3 s) and a beat or two.
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    assert_eq!(read().1.len(), 1, "b's share is gone: {:?}", read().1);

    // A late report of b's calls (a host back from a partition) takes nothing from a's.
    for e in theirs {
        report(&b, e).await;
    }
    assert_eq!(read().0, (10, 1), "a's call still counted");
    report(&a, mine).await;
    assert_eq!(
        read(),
        ((0, 0), vec![]),
        "nothing left in flight, no share left"
    );
}

#[tokio::test]
async fn a_killed_host_s_in_flight_counts_go_with_its_heartbeat() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let prefix = format!(
        "hf{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let a = host(srv.url(), vec![], &prefix).await;
    let b = host(srv.url(), vec![], &prefix).await;
    let key = a.quota_key("s1");
    let srv = Arc::new(srv);
    let s = srv.clone();
    killed_host_s_counts_are_dropped(a, b, reader(move |args| s.cli(args), key)).await;
}

#[tokio::test]
async fn a_killed_host_s_in_flight_counts_go_with_its_heartbeat_on_a_cluster() {
    let Some(cl) = RedisCluster::start() else {
        return;
    };
    let prefix = format!(
        "hfc{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let a = host(String::new(), cl.urls(), &prefix).await;
    let b = host(String::new(), cl.urls(), &prefix).await;
    let key = a.quota_key("s1");
    let cl = Arc::new(cl);
    let c = cl.clone();
    let k = key.clone();
    killed_host_s_counts_are_dropped(a, b, reader(move |args| c.node_for(&k).cli(args), key)).await;
}

/// No live host sees the stop when the whole fleet stopped (here: the one host): the
/// heartbeat set expires with its last member. The next host to start reconciles on
/// its first beat and drops every share but the live hosts'.
#[tokio::test]
async fn shares_of_a_fleet_that_all_stopped_are_dropped_by_the_next_host() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let prefix = format!(
        "hfr{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let old = host(srv.url(), vec![], &prefix).await;
    let key = old.quota_key("s1");
    let srv = Arc::new(srv);
    let s = srv.clone();
    let read = reader(move |args| s.cli(args), key);
    for _ in 0..2 {
        admit(&old).await;
    }
    assert_eq!(read().0, (20, 2));
    old.stop_heartbeat();
    // Past the TTL: the heartbeat set is gone, and no one saw the stop.
    let t0 = Instant::now();
    while !srv
        .cli(&["EXISTS", &polygate_hosts_key(&prefix)])
        .starts_with('0')
    {
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "the heartbeat set did not expire"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        read().0,
        (20, 2),
        "nothing dropped the old host's share yet"
    );
    let new = host(srv.url(), vec![], &prefix).await;
    let t0 = Instant::now();
    while read().0 != (0, 0) {
        assert!(t0.elapsed() < Duration::from_secs(3), "still {:?}", read());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admit(&new).await;
    assert_eq!(read().0, (10, 1), "the new host's own call counts");
    assert_eq!(read().1.len(), 1);
}

/// The heartbeat set of a key prefix (hosts.rs).
fn polygate_hosts_key(prefix: &str) -> String {
    format!("{{{prefix}}}:hosts")
}

/// The host's share costs no command of its own: it rides in the quota hash's one
/// `HSET` of each admission and report (no `HDEL`, no second write).
#[tokio::test]
async fn a_host_s_share_rides_in_the_one_hset() {
    let Some(srv) = RedisServer::start() else {
        return;
    };
    let prefix = format!(
        "hfb{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let b = host(srv.url(), vec![], &prefix).await;
    b.stop_heartbeat(); // its scripts are not a call's cost
    let e = admit(&b).await; // loads the library
    report(&b, e).await;
    srv.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..10 {
        let e = admit(&b).await;
        report(&b, e).await;
    }
    let (hset, hdel) = (srv.command_calls("hset"), srv.command_calls("hdel"));
    assert_eq!(hdel, 0);
    // admit: HSET q (+ the breaker's on a first call only); report: HSET b, HSET q.
    assert!(hset <= 30, "{hset} HSETs for 10 admissions and reports");
}
