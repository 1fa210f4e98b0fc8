//! Where breaker (§6) and quota (§7) state lives.
//!
//! [`Backend`] is the contract both the in-process [`memory::MemoryBackend`] and the
//! shared Redis backend implement; one contract test suite (`tests/contract/`) runs
//! against each. The primitive operations (`try_enter`, `record_*`, `reserve`,
//! `settle`, …) are what the contract pins; [`Backend::admit`] and
//! [`Backend::report`] are the two combined operations the engine calls on its hot
//! path, so a remote backend can do each in **one round trip** (§10). Every backend
//! makes them atomic: the memory backend runs [`crate::gate::Gates`] under one lock,
//! Redis runs one script.
//!
//! The vocabulary (breaker and quota parameters and answers, outcomes) belongs to the
//! gates in [`crate::gate`]; it is re-exported here because it is also the trait's, so
//! a backend needs only `use crate::backend::*`.
//!
//! Methods return `impl Future + Send` rather than boxed futures so the memory
//! backend's admission path allocates nothing; the daemon picks a backend through the
//! [`AnyBackend`] enum, not a trait object.
//!
//! # Exact semantics (both backends implement exactly this)
//!
//! Breaker, per source; `now` is the backend's clock (memory: injected clock; Redis:
//! `TIME`). Fields: `state`, `epoch` (u64, starts 0), `until` (OPEN), `lease_until`
//! (HALF_OPEN; "no lease" after a release), `streak`, `k` (cooldown level),
//! `closed_since`, window buckets.
//! - **Epoch** bumps (+1) on every transition: CLOSED→OPEN, OPEN→HALF_OPEN,
//!   HALF_OPEN→CLOSED, HALF_OPEN→OPEN, and on every admin op; **also on every probe
//!   grant**, including a re-grant after an expired or released lease, so each probe
//!   has its own epoch and a vanished holder's late report is fenced. `reset` bumps it
//!   too and never rewinds it (old permits must stay fenced).
//! - `try_enter`: CLOSED → granted, not probe, epoch unchanged. OPEN and now < until →
//!   refused, retry_after = until − now. OPEN and now ≥ until → HALF_OPEN, epoch+1,
//!   lease_until = now + probe_ttl, granted as probe. HALF_OPEN with live lease
//!   (now < lease_until) → refused, retry_after 0. HALF_OPEN without live lease →
//!   epoch+1, new lease, granted as probe. Every grant reports retry_after 0.
//! - Outcome ops apply only when `epoch` equals the current epoch; otherwise they
//!   change nothing and return `applied=false`, the current state and retry_after
//!   (OPEN: until − now; else 0).
//! - `record_success`: CLOSED → streak = 0; window success+1 if `count_attempt`.
//!   HALF_OPEN → CLOSED (epoch+1), streak = 0, window cleared, closed_since = now
//!   (also with `count_attempt=false`: the upstream answered).
//! - `record_failure`: CLOSED → streak+1, window failure+1, then open if
//!   (a) samples ≥ min_calls and failures/samples ≥ failure_rate (rate channel: k+1),
//!   or (b) streak ≥ failure_threshold unless samples ≥ min_calls with rate <
//!   failure_rate (streak channel: k unchanged). HALF_OPEN → OPEN again with k+1.
//!   Opening: epoch+1, streak = 0, window cleared, until = now + open_duration.
//! - **open_duration** = min(cooldown × 2^k, max_cooldown) computed *after* k grows,
//!   so a probe-failure reopen always lasts longer than the open before it (until the
//!   cap); the first streak open lasts `cooldown`, the first rate open 2 × cooldown.
//! - **k_max**: k never exceeds the smallest level with cooldown × 2^k ≥ max_cooldown
//!   ([`BreakerParams::k_max`]): growing stops there, and every operation carrying
//!   params first clamps a stored k to it (a reload may have lowered it).
//! - **k decay**: whenever the breaker is read in CLOSED with k > 0, each whole
//!   `max_cooldown` elapsed since `closed_since` takes one off k (and moves
//!   closed_since forward by that many periods).
//! - **Idle state**: a backend may let a source's breaker state expire only once it
//!   reads as a fresh one would — CLOSED, k decayed to 0, no streak, empty window —
//!   and only after every permit it granted has outlived its lease; it then comes
//!   back as a fresh breaker (epoch 0, which no live permit carries). The memory
//!   backend never forgets; Redis keeps OPEN, HALF_OPEN and streak state without a
//!   TTL (`gate.lua`, "Expiry").
//! - `peek`: state, epoch and retry_after as they are; changes nothing.
//! - `release_probe` (and `neutral` for a probe): HALF_OPEN with matching epoch →
//!   lease cleared (state stays HALF_OPEN, epoch unchanged; the next `try_enter`
//!   grants a new probe). Anything else → `applied=false`.
//! - `neutral` for a non-probe permit: changes nothing; `applied` = epoch matches.
//! - Window: buckets of `window/2` aligned to multiples of window/2 on the backend
//!   clock; the window is the current bucket plus the previous one when it is the
//!   adjacent one. samples = successes + failures of both.
//! - `force_open(d)`: OPEN until now + d, epoch+1, k unchanged. `force_close`:
//!   CLOSED, epoch+1, streak/window cleared, closed_since = now, k unchanged.
//!   `reset`: CLOSED, epoch+1, k = 0, streak/window cleared, quota buckets full and
//!   the 429 block removed. A shared backend never serves admin operations from a
//!   local fallback: while it is unreachable they fail with `Unavailable` (an
//!   operator must not believe a change reached every host when it did not).
//!
//! Quota, per source: a token bucket (capacity `tpm`, refill tpm/60 per second) and a
//! request bucket (capacity `rpm`, refill rpm/60 per second), continuous refill,
//! starting full, absent when `None`; plus `blocked_until` from 429s.
//! - `reserve(tokens)`: needs now ≥ blocked_until, level ≥ min(tokens, capacity) in
//!   the token bucket (an estimate larger than the bucket goes through when the bucket
//!   is full, and leaves debt) and ≥ 1 in the request bucket; then both are debited.
//!   Otherwise nothing is taken and retry_after = the time until *all* of that holds
//!   (§6: the rest of the block or the longest refill, debt included, whichever is
//!   later), never zero.
//! - `settle(reserved, how)`: `Charge{tokens}` → token level += reserved − tokens
//!   (may go negative: debt). `RefundTokens` → token level += reserved. `RefundAll` →
//!   token level += reserved, request level += 1. Levels never exceed capacity, and
//!   never fall below −capacity: debt delays later admissions by at most one more
//!   minute of refill, so one absurd token count cannot lock a source for ages;
//!   and the extra debit of one settlement (`Charge` above the reservation) takes
//!   at most [`QuotaParams::max_debt`] (`max_rate_limit_block`, §12) of refill time
//!   from each bucket, per-day ones included.
//! - `block_quota(d)`: blocked_until = max(blocked_until, now + d). The engine caps
//!   `d` at `max_rate_limit_block` (§7) before it gets here.
//! - `report` settles by [`Outcome::settlement`]: success or non-transient failure
//!   (`bad_result`, `error`) → `Charge` of the reported tokens, the reservation when
//!   none were reported; transient failure or 429 → `RefundTokens`; cancelled →
//!   `RefundAll`.

pub mod any;
pub mod event;
mod ledgers;
pub mod memory;
pub mod redis;
pub use any::AnyBackend;
pub use event::{AdminEvent, AdminOp};

pub use crate::gate::breaker::{Applied, BreakerParams, Entry, Peek, State, Trip};
pub use crate::gate::classes::{ClassShares, ClassTag, Held, Share};
pub use crate::gate::observed::{Dim, LastSeen, Observation};
pub use crate::gate::quota::{
    AdmittedRate, QuotaParams, Reserve, SeenCut, Settlement, Split, Tokens,
};
pub use crate::gate::tenant::{Charge, LedgerView, TenantLimit, TenantParams};
pub use crate::gate::{
    Admit, AdmitRequest, FailureKind, Outcome, ReportRequest, TenantAdmit, TenantKey, TenantSettle,
};

use std::future::Future;
use std::time::Duration;

/// Everything known about one source, for `status`. The default is a fresh source:
/// CLOSED, epoch 0, nothing counted, no buckets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourceSnapshot {
    /// Breaker state.
    pub state: State,
    /// Breaker epoch.
    pub epoch: u64,
    /// §6 retry-after.
    pub retry_after: Duration,
    /// Cooldown level `k`.
    pub cooldown_level: u32,
    /// Window successes.
    pub window_successes: u64,
    /// Window failures.
    pub window_failures: u64,
    /// Consecutive failures.
    pub streak: u32,
    /// tpm bucket level (may be negative: debt).
    pub tokens_available: Option<f64>,
    /// rpm bucket level.
    pub requests_available: Option<f64>,
    /// §7a: every bucket's level, in [`crate::gate::quota::BUCKETS`] order (`None`:
    /// not configured); the first two are `tokens_available`, `requests_available`.
    pub levels: [Option<f64>; 6],
    /// Remaining 429 block.
    pub quota_blocked: Duration,
    /// §18: per bucket (tpm, rpm, itpm, otpm), the last observation and what the
    /// corrections removed (`None`: never observed, or the source does not observe).
    pub seen: [Option<LastSeen>; 4],
}

impl Default for SourceSnapshot {
    fn default() -> Self {
        SourceSnapshot {
            state: State::Closed,
            epoch: 0,
            retry_after: Duration::ZERO,
            cooldown_level: 0,
            window_successes: 0,
            window_failures: 0,
            streak: 0,
            tokens_available: None,
            requests_available: None,
            levels: [None; 6],
            quota_blocked: Duration::ZERO,
            seen: [None; 4],
        }
    }
}

/// §10: the share of every shared quota a degraded host uses, for status and
/// metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShareView {
    /// The share in force (1 / live hosts under `"auto"`, else the fraction).
    pub share: f64,
    /// Live hosts last seen (heartbeats; at least 1).
    pub live_hosts: u64,
    /// `degraded_share` as configured.
    pub setting: crate::config::DegradedShare,
}

/// Backend failures. The engine maps them per `on_backend_error` (§10).
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum BackendError {
    /// The shared store cannot be reached (or timed out).
    #[error("shared backend unreachable: {0}")]
    Unavailable(String),
    /// The source is not configured.
    #[error("unknown source {0:?}")]
    UnknownSource(String),
    /// The store answered something this code does not understand.
    #[error("backend protocol error: {0}")]
    Protocol(String),
}

/// Result alias for backend operations.
pub type BResult<T> = Result<T, BackendError>;

/// The breaker + quota contract (§6, §7, §10).
pub trait Backend: Send + Sync + 'static {
    /// Short name for status (`"memory"`, `"redis"`).
    fn name(&self) -> &'static str;

    /// `true` while `source` is served from local state because the shared store is
    /// unreachable (always `false` for the memory backend).
    fn degraded(&self, _source: &str) -> bool {
        false
    }

    /// §10: the share of every shared quota this host uses while degraded (`None`:
    /// not a shared backend).
    fn degraded_share(&self) -> Option<ShareView> {
        None
    }

    /// `true` when operations really wait on I/O (Redis). The engine then runs each
    /// state-changing operation in its own task so that a cancelled Acquire (its future
    /// dropped mid-round-trip) can never leave a grant half-made: the task finishes
    /// and releases what the dropped caller would have owned. `false` promises that
    /// every future completes in its first poll (the memory backend's do), so the
    /// engine runs them inline, allocation-free (`engine/detach.rs`).
    fn is_remote(&self) -> bool {
        false
    }

    // ---- breaker (§6) ----

    /// Gate 4: may a caller enter? Grants the probe in HALF_OPEN without a live lease.
    fn try_enter(
        &self,
        source: &str,
        p: &BreakerParams,
    ) -> impl Future<Output = BResult<Entry>> + Send;

    /// Record a success under `epoch`.
    fn record_success(
        &self,
        source: &str,
        epoch: u64,
        count_attempt: bool,
        p: &BreakerParams,
    ) -> impl Future<Output = BResult<Applied>> + Send;

    /// Record a failure under `epoch`.
    fn record_failure(
        &self,
        source: &str,
        epoch: u64,
        p: &BreakerParams,
    ) -> impl Future<Output = BResult<Applied>> + Send;

    /// Release the probe lease held under `epoch` (cancel, 429) without a verdict.
    fn release_probe(
        &self,
        source: &str,
        epoch: u64,
    ) -> impl Future<Output = BResult<Applied>> + Send;

    /// The breaker as it is, changing nothing: state, epoch and §6 retry-after. The
    /// engine re-checks a memo entry with it (§9, §10: a shared backend that lost its
    /// state answers an epoch lower than the one the entry was set under).
    fn peek(&self, source: &str) -> impl Future<Output = BResult<Peek>> + Send;

    /// Min over `sources` of their §6 retry-after (OPEN: until − now; else 0).
    fn retry_after(&self, sources: &[&str]) -> impl Future<Output = BResult<Duration>> + Send;

    /// Admin: OPEN for `duration` (epoch bumped).
    fn force_open(
        &self,
        source: &str,
        duration: Duration,
    ) -> impl Future<Output = BResult<Applied>> + Send;

    /// Admin: CLOSED now, streak and window cleared (epoch bumped).
    fn force_close(&self, source: &str) -> impl Future<Output = BResult<Applied>> + Send;

    /// Admin: forget breaker and quota state (epoch bumped, never rewound).
    fn reset(&self, source: &str) -> impl Future<Output = BResult<Applied>> + Send;

    // ---- quota (§7) ----

    /// Gate 3: reserve `tokens` and one request, or take nothing.
    fn reserve(
        &self,
        source: &str,
        q: &QuotaParams,
        tokens: impl Into<Tokens> + Send,
    ) -> impl Future<Output = BResult<Reserve>> + Send;

    /// Settle a reservation of `reserved_tokens`.
    fn settle(
        &self,
        source: &str,
        q: &QuotaParams,
        reserved_tokens: impl Into<Tokens> + Send,
        how: Settlement,
    ) -> impl Future<Output = BResult<()>> + Send;

    /// A 429 with retry-after: block the source's quota for `for_` (only moves forward).
    fn block_quota(&self, source: &str, for_: Duration)
        -> impl Future<Output = BResult<()>> + Send;

    // ---- status ----

    /// Everything about `source`, for status.
    fn snapshot(
        &self,
        source: &str,
        p: &BreakerParams,
        q: &QuotaParams,
    ) -> impl Future<Output = BResult<SourceSnapshot>> + Send;

    // ---- combined hot-path operations ----

    /// Gates 3 and 4 for one source, atomically: for a class, its limit and the
    /// other classes' unused reserves (§15, [`Admit::ClassHeld`]); then reserve quota
    /// and `try_enter`; a breaker refusal releases the reservation. Remote backends do
    /// this in one round trip.
    fn admit(
        &self,
        source: &str,
        r: AdmitRequest<'_>,
    ) -> impl Future<Output = BResult<Admit>> + Send;

    /// Settle the permit's reservation (and its class's usage) and feed the outcome
    /// to the breaker, atomically. Remote backends do this in one round trip.
    fn report(
        &self,
        source: &str,
        r: ReportRequest<'_>,
    ) -> impl Future<Output = BResult<Applied>> + Send;

    /// An outcome that is no verdict (429, cancel): releases the probe lease if the
    /// permit was the probe; otherwise changes nothing. `applied` says whether the
    /// permit's epoch is still current.
    fn neutral(
        &self,
        source: &str,
        epoch: u64,
        is_probe: bool,
    ) -> impl Future<Output = BResult<Applied>> + Send;

    // ---- tenants (§19) ----

    /// The tenant's ledger alone: check and take the charge, or take nothing
    /// (`Admitted` with the day charged — epoch and probe mean nothing here —,
    /// `TenantLimited`, `TenantsFull`). [`Backend::admit`] with a tenant does this and
    /// the source's gates in one step; a Redis Cluster, whose tenant key lives in
    /// another slot, runs this first and gives it back (`tenant_settle` with
    /// `Settlement::RefundAll`) when the source refuses.
    fn tenant_reserve(&self, t: TenantAdmit<'_>) -> impl Future<Output = BResult<Admit>> + Send;

    /// Settle a tenant reservation alone (an abandoned permit: the estimate kept; a
    /// Redis Cluster's report, beside the source's).
    fn tenant_settle(&self, t: TenantSettle<'_>) -> impl Future<Output = BResult<()>> + Send;

    /// The tenant's ledger for status (`None`: nothing recorded: a fresh ledger).
    fn tenant_snapshot(
        &self,
        key: TenantKey<'_>,
        p: &TenantParams,
    ) -> impl Future<Output = BResult<Option<LedgerView>>> + Send;
}
