//! Shared backend: breaker (§6) and quota (§7) state in Redis, for many hosts (§10).
//!
//! # Scripts and keys
//!
//! Every operation is one call of one Lua script (`gate.lua`, dispatching on its first
//! argument) through [`::redis::Script`], i.e. `EVALSHA` with an automatic `SCRIPT
//! LOAD` + retry on `NOSCRIPT` (after a Redis restart or `SCRIPT FLUSH`). The combined
//! hot-path operations are one script call each: [`Backend::admit`] = reserve +
//! try_enter (a breaker refusal takes nothing), [`Backend::report`] = settle + verdict
//! (+ the 429 block). Every clock reading inside a script is `redis.call('TIME')`
//! (never a host clock; Redis ≥ 5 replicates effects, so TIME followed by writes is
//! fine). Durations cross as integer microseconds.
//!
//! A source has two keys, both passed with `.key()` and hash-tagged into one slot so
//! Redis Cluster routes the script by its first key: `{<prefix>:<source>}:b` (breaker
//! hash) and `{<prefix>:<source>}:q` (quota hash).
//!
//! # Expiry and the epoch
//!
//! Idle sources vanish. The quota hash expires once it would read as absent anyway
//! (both buckets refilled, the 429 block over, plus a minute); since levels never fall
//! below −capacity and a 429 block is capped at 7 days (the engine already refuses
//! more than a day), that TTL is bounded whatever token count is reported. The breaker
//! hash — which holds the epoch — gets a TTL of `max(4 × max(window, max_cooldown,
//! 60 s), 4 × probe_ttl)` plus any remaining OPEN period or probe lease, **refreshed by
//! every script that touches the source**, reads included (peek, snapshot, a
//! quota-refused admit). That basis is stored in the hash, so operations that carry no
//! breaker params (neutral, release_probe, admin ops) keep it. A permit is granted by
//! such a script and lives at most its lease (probe_ttl; the engine reclaims it after
//! that), so the epoch cannot expire, and hence cannot rewind, while a permit that
//! carries it may still report. `reset` bumps the epoch in place (it never deletes the
//! breaker hash).
//!
//! Arguments cross as integer strings (durations in µs capped at 2^52, counts at
//! 2^53, so the script's double arithmetic is exact), and the script formats every
//! number it hands to a Redis command itself (never Lua's `1e+15`-style conversion).
//!
//! # Degradation (§10)
//!
//! Every Redis call is bounded by `timeout` (connect and response; plus an outer
//! `tokio::time::timeout` over the whole operation, NOSCRIPT reload included). Only
//! *reachability* failures count ([`classify`]): I/O errors, timeouts, refused or
//! reset connections, and transient server states (`LOADING`, `BUSY`, `TRYAGAIN`,
//! `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`, `NOREPLICAS`, `OOM`). Any other error
//! reply (a script runtime error, `ERR …`, `WRONGTYPE`, `NOPERM`) means Redis answered
//! and retrying will not help: it is returned as [`BackendError::Protocol`] with the
//! server's message, in both modes, and the source's reachability is left alone. When
//! a call fails or times out:
//! - `on_backend_error = local`: the operation is served by an embedded
//!   [`MemoryBackend`], the source is marked degraded ([`Backend::degraded`]) and one
//!   line is logged per transition. While degraded, Redis is retried at most once per
//!   [`RETRY_INTERVAL`] per source (the other calls go straight to local state), so a
//!   dead Redis does not cost a timeout per admission; the first answer restores the
//!   source (logged once). Local and Redis state are not merged: the local breakers'
//!   epochs start at a random base ≥ 2^62 (Redis epochs count up from 0), so a permit
//!   granted on one side is always fenced on the other across a degrade/restore; its
//!   quota settlement is still applied to the buckets it lands on (clamped).
//! - `fail_closed`: [`BackendError::Unavailable`] naming the Redis target; within
//!   [`RETRY_INTERVAL`] of a failure the error is returned at once, without waiting
//!   for another timeout.
//!
//! Admin operations (`force_open`, `force_close`, `reset`) never fall back: a change
//! to local state would be invisible to every other host while this one reported
//! success. They always try Redis (even while the source is degraded) and, when it
//! cannot be reached, fail with [`BackendError::Unavailable`] ("admin operation not
//! applied: shared backend unreachable …") in both modes.
//!
//! # Admin broadcast (§9)
//!
//! `force_open`, `force_close` and `reset` publish `"<op> <source>"` on
//! `<prefix>:admin` from inside their script. A subscriber task (reconnecting, pinging)
//! turns those messages into [`AdminEvent`]s on [`RedisBackend::admin_events`], so
//! every host can clear its cooldown memo. Messages published while a host's
//! subscriber is disconnected are lost for that host (pub/sub has no replay).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, RedisError, Script, Value};
use futures_util::StreamExt;
use tokio::sync::broadcast;

use super::memory::MemoryBackend;
use super::{
    Admit, Applied, BResult, Backend, BackendError, BreakerParams, Entry, Outcome, QuotaParams,
    Reserve, Settlement, SourceSnapshot, State,
};
use crate::clock::Clock;
use crate::config::OnBackendError;

/// While a source is degraded, Redis is retried at most this often for it.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Capacity of the admin event channel (a lagging receiver loses the oldest events).
const ADMIN_CHANNEL_CAPACITY: usize = 256;

/// How often the subscriber pings its connection to detect a silent death.
const SUBSCRIBER_PING: Duration = Duration::from_secs(5);

/// The one script; every operation dispatches on its first argument.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("gate.lua")));

/// How to reach Redis and what to do when it cannot be reached.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisOptions {
    /// Single node (`redis://host:port/db`); used when `cluster_nodes` is empty.
    pub url: String,
    /// Redis Cluster seed nodes; non-empty selects cluster mode.
    pub cluster_nodes: Vec<String>,
    /// Key prefix inside the hash tag (`{prefix:source}`), also names the admin channel.
    pub key_prefix: String,
    /// Connect and per-command response timeout; no operation waits on Redis longer.
    pub timeout: Duration,
    /// Degrade to local state or refuse when Redis is unreachable.
    pub on_backend_error: OnBackendError,
    /// Configured sources (others fail with [`BackendError::UnknownSource`]).
    pub sources: Vec<String>,
}

impl RedisOptions {
    /// Options from the `[sidecar]` section (§12a) and every source of every scope
    /// (deduplicated: a source in two scopes is one breaker and one quota).
    pub fn from_config(c: &crate::config::Config) -> Self {
        let mut sources: Vec<String> = Vec::new();
        for s in c.scopes.iter().flat_map(|sc| sc.sources.iter()) {
            if !sources.contains(&s.name) {
                sources.push(s.name.clone());
            }
        }
        RedisOptions {
            url: c.sidecar.redis_url.clone(),
            cluster_nodes: c.sidecar.redis_cluster_nodes.clone(),
            key_prefix: c.sidecar.key_prefix.clone(),
            timeout: c.sidecar.redis_timeout,
            on_backend_error: c.sidecar.on_backend_error,
            sources,
        }
    }
}

/// An operator action broadcast to every host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminEvent {
    /// The source acted on.
    pub source: String,
    /// What was done.
    pub op: AdminOp,
}

/// Admin operations that are broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOp {
    /// `force_open`.
    ForceOpen,
    /// `force_close`.
    ForceClose,
    /// `reset`.
    Reset,
}

impl AdminOp {
    fn wire(self) -> &'static str {
        match self {
            AdminOp::ForceOpen => "force_open",
            AdminOp::ForceClose => "force_close",
            AdminOp::Reset => "reset",
        }
    }

    fn from_wire(s: &str) -> Option<Self> {
        match s {
            "force_open" => Some(AdminOp::ForceOpen),
            "force_close" => Some(AdminOp::ForceClose),
            "reset" => Some(AdminOp::Reset),
            _ => None,
        }
    }
}

impl AdminEvent {
    /// Parse a `"<op> <source>"` payload.
    fn parse(payload: &str) -> Option<Self> {
        let (op, source) = payload.split_once(' ')?;
        Some(AdminEvent {
            source: source.to_string(),
            op: AdminOp::from_wire(op)?,
        })
    }
}

/// A live connection (both kinds are cheap to clone and multiplex).
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// How to (re)build a connection.
enum Target {
    Single(Client, ConnectionManagerConfig),
    Cluster(::redis::cluster::ClusterClient),
}

/// Per-source reachability.
#[derive(Debug)]
struct Health {
    /// The last Redis call for this source failed.
    down: bool,
    /// While down: when Redis may be tried again.
    next_try: Instant,
    /// While down: the last error, for fail_closed's fast refusals.
    last_error: String,
}

/// The Redis backend.
pub struct RedisBackend {
    /// How connections are made.
    target: Target,
    /// The current connection (`None` until first use or after an invalidation).
    conn: Mutex<Option<Conn>>,
    /// Serialises (re)connecting in cluster mode.
    connect_lock: tokio::sync::Mutex<()>,
    /// When the connection was last thrown away (at most once per RETRY_INTERVAL).
    last_invalidate: Mutex<Option<Instant>>,
    /// Human-readable target for error messages (`redis://…` or the cluster seeds).
    describe: String,
    prefix: String,
    timeout: Duration,
    on_error: OnBackendError,
    /// Configured sources and their reachability.
    health: HashMap<String, Mutex<Health>>,
    /// Served when degraded.
    local: MemoryBackend,
    /// Admin channel name (`<prefix>:admin`).
    channel: String,
    admin_tx: broadcast::Sender<AdminEvent>,
    /// `true` while the subscriber holds a live subscription.
    subscribed: Arc<std::sync::atomic::AtomicBool>,
    /// The subscriber task, stopped on drop.
    subscriber: tokio::task::AbortHandle,
}

impl Drop for RedisBackend {
    fn drop(&mut self) {
        self.subscriber.abort();
    }
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("target", &self.describe)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("on_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

/// Arguments of one script call (see the header of `gate.lua`).
#[derive(Default)]
pub(crate) struct Call<'a> {
    op: &'static str,
    p: Option<&'a BreakerParams>,
    q: Option<&'a QuotaParams>,
    epoch: u64,
    flag: bool,
    tokens: u64,
    kind: &'static str,
    amount: Option<Duration>,
    amount_raw: Option<u64>,
    probe: bool,
}

/// Largest duration handed to the script, in µs (2^52 µs ≈ 142 years): `TIME` + it
/// stays below 2^53, so every sum the script makes is an exact integer in a double.
const MAX_ARG_MICROS: u64 = 1 << 52;

/// Largest token count / bucket capacity handed to the script (exact in a double).
const MAX_ARG_COUNT: u64 = 1 << 53;

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).map_or(MAX_ARG_MICROS, |m| m.min(MAX_ARG_MICROS))
}

fn count(n: u64) -> u64 {
    n.min(MAX_ARG_COUNT)
}

fn bucket(v: Option<u64>) -> i64 {
    v.map_or(-1, |x| count(x) as i64)
}

/// How a failed script call is treated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Redis cannot serve us right now (I/O, timeout, connection refused/reset, a
    /// transient server state): the source degrades (`local`) or refuses
    /// (`fail_closed`), and Redis is retried later.
    Unreachable(String),
    /// Redis answered with an error that retrying will not fix (a script runtime
    /// error, `ERR …`, `WRONGTYPE`, `NOPERM`, …): reported as
    /// [`BackendError::Protocol`], the source's reachability is untouched.
    Rejected(String),
}

/// Error codes of transient server states: the server is there but cannot serve now.
const TRANSIENT_CODES: [&str; 8] = [
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "NOREPLICAS",
    "OOM",
];

/// Epoch base of the local fallback: at least 2^62, random below that, so no local
/// epoch is ever reached by a Redis breaker (which counts up from 0) and two hosts'
/// (or two runs') local epochs differ too.
fn local_epoch_base() -> u64 {
    (1u64 << 62) | (rand::random::<u64>() >> 3)
}

/// Sort a Redis error into [`Fault::Unreachable`] or [`Fault::Rejected`].
pub(crate) fn classify(e: &RedisError) -> Fault {
    use ::redis::ErrorKind as K;
    // A server reply verbatim (`ERR value is not an integer …`), else the client's text.
    let msg = match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => e.to_string(),
    };
    let transient_code = e
        .code()
        .is_some_and(|c| TRANSIENT_CODES.iter().any(|t| c.eq_ignore_ascii_case(t)))
        || nested_transient(&msg);
    match e.kind() {
        K::Server(_) | K::Extension if transient_code => Fault::Unreachable(msg),
        // Redirects the cluster client could not follow: topology in flux.
        K::Server(::redis::ServerErrorKind::Moved | ::redis::ServerErrorKind::Ask) => {
            Fault::Unreachable(msg)
        }
        K::Server(_) | K::Extension | K::Parse | K::UnexpectedReturnType => Fault::Rejected(msg),
        // I/O, connection refused/reset/dropped, no connection to a cluster node,
        // authentication, client-side connection trouble.
        _ => Fault::Unreachable(msg),
    }
}

/// Redis 5/6 wrap an error raised inside a script as `ERR Error running script …:
/// -READONLY You can't write …` (7.x keeps the code): look for a transient code after
/// the `-` so a failover still counts as an outage there too.
fn nested_transient(msg: &str) -> bool {
    msg.contains("Error running script")
        && TRANSIENT_CODES
            .iter()
            .any(|t| msg.contains(&format!("-{t} ")) || msg.contains(&format!("-{t}:")))
}

/// `ARGV` of one script call, in `gate.lua`'s order. Every numeric argument is an
/// integer string (durations in µs capped at [`MAX_ARG_MICROS`], counts at
/// [`MAX_ARG_COUNT`]) except `failure_rate`, the one fraction.
fn script_args(channel: &str, source: &str, c: &Call<'_>) -> [String; 18] {
    let (fth, frate, minc, win, cd, mcd, pttl) = match c.p {
        Some(p) => (
            p.failure_threshold,
            p.failure_rate,
            p.min_calls,
            micros(p.window),
            micros(p.cooldown),
            micros(p.max_cooldown),
            micros(p.probe_ttl),
        ),
        None => (0, 0.0, 0, 0, 0, 0, 0),
    };
    let (tpm, rpm) = c.q.map_or((-1, -1), |q| (bucket(q.tpm), bucket(q.rpm)));
    let amount: i64 = match (c.amount, c.amount_raw) {
        (Some(d), _) => micros(d) as i64,
        (None, Some(n)) => count(n) as i64,
        (None, None) => -1,
    };
    // A NaN or infinite rate would not parse as a Lua number; configs never hold one.
    let frate = if frate.is_finite() { frate } else { 1.0 };
    [
        c.op.to_string(),
        fth.to_string(),
        frate.to_string(),
        minc.to_string(),
        win.to_string(),
        cd.to_string(),
        mcd.to_string(),
        pttl.to_string(),
        tpm.to_string(),
        rpm.to_string(),
        c.epoch.to_string(),
        u8::from(c.flag).to_string(),
        count(c.tokens).to_string(),
        c.kind.to_string(),
        amount.to_string(),
        channel.to_string(),
        source.to_string(),
        u8::from(c.probe).to_string(),
    ]
}

impl RedisBackend {
    /// Build the backend. Never waits for Redis: connections are made on first use and
    /// re-made after failures, so this succeeds while Redis is down. Must be called
    /// inside a Tokio runtime (it spawns the admin subscriber).
    pub async fn connect(opts: RedisOptions, local_clock: Arc<dyn Clock>) -> BResult<Self> {
        let bad =
            |e: RedisError| BackendError::Unavailable(format!("invalid redis configuration: {e}"));
        let (target, describe, sub_urls) = if opts.cluster_nodes.is_empty() {
            let client = Client::open(opts.url.as_str()).map_err(bad)?;
            let cfg = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(opts.timeout))
                .set_response_timeout(Some(opts.timeout))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(50))
                .set_max_delay(Duration::from_millis(500));
            (
                Target::Single(client, cfg),
                opts.url.clone(),
                vec![opts.url.clone()],
            )
        } else {
            let client = ClusterClientBuilder::new(opts.cluster_nodes.clone())
                .connection_timeout(opts.timeout)
                .response_timeout(opts.timeout)
                .retries(1)
                .build()
                .map_err(bad)?;
            (
                Target::Cluster(client),
                format!("cluster [{}]", opts.cluster_nodes.join(", ")),
                opts.cluster_nodes.clone(),
            )
        };
        for u in &sub_urls {
            Client::open(u.as_str()).map_err(bad)?;
        }
        let now = Instant::now();
        let health = opts
            .sources
            .iter()
            .map(|s| {
                (
                    s.clone(),
                    Mutex::new(Health {
                        down: false,
                        next_try: now,
                        last_error: String::new(),
                    }),
                )
            })
            .collect();
        let channel = format!("{}:admin", opts.key_prefix);
        let (admin_tx, _) = broadcast::channel(ADMIN_CHANNEL_CAPACITY);
        let subscribed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let subscriber = tokio::spawn(subscriber(
            sub_urls,
            channel.clone(),
            admin_tx.clone(),
            opts.timeout,
            subscribed.clone(),
        ))
        .abort_handle();
        Ok(RedisBackend {
            target,
            conn: Mutex::new(None),
            connect_lock: tokio::sync::Mutex::new(()),
            last_invalidate: Mutex::new(None),
            describe,
            prefix: opts.key_prefix,
            timeout: opts.timeout,
            on_error: opts.on_backend_error,
            health,
            // Local epochs start far from any Redis epoch (which counts up from 0), so
            // a permit granted on one side is always fenced on the other across a
            // degrade/restore.
            local: MemoryBackend::with_epoch_base(local_clock, opts.sources, local_epoch_base()),
            channel,
            admin_tx,
            subscribed,
            subscriber,
        })
    }

    /// Admin events published by any host (this one included), for clearing memos.
    pub fn admin_events(&self) -> broadcast::Receiver<AdminEvent> {
        self.admin_tx.subscribe()
    }

    /// `true` while the admin subscriber holds a live subscription.
    pub fn admin_subscribed(&self) -> bool {
        self.subscribed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The breaker key of `source`.
    pub fn breaker_key(&self, source: &str) -> String {
        format!("{{{}:{}}}:b", self.prefix, source)
    }

    /// The quota key of `source`.
    pub fn quota_key(&self, source: &str) -> String {
        format!("{{{}:{}}}:q", self.prefix, source)
    }

    /// The admin pub/sub channel.
    pub fn admin_channel(&self) -> &str {
        &self.channel
    }

    /// The current connection, made if needed.
    async fn conn(&self) -> Result<Conn, RedisError> {
        if let Some(c) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(c);
        }
        let _g = self.connect_lock.lock().await;
        if let Some(c) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(c);
        }
        let c = match &self.target {
            Target::Single(client, cfg) => Conn::Single(ConnectionManager::new_lazy_with_config(
                client.clone(),
                cfg.clone(),
            )?),
            Target::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
        };
        *self.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
        Ok(c)
    }

    /// Throw the connection away after a failure (at most once per RETRY_INTERVAL), so
    /// a connection that cannot recover by itself is rebuilt on the next try.
    fn invalidate(&self) {
        let now = Instant::now();
        let mut last = self
            .last_invalidate
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| now.duration_since(t) < RETRY_INTERVAL) {
            return;
        }
        *last = Some(now);
        *self.conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    async fn invoke(&self, source: &str, c: &Call<'_>) -> Result<Vec<Value>, RedisError> {
        let mut conn = self.conn().await?;
        let mut inv = SCRIPT.prepare_invoke();
        inv.key(self.breaker_key(source))
            .key(self.quota_key(source));
        for a in script_args(&self.channel, source, c) {
            inv.arg(a);
        }
        match &mut conn {
            Conn::Single(m) => inv.invoke_async(m).await,
            Conn::Cluster(cl) => inv.invoke_async(cl).await,
        }
    }

    /// Run one script call for `source`. `Ok(Some(reply))` when Redis answered,
    /// `Ok(None)` when the caller must serve the operation from local state.
    async fn exec(&self, source: &str, c: Call<'_>) -> BResult<Option<Vec<Value>>> {
        self.exec_as(source, c, false).await
    }

    /// [`exec`](Self::exec); `admin` calls never fall back to local state and never
    /// take the degraded shortcut: they always ask Redis, and fail with
    /// [`BackendError::Unavailable`] when it cannot be reached.
    async fn exec_as(&self, source: &str, c: Call<'_>, admin: bool) -> BResult<Option<Vec<Value>>> {
        let h = self
            .health
            .get(source)
            .ok_or_else(|| BackendError::UnknownSource(source.to_string()))?;
        if !admin {
            let mut g = h.lock().unwrap_or_else(|e| e.into_inner());
            if g.down {
                let now = Instant::now();
                if now < g.next_try {
                    return match self.on_error {
                        OnBackendError::Local => Ok(None),
                        OnBackendError::FailClosed => Err(self.unavailable(&g.last_error)),
                    };
                }
                // This caller probes; the others keep going local until next_try.
                g.next_try = now + RETRY_INTERVAL;
            }
        }
        let result = match tokio::time::timeout(self.timeout, self.invoke(source, &c)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => match classify(&e) {
                Fault::Unreachable(msg) => Err(msg),
                // Redis answered: not a reachability problem, so neither degrade nor
                // retry; the caller gets the server's message.
                Fault::Rejected(msg) => {
                    return Err(BackendError::Protocol(format!(
                        "redis {} rejected `{}` for source {source:?}: {msg}",
                        self.describe, c.op
                    )))
                }
            },
            Err(_) => Err(format!("no answer within {:?}", self.timeout)),
        };
        let mut g = h.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(v) => {
                if g.down {
                    g.down = false;
                    g.last_error.clear();
                    match self.on_error {
                        OnBackendError::Local => tracing::info!(
                            source,
                            redis = %self.describe,
                            "redis reachable again; source served from redis"
                        ),
                        OnBackendError::FailClosed => tracing::info!(
                            source,
                            redis = %self.describe,
                            "redis reachable again; source admitting"
                        ),
                    }
                }
                Ok(Some(v))
            }
            Err(msg) => {
                let was_down = g.down;
                g.down = true;
                g.next_try = Instant::now() + RETRY_INTERVAL;
                g.last_error = msg;
                drop(g);
                self.invalidate();
                let g = h.lock().unwrap_or_else(|e| e.into_inner());
                if !was_down {
                    match self.on_error {
                        OnBackendError::Local => tracing::warn!(
                            source,
                            redis = %self.describe,
                            error = %g.last_error,
                            "redis unreachable; source degraded to local state"
                        ),
                        OnBackendError::FailClosed => tracing::warn!(
                            source,
                            redis = %self.describe,
                            error = %g.last_error,
                            "redis unreachable; source refused (fail_closed)"
                        ),
                    }
                }
                if admin {
                    return Err(BackendError::Unavailable(format!(
                        "admin operation not applied: shared backend unreachable (redis {}: {}); \
                         a local change would be invisible to every other host, so nothing \
                         was changed; retry once redis is back",
                        self.describe, g.last_error
                    )));
                }
                match self.on_error {
                    OnBackendError::Local => Ok(None),
                    OnBackendError::FailClosed => Err(self.unavailable(&g.last_error)),
                }
            }
        }
    }

    fn unavailable(&self, why: &str) -> BackendError {
        BackendError::Unavailable(format!(
            "redis backend {} unreachable: {why} (on_backend_error = fail_closed)",
            self.describe
        ))
    }

    /// An admin op: on Redis or not at all (never on local state, which no other host
    /// would see), in both `on_backend_error` modes.
    async fn admin(&self, source: &str, op: AdminOp, d: Option<Duration>) -> BResult<Applied> {
        let call = Call {
            op: op.wire(),
            amount: d,
            ..Call::default()
        };
        match self.exec_as(source, call, true).await? {
            Some(v) => parse_applied(&v),
            None => Err(BackendError::Protocol(
                "admin operation served locally (internal error)".into(),
            )),
        }
    }
}

// ------------------------------------------------------------------ reply parsing

fn proto(what: &str, v: &[Value]) -> BackendError {
    BackendError::Protocol(format!("unexpected script reply ({what}): {v:?}"))
}

fn int_at(v: &[Value], i: usize) -> BResult<i64> {
    match v.get(i) {
        Some(Value::Int(n)) => Ok(*n),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(|f| f as i64)
            .ok_or_else(|| proto("integer", v)),
        _ => Err(proto("integer", v)),
    }
}

fn u64_at(v: &[Value], i: usize) -> BResult<u64> {
    Ok(int_at(v, i)?.max(0) as u64)
}

fn dur_at(v: &[Value], i: usize) -> BResult<Duration> {
    Ok(Duration::from_micros(u64_at(v, i)?))
}

fn bool_at(v: &[Value], i: usize) -> BResult<bool> {
    Ok(int_at(v, i)? != 0)
}

fn state_at(v: &[Value], i: usize) -> BResult<State> {
    match int_at(v, i)? {
        0 => Ok(State::Closed),
        1 => Ok(State::Open),
        2 => Ok(State::HalfOpen),
        _ => Err(proto("state", v)),
    }
}

fn level_at(v: &[Value], i: usize) -> BResult<Option<f64>> {
    match v.get(i) {
        Some(Value::BulkString(b)) if b.is_empty() => Ok(None),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(Some)
            .ok_or_else(|| proto("level", v)),
        Some(Value::Int(n)) => Ok(Some(*n as f64)),
        _ => Err(proto("level", v)),
    }
}

fn parse_applied(v: &[Value]) -> BResult<Applied> {
    Ok(Applied {
        applied: bool_at(v, 0)?,
        state: state_at(v, 1)?,
        epoch: u64_at(v, 2)?,
        retry_after: dur_at(v, 3)?,
    })
}

fn parse_entry(v: &[Value]) -> BResult<Entry> {
    Ok(Entry {
        granted: bool_at(v, 0)?,
        is_probe: bool_at(v, 1)?,
        epoch: u64_at(v, 2)?,
        state: state_at(v, 3)?,
        retry_after: dur_at(v, 4)?,
    })
}

fn settlement_kind(how: Settlement) -> (&'static str, Option<u64>) {
    match how {
        Settlement::Charge { tokens } => ("charge", Some(tokens)),
        Settlement::RefundTokens => ("refund_tokens", None),
        Settlement::RefundAll => ("refund_all", None),
    }
}

// ------------------------------------------------------------------ the contract

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn degraded(&self, source: &str) -> bool {
        self.on_error == OnBackendError::Local
            && self
                .health
                .get(source)
                .is_some_and(|h| h.lock().unwrap_or_else(|e| e.into_inner()).down)
    }

    async fn try_enter(&self, source: &str, p: &BreakerParams) -> BResult<Entry> {
        let call = Call {
            op: "try_enter",
            p: Some(p),
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => parse_entry(&v),
            None => self.local.try_enter(source, p).await,
        }
    }

    async fn record_success(
        &self,
        source: &str,
        epoch: u64,
        count_attempt: bool,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        let call = Call {
            op: "record_success",
            p: Some(p),
            epoch,
            flag: count_attempt,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => parse_applied(&v),
            None => {
                self.local
                    .record_success(source, epoch, count_attempt, p)
                    .await
            }
        }
    }

    async fn record_failure(
        &self,
        source: &str,
        epoch: u64,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        let call = Call {
            op: "record_failure",
            p: Some(p),
            epoch,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => parse_applied(&v),
            None => self.local.record_failure(source, epoch, p).await,
        }
    }

    async fn release_probe(&self, source: &str, epoch: u64) -> BResult<Applied> {
        let call = Call {
            op: "release_probe",
            epoch,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => parse_applied(&v),
            None => self.local.release_probe(source, epoch).await,
        }
    }

    async fn retry_after(&self, sources: &[&str]) -> BResult<Duration> {
        let each = futures_util::future::join_all(sources.iter().map(|s| async move {
            let call = Call {
                op: "peek",
                ..Call::default()
            };
            match self.exec(s, call).await? {
                Some(v) => dur_at(&v, 0),
                None => self.local.retry_after(&[s]).await,
            }
        }))
        .await;
        let mut min: Option<Duration> = None;
        for r in each {
            let r = r?;
            min = Some(min.map_or(r, |m| m.min(r)));
        }
        Ok(min.unwrap_or(Duration::ZERO))
    }

    async fn force_open(&self, source: &str, duration: Duration) -> BResult<Applied> {
        self.admin(source, AdminOp::ForceOpen, Some(duration)).await
    }

    async fn force_close(&self, source: &str) -> BResult<Applied> {
        self.admin(source, AdminOp::ForceClose, None).await
    }

    async fn reset(&self, source: &str) -> BResult<Applied> {
        self.admin(source, AdminOp::Reset, None).await
    }

    async fn reserve(&self, source: &str, q: &QuotaParams, tokens: u64) -> BResult<Reserve> {
        let call = Call {
            op: "reserve",
            q: Some(q),
            tokens,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => Ok(if bool_at(&v, 0)? {
                Reserve::Reserved
            } else {
                Reserve::Denied {
                    retry_after: dur_at(&v, 1)?,
                }
            }),
            None => self.local.reserve(source, q, tokens).await,
        }
    }

    async fn settle(
        &self,
        source: &str,
        q: &QuotaParams,
        reserved_tokens: u64,
        how: Settlement,
    ) -> BResult<()> {
        let (kind, charged) = settlement_kind(how);
        let call = Call {
            op: "settle",
            q: Some(q),
            tokens: reserved_tokens,
            kind,
            amount_raw: charged,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(_) => Ok(()),
            None => self.local.settle(source, q, reserved_tokens, how).await,
        }
    }

    async fn block_quota(&self, source: &str, for_: Duration) -> BResult<()> {
        let call = Call {
            op: "block",
            amount: Some(for_),
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(_) => Ok(()),
            None => self.local.block_quota(source, for_).await,
        }
    }

    async fn snapshot(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> BResult<SourceSnapshot> {
        let call = Call {
            op: "snapshot",
            p: Some(p),
            q: Some(q),
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => Ok(SourceSnapshot {
                state: state_at(&v, 0)?,
                epoch: u64_at(&v, 1)?,
                retry_after: dur_at(&v, 2)?,
                cooldown_level: u32::try_from(u64_at(&v, 3)?).unwrap_or(u32::MAX),
                window_successes: u64_at(&v, 4)?,
                window_failures: u64_at(&v, 5)?,
                streak: u32::try_from(u64_at(&v, 6)?).unwrap_or(u32::MAX),
                tokens_available: level_at(&v, 7)?,
                requests_available: level_at(&v, 8)?,
                quota_blocked: dur_at(&v, 9)?,
            }),
            None => self.local.snapshot(source, p, q).await,
        }
    }

    async fn admit(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
        tokens: u64,
    ) -> BResult<Admit> {
        let call = Call {
            op: "admit",
            p: Some(p),
            q: Some(q),
            tokens,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => match int_at(&v, 0)? {
                0 => Ok(Admit::Granted {
                    epoch: u64_at(&v, 1)?,
                    is_probe: bool_at(&v, 2)?,
                }),
                1 => Ok(Admit::RateLimited {
                    retry_after: dur_at(&v, 4)?,
                }),
                2 => Ok(Admit::CircuitOpen {
                    state: state_at(&v, 3)?,
                    retry_after: dur_at(&v, 4)?,
                }),
                _ => Err(proto("admit", &v)),
            },
            None => self.local.admit(source, p, q, tokens).await,
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn report(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
        epoch: u64,
        is_probe: bool,
        reserved_tokens: u64,
        outcome: Outcome,
    ) -> BResult<Applied> {
        let (kind, flag, amount, amount_raw) = match outcome {
            Outcome::Success {
                tokens,
                count_attempt,
            } => ("S", count_attempt, None, tokens),
            Outcome::Failure(_) => ("F", false, None, None),
            Outcome::RateLimited { retry_after } => ("R", false, retry_after, None),
            Outcome::Cancelled => ("C", false, None, None),
        };
        let call = Call {
            op: "report",
            p: Some(p),
            q: Some(q),
            epoch,
            flag,
            tokens: reserved_tokens,
            kind,
            amount,
            amount_raw,
            probe: is_probe,
        };
        match self.exec(source, call).await? {
            Some(v) => parse_applied(&v),
            None => {
                self.local
                    .report(source, p, q, epoch, is_probe, reserved_tokens, outcome)
                    .await
            }
        }
    }

    async fn neutral(&self, source: &str, epoch: u64, is_probe: bool) -> BResult<Applied> {
        let call = Call {
            op: "neutral",
            epoch,
            flag: is_probe,
            ..Call::default()
        };
        match self.exec(source, call).await? {
            Some(v) => parse_applied(&v),
            None => self.local.neutral(source, epoch, is_probe).await,
        }
    }
}

// ------------------------------------------------------------------ admin subscriber

/// Keep one subscription to the admin channel alive (rotating over `urls` on
/// failure), forwarding every parsable message to `tx`.
async fn subscriber(
    urls: Vec<String>,
    channel: String,
    tx: broadcast::Sender<AdminEvent>,
    timeout: Duration,
    subscribed: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut i = 0usize;
    // Log once per transition, not per reconnect attempt.
    let mut failing = false;
    loop {
        let url = &urls[i % urls.len()];
        i = i.wrapping_add(1);
        let err = subscribe_once(url, &channel, &tx, timeout, &subscribed).await;
        let was_live = subscribed.swap(false, std::sync::atomic::Ordering::SeqCst);
        if was_live {
            failing = false;
            tracing::warn!(redis = %url, channel = %channel, error = %err,
                "admin subscription lost; reconnecting");
        } else if !failing {
            failing = true;
            tracing::warn!(redis = %url, channel = %channel, error = %err,
                "admin subscription unavailable; retrying");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One subscription, until it fails (it never ends otherwise). Returns why it ended.
async fn subscribe_once(
    url: &str,
    channel: &str,
    tx: &broadcast::Sender<AdminEvent>,
    timeout: Duration,
    subscribed: &std::sync::atomic::AtomicBool,
) -> String {
    match subscribe_inner(url, channel, tx, timeout, subscribed).await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

async fn subscribe_inner(
    url: &str,
    channel: &str,
    tx: &broadcast::Sender<AdminEvent>,
    timeout: Duration,
    subscribed: &std::sync::atomic::AtomicBool,
) -> Result<std::convert::Infallible, String> {
    let client = Client::open(url).map_err(|e| e.to_string())?;
    let ps = tokio::time::timeout(timeout, client.get_async_pubsub())
        .await
        .map_err(|_| format!("connect timed out after {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    let (mut sink, mut stream) = ps.split();
    tokio::time::timeout(timeout, sink.subscribe(channel))
        .await
        .map_err(|_| format!("subscribe timed out after {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    subscribed.store(true, std::sync::atomic::Ordering::SeqCst);
    tracing::debug!(redis = %url, channel, "admin subscription established");
    let mut ping = tokio::time::interval(SUBSCRIBER_PING);
    ping.tick().await;
    loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(msg) = msg else {
                    return Err("subscription connection closed".into());
                };
                let payload = String::from_utf8_lossy(msg.get_payload_bytes()).into_owned();
                match AdminEvent::parse(&payload) {
                    Some(ev) => {
                        let _ = tx.send(ev);
                    }
                    None => tracing::debug!(payload, "ignoring unknown admin message"),
                }
            }
            _ = ping.tick() => {
                tokio::time::timeout(timeout, sink.ping::<Value>())
                    .await
                    .map_err(|_| format!("ping timed out after {timeout:?}"))?
                    .map_err(|e| e.to_string())?;
            }
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn transient_codes_wrapped_by_older_redis_script_errors_are_outages() {
        assert!(super::nested_transient(
            "ERR Error running script (call to f_abc): @user_script:12: -READONLY You can't write against a read only replica."
        ));
        assert!(super::nested_transient(
            "ERR Error running script (call to f_abc): @user_script:3: -OOM command not allowed"
        ));
        assert!(!super::nested_transient(
            "ERR Error running script (call to f_abc): @user_script:3: -WRONGTYPE Operation against a key"
        ));
        assert!(!super::nested_transient(
            "READONLY plain reply handled by its code"
        ));
    }

    use super::*;

    #[test]
    fn admin_payload_round_trip() {
        for op in [AdminOp::ForceOpen, AdminOp::ForceClose, AdminOp::Reset] {
            let ev = AdminEvent::parse(&format!("{} my source", op.wire())).unwrap();
            assert_eq!(
                ev,
                AdminEvent {
                    source: "my source".into(),
                    op
                }
            );
        }
        assert!(AdminEvent::parse("bogus x").is_none());
        assert!(AdminEvent::parse("reset").is_none());
    }

    /// A server error reply as the client would surface it.
    fn server_error(reply: &str) -> RedisError {
        ::redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .expect("parsable error reply")
            .extract_error()
            .expect_err("an error reply")
    }

    #[test]
    fn script_and_command_errors_are_rejections_not_outages() {
        for reply in [
            "ERR user_script:1: Script attempted to access nonexistent global variable 'x'",
            "ERR value is not an integer or out of range script: abc, on @user_script:256.",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "NOPERM this user has no permissions to run the 'evalsha' command",
            "CROSSSLOT Keys in request don't hash to the same slot",
            "polygate: unknown op bogus",
        ] {
            let e = server_error(reply);
            assert!(
                classify(&e) == Fault::Rejected(reply.to_string()),
                "{reply}: {:?}",
                classify(&e)
            );
        }
        let e = RedisError::from((::redis::ErrorKind::Parse, "bad reply"));
        assert!(matches!(classify(&e), Fault::Rejected(_)));
    }

    #[test]
    fn transport_and_transient_errors_are_outages() {
        for reply in [
            "LOADING Redis is loading the dataset in memory",
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "READONLY You can't write against a read only replica.",
            "NOREPLICAS Not enough good replicas to write.",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            let e = server_error(reply);
            assert!(
                matches!(classify(&e), Fault::Unreachable(_)),
                "{reply}: {:?}",
                classify(&e)
            );
        }
        for kind in [
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let e = RedisError::from(std::io::Error::from(kind));
            assert!(matches!(classify(&e), Fault::Unreachable(_)), "{kind:?}");
        }
        let e = RedisError::from((::redis::ErrorKind::ClusterConnectionNotFound, "no node"));
        assert!(matches!(classify(&e), Fault::Unreachable(_)));
    }

    #[test]
    fn numeric_script_arguments_are_integer_strings() {
        let p = BreakerParams {
            failure_threshold: u32::MAX,
            failure_rate: 0.25,
            min_calls: 7,
            window: Duration::MAX,
            cooldown: Duration::from_nanos(1_500),
            max_cooldown: Duration::from_secs(u64::MAX / 1_000),
            probe_ttl: Duration::from_millis(150),
        };
        let q = QuotaParams {
            tpm: Some(u64::MAX),
            rpm: None,
        };
        let calls = [
            Call {
                op: "report",
                p: Some(&p),
                q: Some(&q),
                epoch: u64::MAX,
                flag: true,
                tokens: u64::MAX,
                kind: "S",
                amount_raw: Some(u64::MAX),
                probe: true,
                ..Call::default()
            },
            Call {
                op: "force_open",
                amount: Some(Duration::MAX),
                ..Call::default()
            },
        ];
        for c in &calls {
            let a = script_args("chan", "src", c);
            assert_eq!(a[0], c.op);
            assert_eq!(a[2], if c.p.is_some() { "0.25" } else { "0" });
            for (i, v) in a.iter().enumerate() {
                if [0, 2, 13, 15, 16].contains(&i) {
                    continue; // op, failure_rate, kind, channel, source
                }
                let n: i128 = v
                    .parse()
                    .unwrap_or_else(|_| panic!("ARGV[{}] = {v:?} is not an integer", i + 1));
                // Epochs are compared, not computed with; everything else stays exact
                // in a double.
                if i != 10 {
                    assert!(n.abs() <= 1 << 53, "ARGV[{}] = {v} too large", i + 1);
                }
            }
        }
        let a = script_args("chan", "src", &calls[0]);
        assert_eq!(a[4], (1u64 << 52).to_string(), "window capped");
        assert_eq!(a[5], "1", "sub-µs part dropped");
        assert_eq!(a[8], (1u64 << 53).to_string(), "tpm capped");
        assert_eq!(a[9], "-1", "rpm disabled");
        assert_eq!(a[12], (1u64 << 53).to_string(), "tokens capped");
        assert_eq!(a[14], (1u64 << 53).to_string(), "charged tokens capped");
        let a = script_args("chan", "src", &calls[1]);
        assert_eq!(
            a[14],
            (1u64 << 52).to_string(),
            "force_open duration capped"
        );
        assert_eq!(a[12], "0");
    }

    #[test]
    fn local_epoch_base_is_far_from_redis_epochs() {
        for _ in 0..100 {
            let b = local_epoch_base();
            assert!((1 << 62..(1 << 62) + (1 << 61)).contains(&b), "{b}");
        }
        assert_ne!(local_epoch_base(), local_epoch_base());
    }
}
