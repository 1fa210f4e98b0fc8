//! Redis Cluster failover under load (§10, issue 25): a master is killed (`kill -9`)
//! while calls run on every source, in the test's own throwaway cluster (3 masters,
//! one replica each). With `on_backend_error = "local"` no call is lost — the
//! failover window is served from local state, which keeps what the host knew — the
//! breaker state a source had on the dead master is there after its replica takes
//! over, and the function library is loaded again where the new master lacks it.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use polygate::backend::redis::{RedisBackend, RedisOptions};
use polygate::backend::{
    Admit, AdmitRequest, Backend, BreakerParams, Outcome, QuotaParams, ReportRequest, State,
};
use polygate::clock::TokioClock;
use polygate::config::{DegradedShare, OnBackendError};
use support::redis_server::RedisCluster;

fn bp() -> BreakerParams {
    BreakerParams {
        failure_threshold: 5,
        failure_rate: 0.5,
        min_calls: 20,
        window: Duration::from_secs(60),
        cooldown: Duration::from_secs(30),
        max_cooldown: Duration::from_secs(600),
        probe_ttl: Duration::from_secs(10),
    }
}

fn qp() -> QuotaParams {
    QuotaParams {
        rpm: Some(1_000_000),
        ..QuotaParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_without_losing_a_call_or_the_breaker() {
    let Some(mut cl) = RedisCluster::start_with_replicas() else {
        return;
    };
    let sources: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    let opts = RedisOptions {
        url: String::new(),
        cluster_nodes: cl.urls(),
        key_prefix: format!("failover-{}", std::process::id()),
        timeout: Duration::from_millis(500),
        on_backend_error: OnBackendError::Local,
        sources: sources.clone(),
        degraded_share: DegradedShare::Auto,
    };
    let b = Arc::new(
        RedisBackend::connect(opts, Arc::new(TokioClock::new()))
            .await
            .expect("connect"),
    );
    // The forced-open source lives on the master that dies.
    let victim = cl.master_index(&b.breaker_key("s0"));
    let hour = Duration::from_secs(3600);
    let forced = b.force_open("s0", hour).await.expect("force_open on redis");
    let epoch = forced.epoch;
    assert!(epoch < 1 << 62);
    for s in &sources[1..] {
        let e = b.try_enter(s, &bp()).await.unwrap();
        assert!(e.granted);
    }
    // The replica has it (asynchronous replication: wait until it has applied it).
    cl.wait_replicated(victim, Duration::from_secs(5));

    let load = Load::start(&b, &sources);
    tokio::time::sleep(Duration::from_millis(300)).await;
    cl.nodes[victim].kill(); // SIGKILL
    let killed = Instant::now();
    // The replica takes over (node timeout 2 s, then an election).
    while !cl.replicas[victim]
        .cli(&["INFO", "replication"])
        .contains("role:master")
    {
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "no failover in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let promoted = killed.elapsed();
    // Served from Redis again (not degraded) within a few seconds of the takeover.
    let recovery = loop {
        let on_redis = sources.iter().all(|s| !b.degraded(s));
        if on_redis {
            let p = b.peek("s0").await.unwrap();
            if p.epoch < 1 << 62 {
                break killed.elapsed();
            }
        }
        assert!(
            killed.elapsed() < promoted + Duration::from_secs(10),
            "not served from redis 10 s after the replica took over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    load.finish("s0").await;
    // The breaker as it was: OPEN for the rest of the hour, the same epoch.
    let p = b.peek("s0").await.unwrap();
    assert_eq!((p.state, p.epoch), (State::Open, epoch), "state kept");
    assert!(p.retry_after > hour - Duration::from_secs(120));
    // The new master without the function library (as a replica promoted from an
    // older snapshot might be): it is loaded again, the call answered by Redis.
    cl.replicas[victim].cli(&["FUNCTION", "FLUSH"]);
    match b
        .admit("s0", AdmitRequest::new(&bp(), &qp(), 1))
        .await
        .unwrap()
    {
        Admit::CircuitOpen {
            state: State::Open,
            epoch: e,
            ..
        } => assert_eq!(e, epoch),
        a => panic!("still OPEN on redis after FUNCTION FLUSH: {a:?}"),
    }
    assert!(!b.degraded("s0"));
    eprintln!(
        "failover: replica promoted after {promoted:?}, served from redis after {recovery:?}"
    );
    // A manual failover (`CLUSTER FAILOVER` on a replica) of another master, under
    // load, with a source its breaker opened there: nothing lost, the state kept.
    let other = (0..3).find(|&i| i != victim).unwrap();
    let opened = sources
        .iter()
        .find(|s| cl.master_index(&b.breaker_key(s)) == other)
        .expect("six sources span the three masters")
        .clone();
    // Its window holds the load's successes: the streak opens it only where the
    // window is too small to veto (a huge min_calls).
    let streaky = BreakerParams {
        min_calls: 1_000_000,
        ..bp()
    };
    let mut last = None;
    for _ in 0..5 {
        let e = b.try_enter(&opened, &streaky).await.unwrap();
        last = Some(b.record_failure(&opened, e.epoch, &streaky).await.unwrap());
    }
    let open = last.unwrap();
    assert_eq!(open.state, State::Open);
    cl.wait_replicated(other, Duration::from_secs(5));
    let load = Load::start(&b, &sources);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asked = cl.replicas[other].cli(&["CLUSTER", "FAILOVER"]);
    assert!(asked.contains("OK"), "CLUSTER FAILOVER: {asked}");
    let t0 = Instant::now();
    while !cl.replicas[other]
        .cli(&["INFO", "replication"])
        .contains("role:master")
    {
        assert!(t0.elapsed() < Duration::from_secs(20), "no manual failover");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    load.finish(&opened).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = b.peek(&opened).await.unwrap();
        if !b.degraded(&opened) && p.epoch < 1 << 62 {
            assert_eq!((p.state, p.epoch), (State::Open, open.epoch), "state kept");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not back on redis after CLUSTER FAILOVER"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Calls on every source, back to back from four tasks, until finished: each call
/// an admission and, when granted, a report of success.
struct Load {
    /// Set to end the tasks.
    stop: Arc<AtomicBool>,
    /// Every error an admission or report returned (a call the local fallback
    /// should have absorbed).
    errors: Arc<Mutex<Vec<String>>>,
    /// Grants per source.
    granted: Arc<Mutex<HashMap<String, u64>>>,
    /// Calls made.
    calls: Arc<AtomicU64>,
    /// The tasks.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(b: &Arc<RedisBackend>, sources: &[String]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let granted: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let calls = Arc::new(AtomicU64::new(0));
        let tasks = (0..4)
            .map(|w| {
                let (b, stop, errors, granted, calls, sources) = (
                    b.clone(),
                    stop.clone(),
                    errors.clone(),
                    granted.clone(),
                    calls.clone(),
                    sources.to_vec(),
                );
                tokio::spawn(async move {
                    let mut i = w;
                    let (p, q) = (bp(), qp());
                    while !stop.load(Ordering::Relaxed) {
                        let s = &sources[i % sources.len()];
                        i += 1;
                        match b.admit(s, AdmitRequest::new(&p, &q, 1)).await {
                            Ok(Admit::Admitted {
                                epoch, is_probe, ..
                            }) => {
                                *granted.lock().unwrap().entry(s.clone()).or_default() += 1;
                                let ok = Outcome::success(Some(1));
                                let r = ReportRequest::new(&p, &q, epoch, is_probe, 1, ok);
                                if let Err(e) = b.report(s, r).await {
                                    errors.lock().unwrap().push(format!("report {s}: {e}"));
                                }
                            }
                            Ok(_) => {}
                            Err(e) => errors.lock().unwrap().push(format!("admit {s}: {e}")),
                        }
                        calls.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
            })
            .collect();
        Load {
            stop,
            errors,
            granted,
            calls,
            tasks,
        }
    }

    /// Stop, and check: no call failed, `refused` (an OPEN source) was never
    /// granted, and the load really ran.
    async fn finish(self, refused: &str) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let errors = self.errors.lock().unwrap().clone();
        assert!(
            errors.is_empty(),
            "calls failed: {:?}",
            &errors[..errors.len().min(5)]
        );
        let granted = self.granted.lock().unwrap().clone();
        assert_eq!(
            granted.get(refused),
            None,
            "the OPEN source {refused} was granted during the failover: {granted:?}"
        );
        assert!(self.calls.load(Ordering::Relaxed) > 100);
    }
}
