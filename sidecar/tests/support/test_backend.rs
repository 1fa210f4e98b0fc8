//! One programmable backend for engine and server tests: the memory backend plus
//! the knobs tests need, so no test file re-implements the whole `Backend` trait.
//! - `remote`: pose as a network backend (the engine then runs round trips in tasks
//!   of their own); with a non-zero `delay`, state-changing calls take that long
//!   (virtual time under a paused clock), so Acquires can be dropped mid-trip;
//! - `down`: fail admin operations and reports like an unreachable shared store;
//! - `rejects`: answer one source's admissions with a store error (not an outage);
//! - counters of admissions and status snapshots, and of reservations made by
//!   grants and released by settlements, kept independently of the engine's own
//!   bookkeeping.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use polygate::backend::memory::MemoryBackend;
use polygate::backend::*;

/// See the module docs.
pub struct TestBackend {
    /// Where the state really lives.
    pub inner: MemoryBackend,
    /// Claim to be remote.
    pub remote: AtomicBool,
    /// Round-trip time while remote.
    pub delay: Duration,
    /// Fail admin operations and reports with `Unavailable`.
    pub down: AtomicBool,
    /// A source whose admissions the "store" rejects.
    pub rejects: Mutex<Option<String>>,
    /// Tokens reserved by grants and not yet settled.
    pub tokens: AtomicI64,
    /// Requests reserved by grants and not yet settled.
    pub requests: AtomicI64,
    /// Admission round trips asked of the backend.
    pub admits: AtomicI64,
    /// Status snapshots asked of the backend.
    pub snapshots: AtomicI64,
}

impl TestBackend {
    /// A well-behaved backend over `inner`.
    pub fn new(inner: MemoryBackend, remote: bool, delay: Duration) -> Self {
        TestBackend {
            inner,
            remote: AtomicBool::new(remote),
            delay,
            down: AtomicBool::new(false),
            rejects: Mutex::new(None),
            tokens: AtomicI64::new(0),
            requests: AtomicI64::new(0),
            admits: AtomicI64::new(0),
            snapshots: AtomicI64::new(0),
        }
    }

    async fn trip(&self) {
        if self.remote.load(Ordering::SeqCst) && !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }

    fn check(&self) -> BResult<()> {
        if self.down.load(Ordering::SeqCst) {
            Err(BackendError::Unavailable("test: backend down".into()))
        } else {
            Ok(())
        }
    }

    fn release(&self, tokens: u64) {
        self.tokens.fetch_sub(tokens as i64, Ordering::SeqCst);
        self.requests.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Backend for TestBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn is_remote(&self) -> bool {
        self.remote.load(Ordering::SeqCst)
    }
    async fn try_enter(&self, s: &str, p: &BreakerParams) -> BResult<Entry> {
        self.inner.try_enter(s, p).await
    }
    async fn record_success(
        &self,
        s: &str,
        e: u64,
        c: bool,
        p: &BreakerParams,
    ) -> BResult<Applied> {
        self.inner.record_success(s, e, c, p).await
    }
    async fn record_failure(&self, s: &str, e: u64, p: &BreakerParams) -> BResult<Applied> {
        self.inner.record_failure(s, e, p).await
    }
    async fn release_probe(&self, s: &str, e: u64) -> BResult<Applied> {
        self.inner.release_probe(s, e).await
    }
    async fn peek(&self, s: &str) -> BResult<Peek> {
        self.inner.peek(s).await
    }
    async fn retry_after(&self, s: &[&str]) -> BResult<Duration> {
        self.inner.retry_after(s).await
    }
    async fn force_open(&self, s: &str, d: Duration) -> BResult<Applied> {
        self.check()?;
        self.inner.force_open(s, d).await
    }
    async fn force_close(&self, s: &str) -> BResult<Applied> {
        self.check()?;
        self.inner.force_close(s).await
    }
    async fn reset(&self, s: &str) -> BResult<Applied> {
        self.check()?;
        self.inner.reset(s).await
    }
    async fn reserve(
        &self,
        s: &str,
        q: &QuotaParams,
        t: impl Into<Tokens> + Send,
    ) -> BResult<Reserve> {
        self.inner.reserve(s, q, t).await
    }
    async fn settle(
        &self,
        s: &str,
        q: &QuotaParams,
        t: impl Into<Tokens> + Send,
        how: Settlement,
    ) -> BResult<()> {
        let t = t.into();
        self.trip().await;
        self.release(t.total);
        self.inner.settle(s, q, t, how).await
    }
    async fn block_quota(&self, s: &str, d: Duration) -> BResult<()> {
        self.inner.block_quota(s, d).await
    }
    async fn snapshot(
        &self,
        s: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> BResult<SourceSnapshot> {
        self.snapshots.fetch_add(1, Ordering::SeqCst);
        self.inner.snapshot(s, p, q).await
    }
    async fn admit(&self, s: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        self.trip().await;
        self.admits.fetch_add(1, Ordering::SeqCst);
        if self.rejects.lock().unwrap().as_deref() == Some(s) {
            return Err(BackendError::Protocol(format!("test: store rejected {s}")));
        }
        let a = self.inner.admit(s, r).await;
        if let Ok(Admit::Admitted { .. }) = a {
            self.tokens
                .fetch_add(r.tokens.total as i64, Ordering::SeqCst);
            self.requests.fetch_add(1, Ordering::SeqCst);
        }
        a
    }
    async fn report(&self, s: &str, r: ReportRequest<'_>) -> BResult<Applied> {
        self.trip().await;
        self.check()?;
        self.release(r.reserved.total);
        self.inner.report(s, r).await
    }
    async fn neutral(&self, s: &str, e: u64, probe: bool) -> BResult<Applied> {
        self.inner.neutral(s, e, probe).await
    }
    async fn tenant_reserve(&self, t: TenantAdmit<'_>) -> BResult<Admit> {
        self.trip().await;
        self.inner.tenant_reserve(t).await
    }
    async fn tenant_settle(&self, t: TenantSettle<'_>) -> BResult<()> {
        self.trip().await;
        self.check()?;
        self.inner.tenant_settle(t).await
    }
    async fn tenant_snapshot(
        &self,
        key: TenantKey<'_>,
        p: &polygate::gate::tenant::TenantParams,
    ) -> BResult<Option<polygate::gate::tenant::LedgerView>> {
        self.inner.tenant_snapshot(key, p).await
    }
}
