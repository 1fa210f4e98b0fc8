//! §19 on the wire, server side: a tenant's id out of `StartTenant` / `BeginTenant`
//! (checked against its bound), a tenant refusal as its own reply, and both as a
//! version-1 or -2 connection reads them. Pure functions, re-exported by `convert`.

use ipc_protocol as wire;

use super::convert::{engine_error, error, ArgumentError};
use crate::engine::EngineError;

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
