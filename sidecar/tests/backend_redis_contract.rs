//! The backend contract suite (`tests/contract/`) against the Redis backend: once on a
//! single node, once on a 3-master Redis Cluster. Real time (Redis `TIME`), so
//! `advance` sleeps. Each case gets its own key prefix on a server shared by the file.
//! `on_backend_error = fail_closed`, so a Redis problem fails the case instead of being
//! papered over by the local fallback.

mod contract;
mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use contract::{Harness, SOURCES};
use polygate::backend::redis::{RedisBackend, RedisOptions};
use polygate::clock::TokioClock;
use polygate::config::OnBackendError;
use support::redis_server::{RedisCluster, RedisServer};

static SERVER: OnceLock<Option<RedisServer>> = OnceLock::new();
static CLUSTER: OnceLock<Option<RedisCluster>> = OnceLock::new();
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Fresh backends (new key prefix each) on one Redis deployment.
struct RedisHarness {
    url: String,
    cluster_nodes: Vec<String>,
}

impl RedisHarness {
    fn single() -> Option<Self> {
        let srv = SERVER.get_or_init(RedisServer::start).as_ref()?;
        Some(RedisHarness {
            url: srv.url(),
            cluster_nodes: vec![],
        })
    }

    fn cluster() -> Option<Self> {
        let c = CLUSTER.get_or_init(RedisCluster::start).as_ref()?;
        Some(RedisHarness {
            url: String::new(),
            cluster_nodes: c.urls(),
        })
    }
}

impl Harness for RedisHarness {
    type B = RedisBackend;

    async fn fresh(&self) -> RedisBackend {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let opts = RedisOptions {
            url: self.url.clone(),
            cluster_nodes: self.cluster_nodes.clone(),
            key_prefix: format!("contract-{}-{n}", std::process::id()),
            timeout: Duration::from_secs(2),
            on_backend_error: OnBackendError::FailClosed,
            sources: SOURCES.iter().map(|s| s.to_string()).collect(),
            degraded_share: polygate::config::DegradedShare::Auto,
        };
        RedisBackend::connect(opts, Arc::new(TokioClock::new()))
            .await
            .expect("connect")
    }

    async fn advance(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    async fn second(&self, b: &RedisBackend) -> Option<RedisBackend> {
        // `{prefix:s1}:b` → prefix: another host on the same keys.
        let key = b.breaker_key(SOURCES[0]);
        let prefix = key
            .strip_prefix('{')?
            .strip_suffix(&format!(":{}}}:b", SOURCES[0]))?
            .to_string();
        let opts = RedisOptions {
            url: self.url.clone(),
            cluster_nodes: self.cluster_nodes.clone(),
            key_prefix: prefix,
            timeout: Duration::from_secs(2),
            on_backend_error: OnBackendError::FailClosed,
            sources: SOURCES.iter().map(|s| s.to_string()).collect(),
            degraded_share: polygate::config::DegradedShare::Auto,
        };
        Some(
            RedisBackend::connect(opts, Arc::new(TokioClock::new()))
                .await
                .expect("connect"),
        )
    }

    fn tolerance(&self) -> Duration {
        // Real time: the ops between the event and the reading, plus sleep overshoot
        // on a loaded 2-core machine.
        Duration::from_millis(60)
    }

    async fn lose_state(&self, b: RedisBackend) -> RedisBackend {
        // What FLUSHALL does to this case's keys (the server is shared by the
        // file's cases, so only this backend's keys go).
        let keys: Vec<String> = SOURCES
            .iter()
            .flat_map(|s| [b.breaker_key(s), b.quota_key(s)])
            .collect();
        for key in keys {
            let del = redis::cmd("DEL").arg(&key).clone();
            if self.cluster_nodes.is_empty() {
                let client = redis::Client::open(self.url.as_str()).expect("url");
                let mut c = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect");
                let _: i64 = del.query_async(&mut c).await.expect("DEL");
            } else {
                let client =
                    redis::cluster::ClusterClient::new(self.cluster_nodes.clone()).expect("nodes");
                let mut c = client.get_async_connection().await.expect("connect");
                let _: i64 = del.query_async(&mut c).await.expect("DEL");
            }
        }
        b
    }
}

mod single {
    use super::*;

    contract_tests!({
        let Some(h) = RedisHarness::single() else {
            return;
        };
        h
    });
}

mod cluster {
    use super::*;

    contract_tests!({
        let Some(h) = RedisHarness::cluster() else {
            return;
        };
        h
    });
}
