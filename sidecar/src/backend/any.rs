//! [`AnyBackend`]: the daemon's choice of backend, by configuration, without a trait
//! object (the [`Backend`] methods return `impl Future`, which is not object safe).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

use super::event::AdminEvent;
use super::memory::MemoryBackend;
use super::redis::{RedisBackend, RedisOptions};
use super::{BResult, Backend, SourceSnapshot};
use crate::clock::Clock;
use crate::config::BackendKind;
use crate::gate::breaker::{Applied, BreakerParams, Entry, Peek};
use crate::gate::quota::{QuotaParams, Reserve, Settlement, Tokens};
use crate::gate::tenant::{LedgerView, TenantParams};
use crate::gate::{Admit, AdmitRequest, ReportRequest, TenantAdmit, TenantKey, TenantSettle};

/// Either backend; every [`Backend`] method delegates.
// One per process, built once and never moved on a hot path: the size gap between the
// variants costs nothing, and boxing would add an indirection to every call.
#[allow(clippy::large_enum_variant)]
pub enum AnyBackend {
    /// In-process (one host).
    Memory(MemoryBackend),
    /// Shared through Redis (many hosts).
    Redis(RedisBackend),
}

impl AnyBackend {
    /// The backend `config.sidecar.backend` names, knowing every configured source.
    /// Never waits for Redis (it connects lazily), so start-up succeeds while Redis is
    /// down. Must run inside a Tokio runtime.
    pub async fn from_config(
        config: &crate::config::Config,
        clock: Arc<dyn Clock>,
    ) -> BResult<Self> {
        let opts = RedisOptions::from_config(config);
        Ok(match config.sidecar.backend {
            BackendKind::Memory => AnyBackend::Memory(MemoryBackend::new(clock, opts.sources)),
            BackendKind::Redis => AnyBackend::Redis(RedisBackend::connect(opts, clock).await?),
        })
    }

    /// Admin events broadcast by other hosts (Redis only; `None` for memory, where
    /// there are no other hosts).
    pub fn admin_events(&self) -> Option<broadcast::Receiver<AdminEvent>> {
        match self {
            AnyBackend::Memory(_) => None,
            AnyBackend::Redis(r) => Some(r.admin_events()),
        }
    }
}

impl std::fmt::Debug for AnyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AnyBackend::Memory(_) => f.write_str("AnyBackend::Memory"),
            AnyBackend::Redis(r) => f.debug_tuple("AnyBackend::Redis").field(r).finish(),
        }
    }
}

impl From<MemoryBackend> for AnyBackend {
    fn from(b: MemoryBackend) -> Self {
        AnyBackend::Memory(b)
    }
}

impl From<RedisBackend> for AnyBackend {
    fn from(b: RedisBackend) -> Self {
        AnyBackend::Redis(b)
    }
}

macro_rules! delegate {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Memory($b) => $e,
            AnyBackend::Redis($b) => $e,
        }
    };
}

/// An async method: the Redis future is boxed, because an `async fn` over the enum
/// otherwise holds the largest variant's future inline — the Redis round trip's
/// (client, retry and fault state) — and every engine future above it (a whole
/// call's, boxed per request) carried those kilobytes on the memory backend too,
/// where they are never used (§16: ~3 KB copied per request). One allocation per
/// Redis round trip is noise next to the round trip.
macro_rules! delegate_async {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Memory($b) => $e.await,
            AnyBackend::Redis($b) => Box::pin($e).await,
        }
    };
}

impl Backend for AnyBackend {
    fn name(&self) -> &'static str {
        delegate!(self, b => b.name())
    }

    fn degraded(&self, source: &str) -> bool {
        delegate!(self, b => b.degraded(source))
    }

    fn degraded_share(&self) -> Option<super::ShareView> {
        delegate!(self, b => b.degraded_share())
    }

    fn is_remote(&self) -> bool {
        delegate!(self, b => b.is_remote())
    }

    async fn try_enter(&self, source: &str, p: &BreakerParams) -> BResult<Entry> {
        delegate_async!(self, b => b.try_enter(source, p))
    }

    async fn record_success(
        &self,
        source: &str,
        epoch: u64,
        count_attempt: bool,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        delegate_async!(self, b => b.record_success(source, epoch, count_attempt, p))
    }

    async fn record_failure(
        &self,
        source: &str,
        epoch: u64,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        delegate_async!(self, b => b.record_failure(source, epoch, p))
    }

    async fn release_probe(&self, source: &str, epoch: u64) -> BResult<Applied> {
        delegate_async!(self, b => b.release_probe(source, epoch))
    }

    async fn peek(&self, source: &str) -> BResult<Peek> {
        delegate_async!(self, b => b.peek(source))
    }

    async fn retry_after(&self, sources: &[&str]) -> BResult<Duration> {
        delegate_async!(self, b => b.retry_after(sources))
    }

    async fn force_open(&self, source: &str, duration: Duration) -> BResult<Applied> {
        delegate_async!(self, b => b.force_open(source, duration))
    }

    async fn force_close(&self, source: &str) -> BResult<Applied> {
        delegate_async!(self, b => b.force_close(source))
    }

    async fn reset(&self, source: &str) -> BResult<Applied> {
        delegate_async!(self, b => b.reset(source))
    }

    async fn reserve(
        &self,
        source: &str,
        q: &QuotaParams,
        tokens: impl Into<Tokens> + Send,
    ) -> BResult<Reserve> {
        delegate_async!(self, b => b.reserve(source, q, tokens))
    }

    async fn settle(
        &self,
        source: &str,
        q: &QuotaParams,
        reserved_tokens: impl Into<Tokens> + Send,
        how: Settlement,
    ) -> BResult<()> {
        delegate_async!(self, b => b.settle(source, q, reserved_tokens, how))
    }

    async fn block_quota(&self, source: &str, for_: Duration) -> BResult<()> {
        delegate_async!(self, b => b.block_quota(source, for_))
    }

    async fn snapshot(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> BResult<SourceSnapshot> {
        delegate_async!(self, b => b.snapshot(source, p, q))
    }

    async fn admit(&self, source: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        delegate_async!(self, b => b.admit(source, r))
    }

    async fn report(&self, source: &str, r: ReportRequest<'_>) -> BResult<Applied> {
        delegate_async!(self, b => b.report(source, r))
    }

    async fn neutral(&self, source: &str, epoch: u64, is_probe: bool) -> BResult<Applied> {
        delegate_async!(self, b => b.neutral(source, epoch, is_probe))
    }

    async fn tenant_reserve(&self, t: TenantAdmit<'_>) -> BResult<Admit> {
        delegate_async!(self, b => b.tenant_reserve(t))
    }

    async fn tenant_settle(&self, t: TenantSettle<'_>) -> BResult<()> {
        delegate_async!(self, b => b.tenant_settle(t))
    }

    async fn tenant_snapshot(
        &self,
        key: TenantKey<'_>,
        p: &TenantParams,
    ) -> BResult<Option<LedgerView>> {
        delegate_async!(self, b => b.tenant_snapshot(key, p))
    }
}
