//! Connections to Redis: a single node or a Redis Cluster, made lazily, bounded by
//! the configured timeout, and rebuilt after a failure (§10).
//!
//! Nothing here waits for Redis at construction: the first script call connects, so
//! the sidecar starts (and serves from its local fallback) while Redis is down. Both
//! connection kinds multiplex and are cheap to clone (redis-rs `ConnectionManager`
//! reconnects in the background; the cluster connection is re-made after an
//! invalidation). Every call is bounded twice: by the client's connect and response
//! timeouts, and by an outer `tokio::time::timeout` over the whole call, `NOSCRIPT`
//! reload included.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ::redis::aio::ConnectionLike;
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterClientBuilder};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, Cmd, RedisError, Value};

use super::fault::{classify, Fault};
use super::reach::RETRY_INTERVAL;
use super::script::{Call, GATE};
use crate::backend::{BResult, BackendError};

/// A live connection (both kinds are cheap to clone and multiplex).
#[derive(Clone)]
enum Conn {
    /// One node, reconnecting by itself.
    Single(ConnectionManager),
    /// A cluster, routed by each command's first key.
    Cluster(ClusterConnection),
}

/// How to (re)build a connection.
enum Target {
    /// One node: its client and the manager's timeouts and retries.
    Single(Client, ConnectionManagerConfig),
    /// A cluster: its client (seed nodes, timeouts, retries).
    Cluster(ClusterClient),
}

/// The way to Redis for every script call of one backend.
pub(super) struct Connection {
    /// How connections are made.
    target: Target,
    /// The current connection (`None` until first use or after an invalidation).
    current: Mutex<Option<Conn>>,
    /// Serialises (re)connecting in cluster mode.
    connect_lock: tokio::sync::Mutex<()>,
    /// When the connection was last thrown away (at most once per RETRY_INTERVAL).
    last_invalidate: Mutex<Option<Instant>>,
    /// Human-readable target for messages (`redis://…` or the cluster seeds).
    describe: String,
    /// The server does not know `FCALL` (Redis < 7): calls go as `EVALSHA`.
    scripts_only: AtomicBool,
    /// Upper bound of one call, connecting and `NOSCRIPT` reload included.
    timeout: Duration,
}

impl Connection {
    /// The connection to `url` (single node) or, when `cluster_nodes` is non-empty,
    /// to that cluster, each call bounded by `timeout`; and the node URLs the admin
    /// subscriber may use. Validates the URLs; connects nothing.
    pub(super) fn new(
        url: &str,
        cluster_nodes: &[String],
        timeout: Duration,
    ) -> BResult<(Self, Vec<String>)> {
        let bad =
            |e: RedisError| BackendError::Unavailable(format!("invalid redis configuration: {e}"));
        let (target, describe, sub_urls) = if cluster_nodes.is_empty() {
            let client = Client::open(url).map_err(bad)?;
            let cfg = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(50))
                .set_max_delay(Duration::from_millis(500));
            (
                Target::Single(client, cfg),
                url.to_string(),
                vec![url.to_string()],
            )
        } else {
            let client = ClusterClientBuilder::new(cluster_nodes.to_vec())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(1)
                .build()
                .map_err(bad)?;
            (
                Target::Cluster(client),
                format!("cluster [{}]", cluster_nodes.join(", ")),
                cluster_nodes.to_vec(),
            )
        };
        for u in &sub_urls {
            Client::open(u.as_str()).map_err(bad)?;
        }
        let conn = Connection {
            target,
            current: Mutex::new(None),
            connect_lock: tokio::sync::Mutex::new(()),
            last_invalidate: Mutex::new(None),
            scripts_only: AtomicBool::new(false),
            describe,
            timeout,
        };
        Ok((conn, sub_urls))
    }

    /// The Redis target, for messages.
    pub(super) fn describe(&self) -> &str {
        &self.describe
    }

    /// The bound of one call.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Run one call of `gate.lua`, within the timeout (loading it on first use). A
    /// failure is already sorted: [`Fault::Unreachable`] (no answer in time
    /// included) or [`Fault::Rejected`].
    pub(super) async fn run(&self, call: &Call<'_>) -> Result<Vec<Value>, Fault> {
        match tokio::time::timeout(self.timeout, self.invoke(call)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(&e)),
            Err(_) => Err(Fault::Unreachable(format!(
                "no answer within {:?}",
                self.timeout
            ))),
        }
    }

    /// Run a command of the backend's own bookkeeping beside `gate.lua` (the host
    /// heartbeat), within the timeout; sorted like [`Connection::run`].
    pub(super) async fn run_cmd(&self, cmd: &Cmd) -> Result<Value, Fault> {
        let call = async {
            match &mut self.get().await? {
                Conn::Single(m) => cmd.query_async(m).await,
                Conn::Cluster(cl) => cmd.query_async(cl).await,
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(&e)),
            Err(_) => Err(Fault::Unreachable(format!(
                "no answer within {:?}",
                self.timeout
            ))),
        }
    }

    /// One call; a call that found its link dropped (`CLIENT KILL`, a proxy or
    /// server restart: broken pipe, reset, EOF — the command was not run) is sent
    /// again, once, on the reconnected link, within the same outer timeout. A
    /// timeout is never retried: that command may have run.
    async fn invoke(&self, call: &Call<'_>) -> Result<Vec<Value>, RedisError> {
        match self.invoke_once(call).await {
            Err(e) if e.is_connection_dropped() => {
                tracing::debug!(redis = %self.describe, error = %e, "redis link dropped; sending the call again");
                self.invoke_once(call).await
            }
            r => r,
        }
    }

    async fn invoke_once(&self, call: &Call<'_>) -> Result<Vec<Value>, RedisError> {
        match &mut self.get().await? {
            Conn::Single(m) => self.invoke_on(m, call).await,
            Conn::Cluster(cl) => self.invoke_on(cl, call).await,
        }
    }

    /// `FCALL`, loading the library once if the server lacks it; `EVALSHA` on a
    /// server without functions (see `script/mod.rs`, "How it runs").
    async fn invoke_on<C: ConnectionLike>(
        &self,
        con: &mut C,
        call: &Call<'_>,
    ) -> Result<Vec<Value>, RedisError> {
        if !self.scripts_only.load(Ordering::Relaxed) {
            match call.fcall().query_async(con).await {
                Err(e) if function_missing(&e) => {
                    ::redis::cmd("FUNCTION")
                        .arg("LOAD")
                        .arg("REPLACE")
                        .arg(&GATE.library)
                        .query_async::<()>(con)
                        .await?;
                    return call.fcall().query_async(con).await;
                }
                Err(e) if fcall_unknown(&e) => {
                    tracing::info!(
                        redis = %self.describe,
                        "redis has no FCALL (before 7.0): running gate.lua as a script"
                    );
                    self.scripts_only.store(true, Ordering::Relaxed);
                }
                r => return r,
            }
        }
        call.script().invoke_async(con).await
    }

    /// The current connection, made if needed.
    async fn get(&self) -> Result<Conn, RedisError> {
        if let Some(c) = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Ok(c);
        }
        let _g = self.connect_lock.lock().await;
        if let Some(c) = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Ok(c);
        }
        let c = match &self.target {
            Target::Single(client, cfg) => Conn::Single(ConnectionManager::new_lazy_with_config(
                client.clone(),
                cfg.clone(),
            )?),
            Target::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
        };
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
        Ok(c)
    }

    /// Throw the connection away after a failure (at most once per RETRY_INTERVAL), so
    /// a connection that cannot recover by itself is rebuilt on the next try.
    pub(super) fn invalidate(&self) {
        let now = Instant::now();
        let mut last = self
            .last_invalidate
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| now.duration_since(t) < RETRY_INTERVAL) {
            return;
        }
        *last = Some(now);
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// `ERR Function not found`: the server has not (or no longer) loaded our library.
fn function_missing(e: &RedisError) -> bool {
    e.detail()
        .is_some_and(|d| d.starts_with("Function not found"))
}

/// `ERR unknown command 'FCALL'`: a server before Redis 7.
fn fcall_unknown(e: &RedisError) -> bool {
    e.detail().is_some_and(|d| {
        d.to_ascii_lowercase().starts_with("unknown command") && d.contains("FCALL")
    })
}
