//! Engine types ↔ wire types. Pure functions, no I/O.

use std::time::Duration;

use ipc_protocol as wire;

use crate::backend::{self, Applied, State};
use crate::engine::{self, EngineError, Exhaustion, Grant};

pub use crate::limits::MAX_TOKENS;

/// A wire argument the engine cannot take.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ArgumentError {
    /// A `seconds` / `retry_after_s` value that is NaN, infinite, negative or too big.
    #[error("{name} must be a finite number {bound}, got {}", shown(*value))]
    Seconds {
        /// The field name as it appears on the wire.
        name: &'static str,
        /// `">= 0"` or `"> 0"`.
        bound: &'static str,
        /// What the client sent.
        value: f64,
    },
    /// A token count above [`MAX_TOKENS`].
    #[error("{name} must be at most {max}, got {value}", max = MAX_TOKENS)]
    Tokens {
        /// The field name as it appears on the wire.
        name: &'static str,
        /// What the client sent.
        value: u64,
    },
    /// A value above its bound (`ForceOpen.seconds` past [`crate::limits::MAX_FORCE_OPEN`]):
    /// the message states the bound, not the value's hundreds of digits.
    #[error("{name} must be > 0 and at most {max_s} ({days} days), got {}", shown(*value), days = max_s / 86_400)]
    SecondsAbove {
        /// The field name as it appears on the wire.
        name: &'static str,
        /// The bound, in whole seconds.
        max_s: u64,
        /// What the client sent.
        value: f64,
    },
    /// A usage whose split (input + output) exceeds the total it gives.
    #[error("input_tokens + output_tokens ({split}) exceed tokens ({tokens}): the split is part of the total")]
    SplitAboveTotal {
        /// The total given.
        tokens: u64,
        /// The split's sum.
        split: u64,
    },
    /// A split token count whose sum does not fit.
    #[error("est_input_tokens + est_output_tokens must be at most {max}", max = MAX_TOKENS)]
    SplitSum,
    /// §19: a tenant id longer than [`crate::config::MAX_TENANT_ID`] bytes.
    #[error("tenant must be at most {max} bytes of UTF-8, got {len} bytes", max = crate::config::MAX_TENANT_ID)]
    TenantTooLong {
        /// Its length in bytes.
        len: usize,
    },
}

/// What a version-2 `CallSpec` asks the engine for.
#[derive(Debug, Clone, PartialEq)]
pub struct CallArgs {
    /// Scope name.
    pub scope: String,
    /// The call's estimates (§7a): the total is `est_tokens`, else the split's sum
    /// (the engine then fills the parts the call leaves out from the source).
    pub est: engine::CallEst,
    /// §15: the priority class named, if any (the engine checks it against the
    /// scope's classes).
    pub priority: Option<String>,
}

/// A version-2 `CallSpec` → engine arguments, validating every count and the
/// priority's presence (whether the scope has that class is the engine's check).
pub fn call_spec(spec: wire::CallSpec) -> Result<CallArgs, ArgumentError> {
    let est = spec
        .est_tokens
        .map(|t| tokens("est_tokens", t))
        .transpose()?;
    let input = spec
        .est_input_tokens
        .map(|t| tokens("est_input_tokens", t))
        .transpose()?;
    let output = spec
        .est_output_tokens
        .map(|t| tokens("est_output_tokens", t))
        .transpose()?;
    split_sum(input, output).ok_or(ArgumentError::SplitSum)?;
    Ok(CallArgs {
        scope: spec.scope,
        est: engine::CallEst {
            total: est,
            input,
            output,
        },
        priority: spec.priority,
    })
}

/// `Some(a + b)` of the present parts, `None` when both are absent; the outer
/// `None` means the sum exceeds [`MAX_TOKENS`].
fn split_sum(a: Option<u64>, b: Option<u64>) -> Option<Option<u64>> {
    match (a, b) {
        (None, None) => Some(None),
        (a, b) => {
            let sum = a.unwrap_or(0) + b.unwrap_or(0); // each ≤ 10^9: no overflow
            (sum <= MAX_TOKENS).then_some(Some(sum))
        }
    }
}

/// A version-2 `Usage`: every count validated; the total is `tokens`, else the
/// split's sum, else `None` (keep the estimate); the split (§7a) when either part is
/// given, a missing part being what the total leaves (else 0).
fn usage_tokens(u: wire::Usage) -> Result<(Option<u64>, Option<backend::Split>), ArgumentError> {
    let total = u.tokens.map(|t| tokens("tokens", t)).transpose()?;
    let input = u
        .input_tokens
        .map(|t| tokens("input_tokens", t))
        .transpose()?;
    let output = u
        .output_tokens
        .map(|t| tokens("output_tokens", t))
        .transpose()?;
    let split_total = split_sum(input, output).ok_or(ArgumentError::Tokens {
        name: "input_tokens + output_tokens",
        value: input.unwrap_or(0) + output.unwrap_or(0),
    })?;
    if let (Some(t), Some(s)) = (total, split_total) {
        if s > t {
            return Err(ArgumentError::SplitAboveTotal {
                tokens: t,
                split: s,
            });
        }
    }
    let split = match (input, output) {
        (None, None) => None,
        (i, o) => {
            let t = total.unwrap_or(0);
            Some(backend::Split {
                input: i.unwrap_or_else(|| t.saturating_sub(o.unwrap_or(0))),
                output: o.unwrap_or_else(|| t.saturating_sub(i.unwrap_or(0))),
            })
        }
    };
    Ok((total.or(split_total), split))
}

/// A wire token count, refused above [`MAX_TOKENS`].
pub fn tokens(name: &'static str, value: u64) -> Result<u64, ArgumentError> {
    if value > MAX_TOKENS {
        return Err(ArgumentError::Tokens { name, value });
    }
    Ok(value)
}

/// A client's number as a message shows it: plain when short, else in scientific
/// notation (1e300 is not repeated as 301 digits).
fn shown(v: f64) -> String {
    if v.is_finite() && v.abs() >= 1e15 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// `ForceOpen.seconds` → `Duration`: finite, > 0 and at most
/// [`crate::limits::MAX_FORCE_OPEN`], checked before any conversion.
pub fn force_open_seconds(value: f64) -> Result<Duration, ArgumentError> {
    let max = crate::limits::MAX_FORCE_OPEN;
    if value.is_finite() && value > max.as_secs_f64() {
        return Err(ArgumentError::SecondsAbove {
            name: "seconds",
            max_s: max.as_secs(),
            value,
        });
    }
    seconds("seconds", value, true)
}

/// A wire `f64` seconds value → `Duration`; `positive` additionally refuses 0.
pub fn seconds(name: &'static str, value: f64, positive: bool) -> Result<Duration, ArgumentError> {
    let bound = if positive { "> 0" } else { ">= 0" };
    let err = ArgumentError::Seconds { name, bound, value };
    if !value.is_finite() || value < 0.0 || (positive && value == 0.0) {
        return Err(err);
    }
    Duration::try_from_secs_f64(value).map_err(|_| err)
}

/// Wire outcome → engine outcome, validating `tokens` and `retry_after_s`. A finite
/// `retry_after_s` of any size is accepted (the engine cuts it to
/// `max_rate_limit_block`, §7); NaN, infinite or negative ones are refused.
pub fn outcome(o: wire::Outcome) -> Result<backend::Outcome, ArgumentError> {
    outcome_cached(o).map(|(o, _)| o)
}

/// [`outcome`], and the cached input reads a v3 `SuccessCached` counts (§19; 0 for
/// every other outcome).
pub fn outcome_cached(o: wire::Outcome) -> Result<(backend::Outcome, u64), ArgumentError> {
    if let wire::Outcome::SuccessCached {
        usage,
        cached_input_tokens,
        count_attempt,
    } = o
    {
        let cached = tokens("cached_input_tokens", cached_input_tokens)?;
        let (tokens, split) = usage_tokens(usage)?;
        return Ok((
            backend::Outcome::Success {
                tokens,
                split,
                count_attempt,
            },
            cached,
        ));
    }
    Ok((plain_outcome(o)?, 0))
}

fn plain_outcome(o: wire::Outcome) -> Result<backend::Outcome, ArgumentError> {
    Ok(match o {
        wire::Outcome::Success {
            tokens: t,
            count_attempt,
        } => backend::Outcome::Success {
            tokens: t.map(|t| tokens("tokens", t)).transpose()?,
            split: None,
            count_attempt,
        },
        wire::Outcome::Failure { kind } => backend::Outcome::failure(failure_kind(kind)),
        wire::Outcome::RateLimited { retry_after_s } => backend::Outcome::RateLimited {
            retry_after: retry_after_s
                .map(|s| any_seconds("retry_after_s", s))
                .transpose()?,
        },
        wire::Outcome::Cancelled => backend::Outcome::Cancelled,
        wire::Outcome::SuccessUsage {
            usage,
            count_attempt,
        } => {
            let (tokens, split) = usage_tokens(usage)?;
            backend::Outcome::Success {
                tokens,
                split,
                count_attempt,
            }
        }
        // §7: a non-transient failure is charged these tokens (the estimate when
        // none are given); a transient one is refunded whatever it says.
        wire::Outcome::FailureUsage { kind, usage } => {
            let (tokens, split) = usage_tokens(usage)?;
            backend::Outcome::Failure {
                kind: failure_kind(kind),
                tokens,
                split,
            }
        }
        wire::Outcome::SuccessCached { .. } => unreachable!("outcome_cached takes it"),
    })
}

/// §19: a v3 `StartTenant` / `BeginTenant` → the v2 request it extends, and the
/// tenant it names (`None`: every other request, and an empty tenant id, which is the
/// anonymous tenant). An id over [`crate::config::MAX_TENANT_ID`] bytes is refused.
pub fn split_tenant(r: wire::Request) -> Result<(wire::Request, Option<String>), ArgumentError> {
    let (r, tenant) = match r {
        wire::Request::StartTenant { spec, tenant } => (wire::Request::Start(spec), tenant),
        wire::Request::BeginTenant { spec, tenant } => (wire::Request::Begin(spec), tenant),
        r => return Ok((r, None)),
    };
    tenant_id(&tenant)?;
    Ok((r, (!tenant.is_empty()).then_some(tenant)))
}

/// §19: a tenant id is at most [`crate::config::MAX_TENANT_ID`] bytes.
pub fn tenant_id(t: &str) -> Result<(), ArgumentError> {
    if t.len() > crate::config::MAX_TENANT_ID {
        return Err(ArgumentError::TenantTooLong { len: t.len() });
    }
    Ok(())
}

/// §18: a report with observed limits → the same report without them, and the
/// observation in the engine's terms (`None` for every other request). Counts above
/// [`MAX_TOKENS`] are cut to it (a provider's header is not the client's error);
/// a reset or age that is NaN, infinite or negative is refused.
#[allow(clippy::type_complexity)]
pub fn split_observed(
    r: wire::Request,
) -> Result<(wire::Request, Option<Box<backend::Observation>>), ArgumentError> {
    let (r, limits) = match r {
        wire::Request::ReportObserved {
            permit,
            outcome,
            limits,
        } => (wire::Request::Report { permit, outcome }, limits),
        wire::Request::RetryObserved {
            permit,
            outcome,
            limits,
        } => (wire::Request::Retry { permit, outcome }, limits),
        wire::Request::FinishObserved {
            permit,
            outcome,
            limits,
        } => (wire::Request::Finish { permit, outcome }, limits),
        r => return Ok((r, None)),
    };
    Ok((r, Some(Box::new(observation(&limits)?))))
}

/// Wire observed limits → the engine's [`backend::Observation`] (dimensions in
/// bucket order: tokens, requests, input, output).
pub fn observation(l: &wire::ObservedLimits) -> Result<backend::Observation, ArgumentError> {
    let dim = |d: Option<wire::ObservedLimit>| -> Result<Option<backend::Dim>, ArgumentError> {
        let Some(d) = d else { return Ok(None) };
        Ok(Some(backend::Dim {
            limit: d.limit.map(|n| n.min(MAX_TOKENS)),
            remaining: d.remaining.map(|n| n.min(MAX_TOKENS)),
            reset: d.reset_s.map(|s| any_seconds("reset_s", s)).transpose()?,
        }))
    };
    Ok(backend::Observation {
        dims: [
            dim(l.tokens)?,
            dim(l.requests)?,
            dim(l.input_tokens)?,
            dim(l.output_tokens)?,
        ],
        age: any_seconds("age_s", l.age_s)?,
    })
}

/// A wire `f64` seconds value ≥ 0 of any finite size → `Duration` (saturating).
fn any_seconds(name: &'static str, value: f64) -> Result<Duration, ArgumentError> {
    if !value.is_finite() || value < 0.0 {
        return Err(ArgumentError::Seconds {
            name,
            bound: ">= 0",
            value,
        });
    }
    Ok(Duration::try_from_secs_f64(value).unwrap_or(Duration::MAX))
}

fn failure_kind(k: wire::FailureKind) -> backend::FailureKind {
    match k {
        wire::FailureKind::Timeout => backend::FailureKind::Timeout,
        wire::FailureKind::ServerError => backend::FailureKind::ServerError,
        wire::FailureKind::Connection => backend::FailureKind::Connection,
        wire::FailureKind::BadResult => backend::FailureKind::BadResult,
        wire::FailureKind::Error => backend::FailureKind::Error,
    }
}

/// Breaker state → wire.
pub fn state(s: State) -> wire::BreakerState {
    match s {
        State::Closed => wire::BreakerState::Closed,
        State::Open => wire::BreakerState::Open,
        State::HalfOpen => wire::BreakerState::HalfOpen,
    }
}

fn skip_reason(r: engine::SkipReason) -> wire::SkipReason {
    match r {
        engine::SkipReason::CircuitOpen => wire::SkipReason::CircuitOpen,
        engine::SkipReason::Paced => wire::SkipReason::Paced,
        engine::SkipReason::RateLimited => wire::SkipReason::RateLimited,
        engine::SkipReason::BackendUnavailable => wire::SkipReason::BackendUnavailable,
        engine::SkipReason::TenantLimited => wire::SkipReason::TenantLimited,
    }
}

fn exhaustion(r: Exhaustion) -> wire::ExhaustionReason {
    match r {
        Exhaustion::Stalled => wire::ExhaustionReason::Stalled,
        Exhaustion::QuotaExhausted => wire::ExhaustionReason::QuotaExhausted,
        Exhaustion::RetryExhausted => wire::ExhaustionReason::RetryExhausted,
    }
}

fn reasons(r: &[(String, engine::SkipReason)]) -> Vec<(String, wire::SkipReason)> {
    r.iter()
        .map(|(s, r)| (s.clone(), skip_reason(*r)))
        .collect()
}

/// A plain error reply: no retry hint, no reasons, no scope.
pub fn error(kind: wire::ErrorKind, message: impl Into<String>) -> wire::ErrorReply {
    wire::ErrorReply {
        kind,
        message: message.into(),
        retry_after_s: 0.0,
        per_source_reasons: vec![],
        exhausted: None,
        scope: None,
    }
}

/// Engine error → wire error reply (kind, message, retry hint, reasons, scope).
pub fn engine_error(e: &EngineError) -> wire::ErrorReply {
    use wire::ErrorKind as K;
    let message = e.to_string();
    let mut reply = match e {
        EngineError::CircuitOpen {
            scope,
            retry_after,
            reasons: r,
        } => wire::ErrorReply {
            retry_after_s: retry_after.as_secs_f64(),
            per_source_reasons: reasons(r),
            scope: Some(scope.clone()),
            ..error(K::CircuitOpen, "")
        },
        EngineError::Exhausted {
            scope,
            reason,
            retry_after,
            reasons: r,
        } => wire::ErrorReply {
            retry_after_s: retry_after.as_secs_f64(),
            per_source_reasons: reasons(r),
            exhausted: Some(exhaustion(*reason)),
            scope: Some(scope.clone()),
            ..error(K::AllSourcesExhausted, "")
        },
        EngineError::BackendUnavailable {
            scope, reasons: r, ..
        } => wire::ErrorReply {
            per_source_reasons: reasons(r),
            scope: scope.clone(),
            ..error(K::BackendUnavailable, "")
        },
        EngineError::UnknownScope { scope, .. } => wire::ErrorReply {
            scope: Some(scope.clone()),
            ..error(K::UnknownScope, "")
        },
        EngineError::UnknownCall(_) => error(K::UnknownCall, ""),
        EngineError::UnknownPermit(_) => error(K::UnknownPermit, ""),
        // The wire has no UnknownSource kind: the request named something invalid.
        EngineError::UnknownSource(_) | EngineError::InvalidArgument(_) => {
            error(K::InvalidArgument, "")
        }
        EngineError::UnknownPriority { scope, .. } => wire::ErrorReply {
            scope: Some(scope.clone()),
            ..error(K::InvalidArgument, "")
        },
        EngineError::Busy(_) => error(K::Busy, ""),
        EngineError::ShuttingDown => error(K::ShuttingDown, ""),
        EngineError::CallEnded(_) => error(K::Cancelled, ""),
        EngineError::TooManyWaiters(_) | EngineError::TooManyTenants { .. } => {
            error(K::Overloaded, "")
        }
        EngineError::TenantLimited {
            scope,
            retry_after,
            reasons: r,
            ..
        } => wire::ErrorReply {
            retry_after_s: retry_after.as_secs_f64(),
            per_source_reasons: reasons(r),
            scope: Some(scope.clone()),
            ..error(K::TenantLimited, "")
        },
    };
    reply.message = message;
    reply
}

/// Engine error → its reply: §19's `TenantLimited` (naming the tenant and the limit)
/// for a tenant refusal, `Error` for every other.
pub fn engine_reply(e: &EngineError) -> wire::Reply {
    match e {
        EngineError::TenantLimited { tenant, limit, .. } => {
            wire::Reply::TenantLimited(wire::TenantRefusal {
                error: engine_error(e),
                tenant: tenant.clone(),
                limit: limit.as_str().into(),
            })
        }
        _ => wire::Reply::Error(engine_error(e)),
    }
}

/// §19: a reply as a version-1 or -2 connection can read it: a tenant refusal is an
/// `AllSourcesExhausted` (`quota_exhausted`) error with the same message and retry
/// hint, and a `tenant_limited` skip reason reads `rate_limited`.
pub fn downgrade_tenant(reply: &mut wire::Reply) {
    if let wire::Reply::TenantLimited(t) = reply {
        let mut e = std::mem::replace(&mut t.error, error(wire::ErrorKind::Internal, ""));
        e.kind = wire::ErrorKind::AllSourcesExhausted;
        e.exhausted = Some(wire::ExhaustionReason::QuotaExhausted);
        *reply = wire::Reply::Error(e);
    }
    if let wire::Reply::Error(e) = reply {
        for (_, r) in &mut e.per_source_reasons {
            if *r == wire::SkipReason::TenantLimited {
                *r = wire::SkipReason::RateLimited;
            }
        }
    }
}

/// A grant → `Granted`.
pub fn granted(g: &Grant) -> wire::Reply {
    wire::Reply::Granted {
        permit: g.permit,
        source: g.source.to_string(),
        is_probe: g.is_probe,
        attempt: g.attempt,
        est_tokens: g.est_tokens,
    }
}

/// A report's result → `Reported`.
pub fn reported(a: &Applied) -> wire::Reply {
    wire::Reply::Reported {
        applied: a.applied,
        state: state(a.state),
        retry_after_s: a.retry_after.as_secs_f64(),
    }
}

/// A grant of a version-2 `Start` → `Started`.
pub fn started(call: u64, g: &Grant) -> wire::Reply {
    wire::Reply::Started {
        call,
        permit: g.permit,
        source: g.source.to_string(),
        is_probe: g.is_probe,
        attempt: g.attempt,
        est_tokens: g.est_tokens,
    }
}

/// Breaker state as spelled in the JSON status (`bindings/PROTOCOL.md` §14).
fn state_name(s: State) -> &'static str {
    match s {
        State::Closed => "closed",
        State::Open => "open",
        State::HalfOpen => "half_open",
    }
}

/// Engine status → the version-2 JSON status document (`bindings/PROTOCOL.md` §14).
/// Keys may be added; clients ignore the ones they do not know.
/// `share`: §10's degraded share of a shared backend (`None`: not shown).
pub fn status_json(
    backend: &str,
    share: Option<crate::backend::ShareView>,
    scopes: &[engine::ScopeStatus],
) -> String {
    use serde_json::json;
    let scopes: Vec<serde_json::Value> = scopes
        .iter()
        .map(|sc| {
            let sources: Vec<serde_json::Value> = sc
                .sources
                .iter()
                .map(|s| {
                    let b = &s.shared;
                    json!({
                        "name": s.name,
                        "state": state_name(b.state),
                        "epoch": b.epoch,
                        "retry_after_s": b.retry_after.as_secs_f64(),
                        "cooldown_level": b.cooldown_level,
                        "window_successes": b.window_successes,
                        "window_failures": b.window_failures,
                        "streak": b.streak,
                        "memo_remaining_s": s.memo_remaining.as_secs_f64(),
                        "pacer_ceiling": s.pacer_ceiling,
                        "in_flight": s.in_flight,
                        "tokens_available": b.tokens_available,
                        "requests_available": b.requests_available,
                        "quota_blocked_s": b.quota_blocked.as_secs_f64(),
                        "quota_retry_after_s": s.quota_retry_after.as_secs_f64(),
                        "buckets": s.buckets().iter().map(|v| json!({
                            "bucket": v.bucket.as_str(),
                            "level": v.level,
                            "capacity": v.capacity,
                            "refill_per_s": v.refill_per_s,
                            "debt": v.debt,
                            "auto": v.auto,
                            "observed": v.observed.map(|o| json!({
                                "remaining": o.remaining,
                                "limit": o.limit,
                                "age_s": o.age.as_secs_f64(),
                                "removed": o.removed,
                            })),
                        })).collect::<Vec<_>>(),
                        "degraded": s.degraded,
                    })
                })
                .collect();
            let mut doc = json!({
                "name": sc.name,
                "circuit_open": sc.circuit_open,
                "quota_full": sc.quota_full,
                "waiters": sc.waiters,
                "calls": sc.calls,
                "sources": sources,
            });
            // §15: only a scope that declares classes shows them.
            if !sc.classes.is_empty() {
                doc["classes"] = sc.classes.iter().map(class_json).collect();
            }
            // §19: and only a scope with tenants, its tenants.
            if let Some(t) = &sc.tenants {
                doc["tenants"] = super::tenant_doc::tenants_json(t);
            }
            doc
        })
        .collect();
    let mut doc = json!({
        "sidecar_version": env!("CARGO_PKG_VERSION"),
        "backend": backend,
        "protocol_version": wire::PROTOCOL_VERSION,
        "scopes": scopes,
    });
    if let Some(v) = share {
        doc["degraded_share"] = json!({
            "share": v.share,
            "live_hosts": v.live_hosts,
            "setting": v.setting.spelled(),
        });
    }
    doc.to_string()
}

/// One priority class in `status --json` (§15).
fn class_json(c: &engine::ClassStatus) -> serde_json::Value {
    let refusals: serde_json::Map<String, serde_json::Value> = c
        .refusals
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
        .collect();
    serde_json::json!({
        "name": c.name,
        "weight": c.weight,
        "reserve": c.reserve,
        "limit": c.limit,
        "waiters": c.waiters,
        "grants": c.grants,
        "grant_share": c.grant_share,
        "in_flight": c.in_flight,
        "waits": c.waits,
        "refusals": refusals,
    })
}

/// Engine status → wire status report.
pub fn status_report(backend: &str, scopes: Vec<engine::ScopeStatus>) -> wire::StatusReport {
    wire::StatusReport {
        sidecar_version: env!("CARGO_PKG_VERSION").to_string(),
        backend: backend.to_string(),
        scopes: scopes.into_iter().map(scope_status).collect(),
    }
}

fn scope_status(s: engine::ScopeStatus) -> wire::ScopeStatus {
    wire::ScopeStatus {
        name: s.name,
        circuit_open: s.circuit_open.to_string(),
        quota_full: s.quota_full.to_string(),
        waiters: s.waiters,
        calls: s.calls,
        sources: s.sources.into_iter().map(source_status).collect(),
    }
}

fn source_status(s: engine::SourceStatus) -> wire::SourceStatus {
    let b = s.shared;
    wire::SourceStatus {
        name: s.name,
        state: state(b.state),
        epoch: b.epoch,
        retry_after_s: b.retry_after.as_secs_f64(),
        cooldown_level: b.cooldown_level,
        window_successes: b.window_successes,
        window_failures: b.window_failures,
        streak: b.streak,
        memo_remaining_s: s.memo_remaining.as_secs_f64(),
        pacer_ceiling: s.pacer_ceiling,
        in_flight: s.in_flight,
        tokens_available: b.tokens_available,
        requests_available: b.requests_available,
        quota_blocked_s: b.quota_blocked.as_secs_f64(),
        degraded: s.degraded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_validation() {
        assert_eq!(seconds("s", 1.5, true), Ok(Duration::from_millis(1500)));
        assert_eq!(seconds("s", 0.0, false), Ok(Duration::ZERO));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let e = seconds("seconds", bad, true).unwrap_err();
            assert!(e.to_string().starts_with("seconds must be"), "{e}");
        }
        assert!(seconds("retry_after_s", -0.5, false).is_err());
    }

    #[test]
    fn outcome_maps_retry_after() {
        let o = outcome(wire::Outcome::RateLimited {
            retry_after_s: Some(2.0),
        })
        .unwrap();
        assert_eq!(
            o,
            backend::Outcome::RateLimited {
                retry_after: Some(Duration::from_secs(2))
            }
        );
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let e = outcome(wire::Outcome::RateLimited {
                retry_after_s: Some(bad),
            })
            .unwrap_err();
            assert!(e.to_string().contains("retry_after_s"), "{e}");
        }
        // Any finite size is taken (the engine caps it at max_rate_limit_block).
        let o = outcome(wire::Outcome::RateLimited {
            retry_after_s: Some(1e300),
        })
        .unwrap();
        assert_eq!(
            o,
            backend::Outcome::RateLimited {
                retry_after: Some(Duration::MAX)
            }
        );
    }

    #[test]
    fn failure_usage_carries_its_tokens() {
        let usage = |tokens, input_tokens, output_tokens| wire::Usage {
            tokens,
            input_tokens,
            output_tokens,
        };
        let o = outcome(wire::Outcome::FailureUsage {
            kind: wire::FailureKind::BadResult,
            usage: usage(None, Some(30), Some(12)),
        })
        .unwrap();
        assert_eq!(
            o,
            backend::Outcome::Failure {
                kind: backend::FailureKind::BadResult,
                tokens: Some(42),
                split: Some(backend::Split {
                    input: 30,
                    output: 12
                })
            }
        );
        let o = outcome(wire::Outcome::Failure {
            kind: wire::FailureKind::Error,
        })
        .unwrap();
        assert_eq!(o, backend::Outcome::failure(backend::FailureKind::Error));
        assert!(outcome(wire::Outcome::FailureUsage {
            kind: wire::FailureKind::Error,
            usage: usage(Some(MAX_TOKENS + 1), None, None),
        })
        .is_err());
    }

    #[test]
    fn engine_errors_keep_their_details() {
        let e = EngineError::Exhausted {
            scope: "chat".into(),
            reason: Exhaustion::Stalled,
            retry_after: Duration::from_secs(3),
            reasons: vec![("a".into(), engine::SkipReason::CircuitOpen)],
        };
        let r = engine_error(&e);
        assert_eq!(r.kind, wire::ErrorKind::AllSourcesExhausted);
        assert_eq!(r.exhausted, Some(wire::ExhaustionReason::Stalled));
        assert_eq!(r.scope.as_deref(), Some("chat"));
        assert_eq!(r.retry_after_s, 3.0);
        assert_eq!(
            r.per_source_reasons,
            vec![("a".to_string(), wire::SkipReason::CircuitOpen)]
        );
        let r = engine_error(&EngineError::UnknownScope {
            scope: "nope".into(),
            known: vec!["chat".into(), "embed".into()],
        });
        assert_eq!(
            r.message,
            "unknown scope \"nope\"; the scopes are: chat, embed"
        );
        assert_eq!(r.kind, wire::ErrorKind::UnknownScope);
        assert!(r.message.contains("nope"));
    }

    #[test]
    fn errors_without_a_scope_carry_none() {
        let admin = EngineError::BackendUnavailable {
            scope: None,
            message: "redis down".into(),
            reasons: vec![],
        };
        let r = engine_error(&admin);
        assert_eq!(r.kind, wire::ErrorKind::BackendUnavailable);
        assert_eq!(r.scope, None, "{r:?}");
        let scoped = EngineError::BackendUnavailable {
            scope: Some("chat".into()),
            message: "redis down".into(),
            reasons: vec![],
        };
        assert_eq!(engine_error(&scoped).scope.as_deref(), Some("chat"));
        for e in [
            EngineError::UnknownCall(1),
            EngineError::UnknownPermit(2),
            EngineError::UnknownSource("x".into()),
            EngineError::Busy(3),
            EngineError::InvalidArgument("y".into()),
            EngineError::ShuttingDown,
        ] {
            assert_eq!(engine_error(&e).scope, None, "{e:?}");
        }
    }

    #[test]
    fn token_counts_are_bounded() {
        assert_eq!(tokens("tokens", MAX_TOKENS), Ok(MAX_TOKENS));
        let e = tokens("est_tokens", MAX_TOKENS + 1).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("est_tokens") && m.contains("1000000000"), "{m}");
        let e = outcome(wire::Outcome::Success {
            tokens: Some(u64::MAX),
            count_attempt: true,
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("tokens must be at most"), "{e}");
        assert!(outcome(wire::Outcome::Success {
            tokens: Some(12),
            count_attempt: true,
        })
        .is_ok());
    }
}
