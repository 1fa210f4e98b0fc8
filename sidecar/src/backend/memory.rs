//! In-process backend: breaker and quota state in this process, one host (§10).
//!
//! Each configured source has its own mutex-protected cell, created at start-up, so
//! operations on different sources never contend and the admission path allocates
//! nothing. The combined operations (`admit`, `report`) are the gates' own
//! compositions ([`Gates::admit`], [`Gates::report`]) run under one lock acquisition,
//! which makes them atomic like the Redis scripts.

// foldhash: these maps are keyed by our own ids and config names (nothing a peer
// inserts), and SipHash was ~1.5 % of the per-frame CPU (§16).
use foldhash::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{BResult, Backend, BackendError, SourceSnapshot};
use crate::clock::Clock;
use crate::gate::breaker::{Applied, BreakerParams, Entry, Peek};
use crate::gate::quota::{QuotaParams, Reserve, Settlement, Tokens};
use crate::gate::{Admit, AdmitRequest, Gates, ReportRequest};

/// The memory backend.
pub struct MemoryBackend {
    /// Time source (injected so tests drive it).
    clock: Arc<dyn Clock>,
    /// One cell per configured source; the map itself never changes after start-up.
    cells: HashMap<String, Mutex<Gates>>,
}

impl MemoryBackend {
    /// A backend knowing `sources` (operations on other names fail with
    /// [`BackendError::UnknownSource`]).
    pub fn new(
        clock: Arc<dyn Clock>,
        sources: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self::with_epoch_base(clock, sources, 0)
    }

    /// Like [`MemoryBackend::new`], with every breaker's epoch starting at `base`.
    /// A local fallback for a shared backend uses a large random base, so a permit
    /// granted by one can never match an epoch of the other (fencing across a
    /// degrade/restore).
    pub fn with_epoch_base(
        clock: Arc<dyn Clock>,
        sources: impl IntoIterator<Item = impl Into<String>>,
        base: u64,
    ) -> Self {
        let now = clock.now();
        let cells = sources
            .into_iter()
            .map(|s| (s.into(), Mutex::new(Gates::new(now, base))))
            .collect();
        MemoryBackend { clock, cells }
    }

    /// Forget every source's state, as a restarted process (or a shared store that
    /// lost its data) would: each breaker fresh at epoch 0, buckets full. For tests
    /// of §10's state-loss handling; nothing in the daemon calls it.
    #[doc(hidden)]
    pub fn lose_state(&self) {
        let now = self.clock.now();
        for cell in self.cells.values() {
            *cell.lock().unwrap_or_else(|e| e.into_inner()) = Gates::new(now, 0);
        }
    }

    fn with<T>(&self, source: &str, f: impl FnOnce(&mut Gates, Duration) -> T) -> BResult<T> {
        let cell = self
            .cells
            .get(source)
            .ok_or_else(|| BackendError::UnknownSource(crate::limits::echo(source).into_owned()))?;
        let mut guard = cell.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.clock.now();
        Ok(f(&mut guard, now))
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        crate::config::BackendKind::Memory.as_str()
    }

    async fn try_enter(&self, source: &str, p: &BreakerParams) -> BResult<Entry> {
        self.with(source, |c, now| c.breaker.try_enter(now, p))
    }

    async fn record_success(
        &self,
        source: &str,
        epoch: u64,
        count_attempt: bool,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        self.with(source, |c, now| {
            c.breaker.record_success(now, epoch, count_attempt, p)
        })
    }

    async fn record_failure(
        &self,
        source: &str,
        epoch: u64,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.record_failure(now, epoch, p))
    }

    async fn release_probe(&self, source: &str, epoch: u64) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.release_probe(now, epoch))
    }

    async fn peek(&self, source: &str) -> BResult<Peek> {
        self.with(source, |c, now| c.breaker.peek(now))
    }

    async fn retry_after(&self, sources: &[&str]) -> BResult<Duration> {
        let mut min: Option<Duration> = None;
        for s in sources {
            let r = self.with(s, |c, now| c.breaker.retry_after(now))?;
            min = Some(min.map_or(r, |m| m.min(r)));
        }
        Ok(min.unwrap_or(Duration::ZERO))
    }

    async fn force_open(&self, source: &str, duration: Duration) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.force_open(now, duration))
    }

    async fn force_close(&self, source: &str) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.force_close(now))
    }

    async fn reset(&self, source: &str) -> BResult<Applied> {
        self.with(source, |c, now| c.reset(now))
    }

    async fn reserve(
        &self,
        source: &str,
        q: &QuotaParams,
        tokens: impl Into<Tokens> + Send,
    ) -> BResult<Reserve> {
        self.with(source, |c, now| c.quota.reserve(q, tokens, now))
    }

    async fn settle(
        &self,
        source: &str,
        q: &QuotaParams,
        reserved_tokens: impl Into<Tokens> + Send,
        how: Settlement,
    ) -> BResult<()> {
        self.with(source, |c, now| {
            c.quota.settle(q, reserved_tokens, how, now)
        })
    }

    async fn block_quota(&self, source: &str, for_: Duration) -> BResult<()> {
        self.with(source, |c, now| c.quota.block(for_, now))
    }

    async fn snapshot(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> BResult<SourceSnapshot> {
        self.with(source, |c, now| {
            let b = c.breaker.view(now, p);
            let qv = c.quota.view(q, now);
            SourceSnapshot {
                state: b.state,
                epoch: b.epoch,
                retry_after: b.retry_after,
                cooldown_level: b.level,
                window_successes: b.successes,
                window_failures: b.failures,
                streak: b.streak,
                tokens_available: qv.tokens(),
                requests_available: qv.requests(),
                levels: qv.levels,
                quota_blocked: qv.blocked,
                seen: c.quota.seen(now),
            }
        })
    }

    async fn admit(&self, source: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        self.with(source, |c, now| c.admit(now, r))
    }

    async fn report(&self, source: &str, r: ReportRequest<'_>) -> BResult<Applied> {
        self.with(source, |c, now| c.report(now, r))
    }

    async fn neutral(&self, source: &str, epoch: u64, is_probe: bool) -> BResult<Applied> {
        self.with(source, |c, now| c.breaker.neutral(now, epoch, is_probe))
    }
}
