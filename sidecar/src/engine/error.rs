//! What an engine operation can answer besides success: the errors a call ends with
//! (§5, §6 `retry_after_s`), the per-source skip reasons that travel with them (§4),
//! the client and lifecycle errors, and a refused reload. Each [`EngineError`] maps to one wire error
//! kind (the server's `convert`).

use std::time::Duration;

/// Why a source was skipped in an admission pass (§4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// Memo or breaker refused.
    CircuitOpen,
    /// Pacer ceiling reached.
    Paced,
    /// Quota refused.
    RateLimited,
    /// Shared backend unreachable under `fail_closed`.
    BackendUnavailable,
    /// §19: the call's tenant had no room for it on this source.
    TenantLimited,
}

/// Which budget of a call ran out (§5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exhaustion {
    /// Stall clock passed `stall_window`.
    Stalled,
    /// Quota/pacer refused under `quota_full = fail_fast`.
    QuotaExhausted,
    /// `max_attempts` used.
    RetryExhausted,
}

/// Engine errors; each maps to one wire error kind.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// Every source refused for circuit reasons under `circuit_open = fail_fast`.
    #[error("scope {scope:?}: every source's circuit is open (retry after {:.3}s)", retry_after.as_secs_f64())]
    CircuitOpen {
        /// Scope of the call.
        scope: String,
        /// §6 retry-after over all sources.
        retry_after: Duration,
        /// Per-source skip reasons of the last pass, config order.
        reasons: Vec<(String, SkipReason)>,
    },
    /// A call budget ran out.
    #[error("scope {scope:?}: all sources exhausted ({reason:?})")]
    Exhausted {
        /// Scope of the call.
        scope: String,
        /// Which budget.
        reason: Exhaustion,
        /// §6 retry-after over all sources (0 unless every source was open).
        retry_after: Duration,
        /// Per-source skip reasons of the last pass (empty for `retry_exhausted`
        /// decided before any pass).
        reasons: Vec<(String, SkipReason)>,
    },
    /// Shared backend unreachable and `on_backend_error = fail_closed`, or an admin
    /// operation that could not reach it.
    #[error("{}", scoped(scope.as_deref(), message))]
    BackendUnavailable {
        /// Scope of the call; `None` for an operation outside any call (admin).
        scope: Option<String>,
        /// What failed.
        message: String,
        /// Per-source skip reasons of the last pass.
        reasons: Vec<(String, SkipReason)>,
    },
    /// No such scope in the configuration; the name as given, cut to
    /// [`MAX_ECHO`](crate::limits::MAX_ECHO) bytes (it is the client's string).
    #[error("{}", unknown_scope(scope, known))]
    UnknownScope {
        /// What the call named.
        scope: String,
        /// The configured scopes, config order (so the message can list them).
        known: Vec<String>,
    },
    /// No such live call for this owner.
    #[error("unknown call {0}")]
    UnknownCall(u64),
    /// No such live permit for this owner (already reported, reclaimed, or never
    /// granted).
    #[error("unknown permit {0}")]
    UnknownPermit(u64),
    /// No such source in the configuration; the name as given, cut to
    /// [`MAX_ECHO`](crate::limits::MAX_ECHO) bytes.
    #[error("unknown source {0:?}")]
    UnknownSource(String),
    /// The call already waits in an Acquire or holds an unreported permit.
    #[error("call {0} already has an acquire in progress or an unreported permit")]
    Busy(u64),
    /// A bad argument; the message names it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// §15: a call named a priority class its scope does not declare.
    #[error("{}", unknown_priority(scope, priority, classes))]
    UnknownPriority {
        /// The call's scope.
        scope: String,
        /// What the call named.
        priority: String,
        /// The scope's classes, config order (empty: none declared).
        classes: Vec<String>,
    },
    /// The engine is shutting down.
    #[error("sidecar is shutting down")]
    ShuttingDown,
    /// §12: `EndCall` ended the call while this Acquire (or Retry) of it waited;
    /// answered at once, like a `Cancel`.
    #[error("call {0} was ended (EndCall) while its request waited")]
    CallEnded(u64),
    /// §12: the sidecar already has `sidecar.max_waiters` requests waiting; this one
    /// would have waited too and is refused instead.
    #[error("the sidecar already has {0} requests waiting (sidecar.max_waiters); retry later")]
    TooManyWaiters(usize),
    /// §19: the call's tenant is over one of its limits; the call is over.
    #[error("{}", tenant_limited(scope, tenant, *limit, *retry_after))]
    TenantLimited {
        /// Scope of the call.
        scope: String,
        /// The tenant (empty: the anonymous tenant); the client's string, at most
        /// 128 bytes.
        tenant: String,
        /// Which of its limits refused.
        limit: crate::gate::tenant::TenantLimit,
        /// §6: until the tenant's bucket certainly holds the call's estimate, or the
        /// budget's calendar window ends.
        retry_after: Duration,
        /// Per-source skip reasons of the last pass, config order.
        reasons: Vec<(String, SkipReason)>,
    },
    /// §19: this host already tracks the scope's `max_tenants` tenants and the call's
    /// is a new one.
    #[error(
        "scope {scope:?} already tracks {max} tenants (scopes.{scope}.tenants.max_tenants); retry later"
    )]
    TooManyTenants {
        /// The scope.
        scope: String,
        /// Its `max_tenants`.
        max: u32,
    },
}

fn tenant_limited(
    scope: &str,
    tenant: &str,
    limit: crate::gate::tenant::TenantLimit,
    retry_after: Duration,
) -> String {
    let who = if tenant.is_empty() {
        "the anonymous tenant".to_string()
    } else {
        format!("tenant {tenant:?}")
    };
    let what = if limit.is_budget() { "budget" } else { "limit" };
    format!(
        "scope {scope:?}: {who} is over its {} {what} (retry after {:.3}s)",
        limit.as_str(),
        retry_after.as_secs_f64()
    )
}

/// `scope "x": message`, or just the message for errors outside a call (admin).
fn scoped(scope: Option<&str>, message: &str) -> String {
    match scope {
        Some(scope) => format!("scope {scope:?}: {message}"),
        None => message.to_string(),
    }
}

/// Why a new configuration was refused by [`super::Engine::reload`]; the running one
/// is kept whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    /// Scopes or sources were added, removed, renamed or reordered: the calls, permits
    /// and host-local state are indexed by them, so only a restart can apply that.
    #[error(
        "scopes or sources were added, removed, renamed or reordered: that needs a restart; \
         the running configuration is kept"
    )]
    TopologyChanged,
    /// §15: a scope's priority classes were added, removed, renamed or reordered
    /// (their weights, reserves and limits may change on reload).
    #[error(
        "scope {scope:?}: priority classes were added, removed, renamed or reordered: that \
         needs a restart; the running configuration is kept"
    )]
    ClassesChanged {
        /// The scope whose classes changed.
        scope: String,
    },
    /// §19: a scope's `[tenants]` table was added or removed, or its `fairness`
    /// changed (limits, budgets, weights and overrides may change on reload).
    #[error(
        "scope {scope:?}: its [tenants] table was added or removed, or its fairness \
         changed: that needs a restart; the running configuration is kept"
    )]
    TenantsChanged {
        /// The scope whose tenants changed.
        scope: String,
    },
}

fn unknown_scope(scope: &str, known: &[String]) -> String {
    format!(
        "unknown scope {scope:?}; the scopes are: {}",
        known.join(", ")
    )
}

fn unknown_priority(scope: &str, priority: &str, classes: &[String]) -> String {
    if classes.is_empty() {
        format!("scope {scope:?} has no priority classes; omit priority (got {priority:?})")
    } else {
        format!(
            "scope {scope:?} has no priority class {priority:?}; its classes are: {}",
            classes.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_tenants_names_the_key_in_one_sentence() {
        let e = EngineError::TooManyTenants {
            scope: "chat".into(),
            max: 3,
        };
        assert_eq!(
            e.to_string(),
            "scope \"chat\" already tracks 3 tenants (scopes.chat.tenants.max_tenants); retry later"
        );
    }
}
