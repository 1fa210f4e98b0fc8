//! Shared backend: breaker (§6) and quota (§7) state in Redis, for many hosts (§10).
//!
//! [`RedisBackend`] implements the [`Backend`] contract with one script call per
//! operation; the pieces, in the order a call passes them:
//! - `reach`: is Redis reachable for this source, or is it served locally / refused
//!   (`on_backend_error`, one log line per transition);
//! - `ops`: the operation, a struct of named arguments that also reads its reply;
//! - `script`: `gate.lua`, its keys and ARGV slots, the values of its replies;
//! - `conn`: the connection (single node or cluster) and the timeout bounding the
//!   call;
//! - `fault`: a failure sorted into an outage (degrade / refuse) or a refusal by
//!   Redis itself ([`BackendError::Protocol`], reachability untouched);
//! - `pubsub`: the admin broadcast every host listens to (§9);
//! - `hosts`: this host's heartbeat and the live host count, which sets the share of
//!   every shared quota the local fallback uses while degraded (§10);
//! - `tenant`: the tenant ledgers' ops (§19), in the source's call on one server, in
//!   calls of their own on a Redis Cluster.
//!
//! Admin operations (`force_open`, `force_close`, `reset`) never fall back: a change
//! to local state would be invisible to every other host while this one reported
//! success. They always try Redis (even while the source is degraded) and, when it
//! cannot be reached, fail with [`BackendError::Unavailable`] ("admin operation not
//! applied: shared backend unreachable …") in both modes.

mod conn;
mod fault;
mod hosts;
mod ops;
mod pubsub;
mod reach;
mod script;
mod tenant;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use super::event::AdminEvent;
use super::memory::MemoryBackend;
use super::{
    Admit, AdmitRequest, Applied, BResult, Backend, BackendError, BreakerParams, Entry, Peek,
    QuotaParams, ReportRequest, Reserve, Settlement, ShareView, SourceSnapshot, Tokens,
};
use crate::clock::Clock;
use crate::config::{BackendKind, DegradedShare, OnBackendError};
use crate::gate::tenant::{LedgerView, TenantParams};
use crate::gate::{TenantAdmit, TenantKey, TenantSettle};
use conn::Connection;
use fault::Fault;
use hosts::Heartbeat;
pub use hosts::{hosts_key, HEARTBEAT_EVERY, HEARTBEAT_TTL};
use ops::{
    AdmitArgs, BlockArgs, ForceCloseArgs, ForceOpenArgs, NeutralArgs, PeekArgs, RecordFailureArgs,
    RecordSuccessArgs, ReleaseProbeArgs, ReportArgs, ReserveArgs, ResetArgs, SettleArgs,
    SnapshotArgs, TryEnterArgs,
};
use pubsub::AdminFeed;
pub use reach::RETRY_INTERVAL;
use reach::{Reach, Route};
use script::{Announce, Op};
use tenant::TSettleArgs;

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
    /// §10: the share of every shared quota the local fallback uses.
    pub degraded_share: DegradedShare,
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
            degraded_share: c.sidecar.degraded_share,
        }
    }
}

/// The Redis backend.
pub struct RedisBackend {
    /// The way to Redis.
    conn: Connection,
    /// Key prefix inside the hash tag.
    prefix: String,
    /// Every configured source's two keys, built once (a call borrows them).
    keys: HashMap<String, [String; 2]>,
    /// Degrade or refuse when Redis is unreachable.
    on_error: OnBackendError,
    /// Configured sources and whether Redis can be reached for each.
    reach: Reach,
    /// Served when degraded.
    local: MemoryBackend,
    /// The admin broadcast (its subscriber stops when the backend is dropped).
    admin: AdminFeed,
    /// The local fallback's clock: what a Redis answer said is remembered on it
    /// (§10, `reach::Known`).
    clock: Arc<dyn Clock>,
    /// §10: `degraded_share` as configured.
    share: DegradedShare,
    /// This host's heartbeat and the live host count (its task stops on drop).
    hosts: Heartbeat,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("target", &self.conn.describe())
            .field("prefix", &self.prefix)
            .field("timeout", &self.conn.timeout())
            .field("on_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// Build the backend. Never waits for Redis: connections are made on first use and
    /// re-made after failures, so this succeeds while Redis is down. Must be called
    /// inside a Tokio runtime (it spawns the admin subscriber).
    pub async fn connect(opts: RedisOptions, local_clock: Arc<dyn Clock>) -> BResult<Self> {
        let (conn, sub_urls) = Connection::new(&opts.url, &opts.cluster_nodes, opts.timeout)?;
        let reach = Reach::new(&opts.sources, opts.on_backend_error, conn.describe());
        let admin = AdminFeed::start(sub_urls, &opts.key_prefix, opts.timeout);
        // Its own connection: a heartbeat never queues behind (or delays) a call.
        let (beat_conn, _) = Connection::new(&opts.url, &opts.cluster_nodes, opts.timeout)?;
        let keys: HashMap<String, [String; 2]> = opts
            .sources
            .iter()
            .map(|s| (s.clone(), script::keys(&opts.key_prefix, s)))
            .collect();
        // §18: a host that stops beating has its in-flight counts dropped from every
        // quota hash this host knows (the fleet shares one configuration).
        let quota_keys = keys.values().map(|k| k[1].clone()).collect();
        let hosts = Heartbeat::start(beat_conn, &opts.key_prefix, quota_keys);
        Ok(RedisBackend {
            conn,
            keys,
            prefix: opts.key_prefix,
            on_error: opts.on_backend_error,
            reach,
            // Local epochs start far from any Redis epoch (which counts up from 0), so
            // a permit granted on one side is always fenced on the other across a
            // degrade/restore.
            local: MemoryBackend::with_epoch_base(
                local_clock.clone(),
                opts.sources,
                reach::local_epoch_base(),
            ),
            admin,
            clock: local_clock,
            share: opts.degraded_share,
            hosts,
        })
    }

    /// Admin events published by any host (this one included), for clearing memos.
    pub fn admin_events(&self) -> broadcast::Receiver<AdminEvent> {
        self.admin.events()
    }

    /// `true` while the admin subscriber holds a live subscription.
    pub fn admin_subscribed(&self) -> bool {
        self.admin.subscribed()
    }

    /// The breaker key of `source`.
    pub fn breaker_key(&self, source: &str) -> String {
        script::breaker_key(&self.prefix, source)
    }

    /// The quota key of `source`.
    pub fn quota_key(&self, source: &str) -> String {
        script::quota_key(&self.prefix, source)
    }

    /// The admin pub/sub channel.
    pub fn admin_channel(&self) -> &str {
        self.admin.channel()
    }

    /// §19 (tests): `gate.lua`'s calendar for day number `day` (UTC days since
    /// 1970-01-01): its month (months since 1970-01) and the µs at which the month
    /// ends, so a test can hold the script's calendar to `gate::tenant`'s.
    #[doc(hidden)]
    pub async fn tenant_calendar(&self, day: u32) -> BResult<(u32, u64)> {
        let p = TenantParams::default();
        let op = tenant::TCalArgs { params: &p, day };
        self.exec_tenant(
            &self.tenant_key(TenantKey {
                scope: "",
                tenant: "",
            }),
            op,
        )
        .await?
        .ok_or_else(|| BackendError::Unavailable("redis unreachable".into()))
    }

    /// Stop this host's heartbeat (it no longer counts once its TTL passes). For
    /// tests that count every command Redis runs; nothing in the daemon calls it.
    #[doc(hidden)]
    pub fn stop_heartbeat(&self) {
        self.hosts.stop();
    }

    /// §10: the share of every shared quota the local fallback uses now.
    fn local_share(&self) -> f64 {
        self.share.of(self.hosts.live_hosts())
    }

    /// `q` as the local fallback applies it: every limit cut to this host's share.
    fn local_q(&self, q: &QuotaParams) -> QuotaParams {
        q.share(self.local_share())
    }

    /// Run one script operation for `source`. `Ok(Some(reply))` when Redis answered,
    /// `Ok(None)` when the caller must serve the operation from local state.
    async fn exec<O: Op>(&self, source: &str, op: O) -> BResult<Option<O::Reply>> {
        self.exec_as(source, op, false).await
    }

    /// [`exec`](Self::exec); `admin` calls never fall back to local state and never
    /// take the degraded shortcut: they always ask Redis, and fail with
    /// [`BackendError::Unavailable`] when it cannot be reached.
    async fn exec_as<O: Op>(&self, source: &str, op: O, admin: bool) -> BResult<Option<O::Reply>> {
        self.exec_on(source, None, op, admin).await
    }

    /// [`exec_as`](Self::exec_as) with the call's tenant ledger `tenant` as the
    /// script's third key (§19, one server).
    async fn exec_on<O: Op>(
        &self,
        source: &str,
        tenant: Option<&str>,
        op: O,
        admin: bool,
    ) -> BResult<Option<O::Reply>> {
        if let Route::Local = self.reach.route(source, admin)? {
            return Ok(None);
        }
        let built;
        let keys = match self.keys.get(source) {
            Some(k) => k,
            None => {
                built = script::keys(&self.prefix, source);
                &built
            }
        };
        let mut inv = match tenant {
            Some(t) => script::invocation_with(keys, t, &op),
            None => script::invocation(keys, &op),
        };
        script::with_host(&mut inv.args, self.hosts.id());
        match self.conn.run(&inv).await {
            Ok(v) => {
                let reply = O::read(&v)?;
                self.reach
                    .answered(source, op.seen(&reply), op.factor(&v), self.clock.now());
                Ok(Some(reply))
            }
            // Redis answered: not a reachability problem, so neither degrade nor
            // retry; the caller gets the server's message.
            Err(Fault::Rejected(msg)) => Err(BackendError::Protocol(format!(
                "redis {} rejected `{}` for source {source:?}: {msg}",
                self.conn.describe(),
                O::NAME
            ))),
            Err(Fault::Unreachable(msg)) => {
                // §10: the local fallback starts from what this host knew, not blank
                // (a source last seen OPEN stays refused).
                self.reach.unreachable(source, &msg, |known| {
                    if self.on_error == OnBackendError::Local {
                        // A configured source (reach knows it): its cell exists.
                        let _ = self.local.seed(source, known.seed(self.clock.now()));
                    }
                });
                self.conn.invalidate();
                if admin {
                    return Err(self.reach.admin_not_applied(&msg));
                }
                self.reach.after_outage(&msg).map(|()| None)
            }
        }
    }

    /// An admin op: on Redis or not at all (never on local state, which no other host
    /// would see), in both `on_backend_error` modes.
    async fn admin<O: Op<Reply = Applied>>(&self, source: &str, op: O) -> BResult<Applied> {
        match self.exec_as(source, op, true).await? {
            Some(a) => Ok(a),
            None => Err(BackendError::Protocol(
                "admin operation served locally (internal error)".into(),
            )),
        }
    }

    /// Where an admin operation on `source` is announced.
    fn announce<'a>(&'a self, source: &'a str) -> Announce<'a> {
        Announce {
            channel: self.admin.channel(),
            source,
        }
    }
}

// ------------------------------------------------------------------ the contract

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        BackendKind::Redis.as_str()
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn degraded(&self, source: &str) -> bool {
        self.reach.degraded(source)
    }

    fn degraded_share(&self) -> Option<ShareView> {
        Some(ShareView {
            share: self.local_share(),
            live_hosts: self.hosts.live_hosts(),
            setting: self.share,
        })
    }

    async fn try_enter(&self, source: &str, p: &BreakerParams) -> BResult<Entry> {
        match self.exec(source, TryEnterArgs { p }).await? {
            Some(e) => Ok(e),
            None => self.local.try_enter_no_probe(source, p).await,
        }
    }

    async fn record_success(
        &self,
        source: &str,
        epoch: u64,
        count_attempt: bool,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        let op = RecordSuccessArgs {
            p,
            epoch,
            count_attempt,
        };
        match self.exec(source, op).await? {
            Some(a) => Ok(a),
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
        match self.exec(source, RecordFailureArgs { p, epoch }).await? {
            Some(a) => Ok(a),
            None => self.local.record_failure(source, epoch, p).await,
        }
    }

    async fn release_probe(&self, source: &str, epoch: u64) -> BResult<Applied> {
        match self.exec(source, ReleaseProbeArgs { epoch }).await? {
            Some(a) => Ok(a),
            None => self.local.release_probe(source, epoch).await,
        }
    }

    async fn peek(&self, source: &str) -> BResult<Peek> {
        match self.exec(source, PeekArgs).await? {
            Some(p) => Ok(p),
            None => self.local.peek(source).await,
        }
    }

    async fn retry_after(&self, sources: &[&str]) -> BResult<Duration> {
        let each = futures_util::future::join_all(
            sources
                .iter()
                .map(|s| async move { self.peek(s).await.map(|p| p.retry_after) }),
        )
        .await;
        let mut min: Option<Duration> = None;
        for r in each {
            let r = r?;
            min = Some(min.map_or(r, |m| m.min(r)));
        }
        Ok(min.unwrap_or(Duration::ZERO))
    }

    async fn force_open(&self, source: &str, duration: Duration) -> BResult<Applied> {
        let op = ForceOpenArgs {
            open_for: duration,
            announce: self.announce(source),
        };
        self.admin(source, op).await
    }

    async fn force_close(&self, source: &str) -> BResult<Applied> {
        let op = ForceCloseArgs {
            announce: self.announce(source),
        };
        self.admin(source, op).await
    }

    async fn reset(&self, source: &str) -> BResult<Applied> {
        let op = ResetArgs {
            announce: self.announce(source),
        };
        self.admin(source, op).await
    }

    async fn reserve(
        &self,
        source: &str,
        q: &QuotaParams,
        tokens: impl Into<Tokens> + Send,
    ) -> BResult<Reserve> {
        let tokens = tokens.into();
        match self.exec(source, ReserveArgs { q, tokens }).await? {
            Some(r) => Ok(r),
            None => self.local.reserve(source, &self.local_q(q), tokens).await,
        }
    }

    async fn settle(
        &self,
        source: &str,
        q: &QuotaParams,
        reserved_tokens: impl Into<Tokens> + Send,
        how: Settlement,
    ) -> BResult<()> {
        let reserved_tokens = reserved_tokens.into();
        let op = SettleArgs {
            q,
            reserved: reserved_tokens,
            how,
        };
        match self.exec(source, op).await? {
            Some(()) => Ok(()),
            None => {
                let q = self.local_q(q);
                self.local.settle(source, &q, reserved_tokens, how).await
            }
        }
    }

    async fn block_quota(&self, source: &str, for_: Duration) -> BResult<()> {
        match self.exec(source, BlockArgs { block: for_ }).await? {
            Some(()) => Ok(()),
            None => self.local.block_quota(source, for_).await,
        }
    }

    async fn snapshot(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> BResult<SourceSnapshot> {
        match self.exec(source, SnapshotArgs { p, q }).await? {
            Some(s) => Ok(s),
            None => self.local.snapshot(source, p, &self.local_q(q)).await,
        }
    }

    async fn admit(&self, source: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        if let Some(t) = r.tenant.filter(|_| self.conn.is_cluster()) {
            return self.admit_two_step(source, t, r).await;
        }
        let key = r.tenant.map(|t| self.tenant_key(t.key));
        let op = AdmitArgs {
            p: r.p,
            q: r.q,
            tokens: r.tokens,
            class: r.class,
            tenant: r.tenant,
        };
        match self.exec_on(source, key.as_deref(), op, false).await? {
            Some(a) => Ok(a),
            None => self.admit_locally(source, r).await,
        }
    }

    async fn report(&self, source: &str, r: ReportRequest<'_>) -> BResult<Applied> {
        let cluster = self.conn.is_cluster();
        let key = r.tenant.map(|t| self.tenant_key(t.key));
        // §18: a permit's cut is dated on the clock of the ledger that admitted it (a
        // Redis epoch: Redis's; a local one: this host's), so a report that crosses
        // to the other ledger carries it as not comparable.
        let local = reach::is_local_epoch(r.epoch);
        let crossing = |to_local: bool| {
            r.admitted
                .map(|a| if local == to_local { a } else { a.foreign() })
        };
        let op = ReportArgs {
            p: r.p,
            q: r.q,
            epoch: r.epoch,
            is_probe: r.is_probe,
            reserved: r.reserved,
            outcome: r.outcome,
            class: r.class,
            observed: r.observed,
            tenant: r.tenant.filter(|_| !cluster),
            admitted: crossing(false),
        };
        // A Redis Cluster settles the tenant beside the source, both sent at once.
        let (answer, tenant) = match (cluster, r.tenant, key.as_deref()) {
            (true, Some(t), Some(k)) => {
                let (a, s) = tokio::join!(
                    self.exec(source, op),
                    self.exec_tenant(k, TSettleArgs { t })
                );
                (a, Some(s))
            }
            _ => (self.exec_on(source, key.as_deref(), op, false).await, None),
        };
        // The local fallback's tenant limits (this host's share), made only when the
        // local fallback serves the tenant.
        match answer? {
            Some(a) => {
                if let (Some(Ok(None)), Some(t)) = (tenant, r.tenant) {
                    let p = self.local_tenant(t.params);
                    self.local
                        .tenant_settle(TenantSettle { params: &p, ..t })
                        .await?;
                }
                Ok(a)
            }
            None => {
                let q = self.local_q(r.q);
                let local_tenant = r.tenant.map(|t| self.local_tenant(t.params));
                let tenant = r
                    .tenant
                    .zip(local_tenant.as_ref())
                    .map(|(t, params)| TenantSettle { params, ..t });
                let admitted = crossing(true);
                self.local
                    .report(
                        source,
                        ReportRequest {
                            q: &q,
                            tenant,
                            admitted,
                            ..r
                        },
                    )
                    .await
            }
        }
    }

    async fn neutral(&self, source: &str, epoch: u64, is_probe: bool) -> BResult<Applied> {
        match self.exec(source, NeutralArgs { epoch, is_probe }).await? {
            Some(a) => Ok(a),
            None => self.local.neutral(source, epoch, is_probe).await,
        }
    }

    async fn tenant_reserve(&self, t: TenantAdmit<'_>) -> BResult<Admit> {
        self.reserve_tenant(t).await
    }

    async fn tenant_settle(&self, t: TenantSettle<'_>) -> BResult<()> {
        self.settle_tenant(t).await
    }

    async fn tenant_snapshot(
        &self,
        key: TenantKey<'_>,
        p: &TenantParams,
    ) -> BResult<Option<LedgerView>> {
        self.snapshot_tenant(key, p).await
    }
}
