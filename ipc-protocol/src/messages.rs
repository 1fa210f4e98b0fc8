//! Every message that crosses the socket.
//!
//! These types *are* the wire format: their field order and variant order define the
//! bytes (bincode legacy layout, see [`crate::codec`] and `bindings/PROTOCOL.md`).
//! **Never reorder fields or variants, never insert a variant in the middle**: append
//! new variants at the end and bump [`crate::PROTOCOL_VERSION`] for anything else.
//!
//! Version 2 (DESIGN §11a) only appended: requests `Start`, `Retry`, `Finish`,
//! `Begin`, `StatusJson` (tags 11–15), outcomes `SuccessUsage`, `FailureUsage` (4–5),
//! replies `Started`, `StatusJson` (8–9), error kind `Overloaded` (15), and the
//! structs [`CallSpec`] and [`Usage`] they carry; then (DESIGN §18) requests
//! `ReportObserved`, `RetryObserved`, `FinishObserved` (tags 16–18) with the
//! structs [`ObservedLimits`] and [`ObservedLimit`]. Version 3 (DESIGN §19, tenants)
//! appended requests `StartTenant`, `BeginTenant`, `TenantStatus` (tags 19–21), the
//! outcome `SuccessCached` (6), the reply `TenantLimited` (10) with its struct
//! [`TenantRefusal`], error kind `TenantLimited` (16) and skip reason `TenantLimited`
//! (4). Every version-1 and version-2 frame keeps its bytes;
//! [`Request::min_version`] / [`Outcome::min_version`] say which version a message
//! needs.
//!
//! A client sends [`ClientFrame`]s; the sidecar answers each with a [`ServerFrame`]
//! carrying the same `id`. The first frame of a connection must be
//! [`Request::Hello`].

use serde::{Deserialize, Deserializer, Serialize};

/// Decodes a hot-path `String` field (a scope or source name, in every call's
/// frames) from the `&str` the decoder borrows from the payload, copied once.
/// serde's own `String` goes through bincode's `Vec<u8>` decode, which allocates
/// zeroed memory (`calloc`: glibc serves it outside its thread cache, ~300
/// instructions per frame under callgrind) and then copies into it. Same bytes on
/// the wire; a payload that is not UTF-8 is refused as before. (The sidecar's
/// decoder reads a call's frames by hand, `crate::fast`; this serves serde's
/// decoder: a client decoding `Granted` / `Started`, and every frame the fast path
/// leaves to serde.)
fn owned_str<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    struct Str;
    impl serde::de::Visitor<'_> for Str {
        type Value = String;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
            Ok(v.to_owned())
        }
        fn visit_string<E: serde::de::Error>(self, v: String) -> Result<String, E> {
            Ok(v)
        }
        // As serde's own `String` does, for formats that hand strings over as bytes.
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<String, E> {
            std::str::from_utf8(v)
                .map(str::to_owned)
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Bytes(v), &self))
        }
    }
    d.deserialize_str(Str)
}

/// One frame from a client to the sidecar.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientFrame {
    /// Client-chosen request id, echoed by the reply, so one connection can carry
    /// many concurrent requests (an asyncio worker multiplexes all its calls).
    pub id: u64,
    /// What the client asks for.
    pub request: Request,
}

/// One frame from the sidecar to a client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerFrame {
    /// The id of the request this answers; 0 when the request could not be decoded
    /// far enough to know its id.
    pub id: u64,
    /// The answer.
    pub reply: Reply,
}

/// Requests, in wire-tag order (tag = position, starting at 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Tag 0. Must be the first frame of a connection.
    Hello {
        /// The protocol version the client speaks; must equal the sidecar's.
        protocol_version: u32,
        /// Free-form client name for logs (`"polygate-python/0.1"`).
        client_name: String,
        /// The client's process id, for logs and status.
        pid: u32,
    },
    /// Tag 1. Start a call in `scope`; the stall clock starts now.
    BeginCall {
        /// Scope name from the configuration.
        #[serde(deserialize_with = "owned_str")]
        scope: String,
        /// Estimated tokens for each attempt; `None` takes the source's default (§7).
        est_tokens: Option<u64>,
    },
    /// Tag 2. Ask for a permit for the call; may block (wait mode) on the sidecar.
    Acquire {
        /// Call id from `CallBegun`.
        call: u64,
    },
    /// Tag 3. Report the outcome of the attempt made under `permit`.
    Report {
        /// Permit id from `Granted`.
        permit: u64,
        /// What happened upstream.
        outcome: Outcome,
    },
    /// Tag 4. Forget the call; releases anything it still holds.
    EndCall {
        /// Call id from `CallBegun`.
        call: u64,
    },
    /// Tag 5. Live state of every scope and source.
    Status,
    /// Tag 6. Admin: open the source's breaker for `seconds`.
    ForceOpen {
        /// Source name.
        source: String,
        /// How long it stays open, in seconds (> 0).
        seconds: f64,
    },
    /// Tag 7. Admin: close the source's breaker now (and clear every host's memo).
    ForceClose {
        /// Source name.
        source: String,
    },
    /// Tag 8. Admin: forget all breaker and quota state of the source.
    Reset {
        /// Source name.
        source: String,
    },
    /// Tag 9. Liveness check; answered with `Pong`.
    Ping,
    /// Tag 10. Cancel the still-pending request `target` (normally an `Acquire`
    /// waiting on the sidecar). The cancelled request is answered with an error of
    /// kind `Cancelled`; this request itself is answered with `Ok`, whether or not
    /// `target` was still pending.
    Cancel {
        /// The id of the request to cancel.
        target: u64,
    },
    /// Tag 11 (v2). `BeginCall` + `Acquire` in one frame, answered with `Started`.
    /// An error reply means no call exists: there is nothing to end.
    Start(CallSpec),
    /// Tag 12 (v2). `Report` the attempt made under `permit`, then `Acquire` the next
    /// permit of the same call, answered with `Granted`. Refused like `Report`
    /// (`UnknownPermit`, `InvalidArgument`: nothing changed); any later error ends
    /// the call.
    Retry {
        /// Permit id from `Started` / `Granted`.
        permit: u64,
        /// What happened upstream.
        outcome: Outcome,
    },
    /// Tag 13 (v2). `Report` the attempt made under `permit`, then `EndCall` its call;
    /// answered with `Reported`. Refused like `Report` (nothing changed); otherwise
    /// the call is gone whatever the reply.
    Finish {
        /// Permit id from `Started` / `Granted`.
        permit: u64,
        /// What happened upstream.
        outcome: Outcome,
    },
    /// Tag 14 (v2). `BeginCall` with the version-2 fields (priority, split
    /// estimates); answered with `CallBegun`.
    Begin(CallSpec),
    /// Tag 15 (v2). Live state as one JSON document, answered with `StatusJson`
    /// (extensible without a layout change; `bindings/PROTOCOL.md` §14 pins its keys).
    StatusJson,
    /// Tag 16 (v2, DESIGN §18). `Report` with the provider's rate-limit headers
    /// (observed limits) of the attempt's response; answered like `Report`.
    ReportObserved {
        /// Permit id from `Granted` / `Started`.
        permit: u64,
        /// What happened upstream.
        outcome: Outcome,
        /// What the provider said is left.
        limits: ObservedLimits,
    },
    /// Tag 17 (v2, §18). `Retry` with observed limits; answered like `Retry`.
    RetryObserved {
        /// Permit id from `Started` / `Granted`.
        permit: u64,
        /// What happened upstream.
        outcome: Outcome,
        /// What the provider said is left.
        limits: ObservedLimits,
    },
    /// Tag 18 (v2, §18). `Finish` with observed limits; answered like `Finish`.
    FinishObserved {
        /// Permit id from `Started` / `Granted`.
        permit: u64,
        /// What happened upstream.
        outcome: Outcome,
        /// What the provider said is left.
        limits: ObservedLimits,
    },
    /// Tag 19 (v3, DESIGN §19). `Start` on behalf of a tenant: the call is charged to
    /// `tenant`'s ledger as well as the source's, and waits its tenant's fair turn.
    StartTenant {
        /// The call, as in `Start`.
        spec: CallSpec,
        /// The tenant id: 1 to 128 bytes of UTF-8 (an empty one is the anonymous
        /// tenant, as a plain `Start`).
        #[serde(deserialize_with = "owned_str")]
        tenant: String,
    },
    /// Tag 20 (v3, §19). `Begin` on behalf of a tenant; answered with `CallBegun`.
    BeginTenant {
        /// The call, as in `Begin`.
        spec: CallSpec,
        /// The tenant id, as in `StartTenant`.
        #[serde(deserialize_with = "owned_str")]
        tenant: String,
    },
    /// Tag 21 (v3, §19). One tenant's ledger (buckets, spend, waiters, in flight) in
    /// every scope that has tenants, or in `scope` only; answered with `StatusJson`.
    TenantStatus {
        /// Only this scope (`None`: every scope with tenants).
        scope: Option<String>,
        /// The tenant id (empty: the anonymous tenant).
        tenant: String,
    },
}

/// One dimension of a provider's rate-limit headers (§18): each part optional, since
/// providers send different subsets (Azure only `remaining`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ObservedLimit {
    /// The provider's limit for this dimension (`x-ratelimit-limit-*`); learned by
    /// an `"auto"` bucket.
    pub limit: Option<u64>,
    /// What is left (`x-ratelimit-remaining-*`).
    pub remaining: Option<u64>,
    /// Seconds from the response until this counter is whole again
    /// (`x-ratelimit-reset-*`).
    pub reset_s: Option<f64>,
}

/// The rate-limit headers of one response (§18), as a binding parsed them.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ObservedLimits {
    /// Requests (`rpm`).
    pub requests: Option<ObservedLimit>,
    /// Tokens (`tpm`).
    pub tokens: Option<ObservedLimit>,
    /// Input tokens (`itpm`).
    pub input_tokens: Option<ObservedLimit>,
    /// Output tokens (`otpm`).
    pub output_tokens: Option<ObservedLimit>,
    /// Seconds between the response's arrival and this report (a stream's
    /// duration): the sidecar dates the observation `now − age_s` on its backend's
    /// clock, and ignores one older than an observation it already applied.
    pub age_s: f64,
}

impl Request {
    /// The lowest protocol version that has this request (and its outcome).
    pub fn min_version(&self) -> u32 {
        match self {
            Request::Start(_) | Request::Begin(_) | Request::StatusJson => 2,
            Request::StartTenant { .. }
            | Request::BeginTenant { .. }
            | Request::TenantStatus { .. } => 3,
            Request::Report { outcome, .. } => outcome.min_version(),
            Request::Retry { outcome, .. }
            | Request::Finish { outcome, .. }
            | Request::ReportObserved { outcome, .. }
            | Request::RetryObserved { outcome, .. }
            | Request::FinishObserved { outcome, .. } => outcome.min_version().max(2),
            _ => 1,
        }
    }
}

/// What a version-2 call starts with (`Start`, `Begin`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallSpec {
    /// Scope name from the configuration.
    #[serde(deserialize_with = "owned_str")]
    pub scope: String,
    /// Estimated tokens per attempt; `None` takes the split's sum, else the source's
    /// default (§7).
    pub est_tokens: Option<u64>,
    /// Priority class of the scope (§15); `None` = the scope's default class.
    pub priority: Option<String>,
    /// Estimated input (prompt) tokens per attempt, for ITPM limits (§7a).
    pub est_input_tokens: Option<u64>,
    /// Estimated output tokens per attempt (normally the request's `max_tokens`),
    /// for OTPM limits (§7a).
    pub est_output_tokens: Option<u64>,
}

/// Token usage reported with a version-2 outcome (§7, §7a).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Total tokens; `None` with a split given = the split's sum; all `None` keeps
    /// the estimate.
    pub tokens: Option<u64>,
    /// Input tokens, excluding cached reads (§7a).
    pub input_tokens: Option<u64>,
    /// Output tokens.
    pub output_tokens: Option<u64>,
}

/// What a worker reports on a permit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// Tag 0. The upstream answered usefully.
    Success {
        /// Actual tokens used; `None` keeps the estimate.
        tokens: Option<u64>,
        /// `false` keeps a success whose result was unusable out of the breaker window.
        count_attempt: bool,
    },
    /// Tag 1. The upstream failed.
    Failure {
        /// How it failed.
        kind: FailureKind,
    },
    /// Tag 2. The upstream said 429: backpressure, not failure.
    RateLimited {
        /// The upstream's `Retry-After`, if it gave one; blocks the source's quota.
        retry_after_s: Option<f64>,
    },
    /// Tag 3. The worker gave up before (or while) sending.
    Cancelled,
    /// Tag 4 (v2). `Success` with the token usage split (§7a).
    SuccessUsage {
        /// Tokens used.
        usage: Usage,
        /// `false` keeps a success whose result was unusable out of the breaker window.
        count_attempt: bool,
    },
    /// Tag 5 (v2). `Failure` with the tokens the upstream still consumed (a
    /// non-transient failure is charged, §7).
    FailureUsage {
        /// How it failed.
        kind: FailureKind,
        /// Tokens used, if the upstream said.
        usage: Usage,
    },
    /// Tag 6 (v3, §19). `SuccessUsage` that also counts the cached input reads the
    /// provider billed at its cached price (`usage.input_tokens` excludes them, as
    /// everywhere): a tenant's dollar cost prices them at the source's
    /// `usd_per_1m_cached_input`. Quota buckets settle exactly as `SuccessUsage`.
    SuccessCached {
        /// Tokens used (input excluding cached reads).
        usage: Usage,
        /// Input tokens read from the provider's prompt cache.
        cached_input_tokens: u64,
        /// `false` keeps a success whose result was unusable out of the breaker window.
        count_attempt: bool,
    },
}

impl Outcome {
    /// The lowest protocol version that has this outcome.
    pub fn min_version(&self) -> u32 {
        match self {
            Outcome::SuccessUsage { .. } | Outcome::FailureUsage { .. } => 2,
            Outcome::SuccessCached { .. } => 3,
            _ => 1,
        }
    }
}

/// Failure kinds a worker may report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureKind {
    /// Tag 0. The upstream did not answer in time (also lowers the pacer ceiling).
    Timeout,
    /// Tag 1. 5xx or equivalent.
    ServerError,
    /// Tag 2. Could not connect / connection dropped.
    Connection,
    /// Tag 3. The answer was unusable (bad JSON, refusal, …).
    BadResult,
    /// Tag 4. Anything else.
    Error,
}

/// Breaker state as reported on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BreakerState {
    /// Tag 0.
    Closed,
    /// Tag 1.
    Open,
    /// Tag 2.
    HalfOpen,
}

/// Replies, in wire-tag order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// Tag 0. Answer to `Hello`.
    Welcome {
        /// The sidecar's protocol version.
        protocol_version: u32,
        /// The sidecar's software version (`"0.1.0"`).
        sidecar_version: String,
        /// The largest frame payload the sidecar accepts, in bytes.
        max_frame: u32,
    },
    /// Tag 1. Answer to `BeginCall`.
    CallBegun {
        /// The call id to use in `Acquire` / `EndCall`.
        call: u64,
    },
    /// Tag 2. Answer to `Acquire`: a permit.
    Granted {
        /// Permit id to use in `Report`.
        permit: u64,
        /// The source to call.
        #[serde(deserialize_with = "owned_str")]
        source: String,
        /// This attempt is the half-open probe of the source.
        is_probe: bool,
        /// 1-based attempt number within the call.
        attempt: u32,
        /// Tokens reserved for this attempt.
        est_tokens: u64,
    },
    /// Tag 3. Answer to `Report`.
    Reported {
        /// `false` when the outcome was fenced out (the breaker moved on meanwhile).
        applied: bool,
        /// The source's breaker state after the report.
        state: BreakerState,
        /// §6: seconds until a retry is certainly worth attempting (0 = now).
        retry_after_s: f64,
    },
    /// Tag 4. Generic success without data (`EndCall`, admin, `Cancel`).
    Ok,
    /// Tag 5. Answer to `Status`.
    Status(StatusReport),
    /// Tag 6. Answer to `Ping`.
    Pong,
    /// Tag 7. The request failed.
    Error(ErrorReply),
    /// Tag 8 (v2). Answer to `Start`: the call and its first permit.
    Started {
        /// The call id (for `Acquire` / `EndCall` if the client needs them).
        call: u64,
        /// Permit id to use in `Retry` / `Finish` / `Report`.
        permit: u64,
        /// The source to call.
        #[serde(deserialize_with = "owned_str")]
        source: String,
        /// This attempt is the half-open probe of the source.
        is_probe: bool,
        /// 1-based attempt number within the call.
        attempt: u32,
        /// Tokens reserved for this attempt.
        est_tokens: u64,
    },
    /// Tag 9 (v2). Answer to `StatusJson`: one UTF-8 JSON document.
    StatusJson(String),
    /// Tag 10 (v3, §19). The call was refused by its tenant's limit; the call is over
    /// (as after any call-ending error). Version-1 and -2 connections get an `Error`
    /// of kind `AllSourcesExhausted` (`quota_exhausted`) in its place.
    TenantLimited(TenantRefusal),
}

/// A refusal by a tenant's limit (§19).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantRefusal {
    /// The error, of kind `TenantLimited`: message, `retry_after_s` (until the
    /// tenant's bucket, or its dollar budget's window, certainly admits the call),
    /// the skip reason per source and the scope.
    pub error: ErrorReply,
    /// The tenant whose limit refused (empty: the anonymous tenant).
    pub tenant: String,
    /// The limit that refused: `tpm`, `rpm`, `tpd`, `rpd`, `usd_per_day` or
    /// `usd_per_month`.
    pub limit: String,
}

/// A failed request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What kind of failure; clients map it to an exception class.
    pub kind: ErrorKind,
    /// Human-readable, names the offending thing.
    pub message: String,
    /// §6: seconds until a retry is certainly worth attempting (0 when unknown/now).
    pub retry_after_s: f64,
    /// Why each source was skipped in the last admission pass (config order).
    pub per_source_reasons: Vec<(String, SkipReason)>,
    /// For `AllSourcesExhausted`: which budget ran out.
    pub exhausted: Option<ExhaustionReason>,
    /// The scope of the call, when the error concerns one.
    pub scope: Option<String>,
}

/// Error kinds, in wire-tag order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// Tag 0. Every source refused for circuit reasons (fail-fast).
    CircuitOpen,
    /// Tag 1. The call's budget is spent; see `exhausted`.
    AllSourcesExhausted,
    /// Tag 2. `BeginCall` named a scope the configuration lacks.
    UnknownScope,
    /// Tag 3. No live call with that id on this connection.
    UnknownCall,
    /// Tag 4. No live permit with that id on this connection.
    UnknownPermit,
    /// Tag 5. A request argument is invalid (message says which).
    InvalidArgument,
    /// Tag 6. The frame could not be decoded; the connection is closed.
    Malformed,
    /// Tag 7. The frame exceeded `max_frame`; the connection is closed.
    FrameTooLarge,
    /// Tag 8. `Hello` missing, repeated, or a protocol version mismatch; closed.
    ProtocolViolation,
    /// Tag 9. The peer's uid/gid may not do this (admin, or connect at all).
    PermissionDenied,
    /// Tag 10. The sidecar is shutting down; waits end with this.
    ShuttingDown,
    /// Tag 11. The shared backend is unreachable and `on_backend_error = "fail_closed"`.
    BackendUnavailable,
    /// Tag 12. The request was cancelled (by `Cancel`).
    Cancelled,
    /// Tag 13. A second `Acquire` while the call already waits or holds a permit.
    Busy,
    /// Tag 14. A bug in the sidecar.
    Internal,
    /// Tag 15 (v2). A sidecar-wide limit is reached (connections, memory budget):
    /// retry later. Version-1 connections get `Busy` in its place.
    Overloaded,
    /// Tag 16 (v3, §19). The call's tenant is over one of its limits (inside
    /// `Reply::TenantLimited`, which names the tenant and the limit).
    TenantLimited,
}

/// Why a source was skipped in an admission pass (§4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SkipReason {
    /// Tag 0. Cooldown memo or breaker refused.
    CircuitOpen,
    /// Tag 1. Pacer ceiling reached on this host.
    Paced,
    /// Tag 2. Quota bucket (tpm/rpm) or a 429 block.
    RateLimited,
    /// Tag 3. The shared backend is unreachable (`fail_closed`).
    BackendUnavailable,
    /// Tag 4 (v3, §19). The call's tenant has no room for it on this source (its
    /// token or request bucket, or its dollar budget at this source's price).
    /// Version-1 and -2 connections see `RateLimited`.
    TenantLimited,
}

/// Which budget of the call ran out (§5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExhaustionReason {
    /// Tag 0. The stall clock passed `stall_window`.
    Stalled,
    /// Tag 1. Quota (or pacer) refused and `quota_full = "fail_fast"`.
    QuotaExhausted,
    /// Tag 2. `max_attempts` attempts were made.
    RetryExhausted,
}

/// Answer to `Status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The sidecar's software version.
    pub sidecar_version: String,
    /// `"memory"` or `"redis"`.
    pub backend: String,
    /// Every configured scope, in config order.
    pub scopes: Vec<ScopeStatus>,
}

/// One scope in a status report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopeStatus {
    /// Scope name.
    pub name: String,
    /// `"wait"` or `"fail_fast"`.
    pub circuit_open: String,
    /// `"wait"` or `"fail_fast"`.
    pub quota_full: String,
    /// Calls currently waiting in an `Acquire` of this scope.
    pub waiters: u32,
    /// Live calls of this scope.
    pub calls: u32,
    /// The scope's sources, in config order.
    pub sources: Vec<SourceStatus>,
}

/// One source in a status report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceStatus {
    /// Source name.
    pub name: String,
    /// Breaker state.
    pub state: BreakerState,
    /// Breaker epoch (bumped by every transition).
    pub epoch: u64,
    /// §6 retry-after of this source, seconds.
    pub retry_after_s: f64,
    /// Cooldown exponent `k` (open duration = cooldown × 2^k, capped).
    pub cooldown_level: u32,
    /// Successes counted in the breaker window.
    pub window_successes: u64,
    /// Failures counted in the breaker window.
    pub window_failures: u64,
    /// Current consecutive-failure streak.
    pub streak: u32,
    /// Seconds this host's cooldown memo still skips the source (0 = not skipped).
    pub memo_remaining_s: f64,
    /// AIMD pacer ceiling on this host.
    pub pacer_ceiling: f64,
    /// Permits in flight on this host.
    pub in_flight: u32,
    /// Tokens left in the tpm bucket (negative = debt); `None` without `tpm`.
    pub tokens_available: Option<f64>,
    /// Requests left in the rpm bucket; `None` without `rpm`.
    pub requests_available: Option<f64>,
    /// Seconds the quota stays blocked by a 429 `retry_after`.
    pub quota_blocked_s: f64,
    /// `true` while the shared backend is unreachable and this source is served
    /// from local state.
    pub degraded: bool,
}
