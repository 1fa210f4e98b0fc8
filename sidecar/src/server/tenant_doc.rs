//! §19 in the JSON status documents (`bindings/PROTOCOL.md` §15): a scope's
//! `tenants` object inside `StatusJson`, and the whole answer to `TenantStatus`.
//! Money is shown in dollars (floats) here; everywhere else it is integer n$.

use serde_json::{json, Value};

use crate::config::NANOS_PER_USD;
use crate::engine::{TenantStats, TenantStatus, TenantsStatus};
use crate::gate::tenant::{TenantParams, TENANT_BUCKETS};

/// n$ → dollars.
fn usd(n: u64) -> f64 {
    n as f64 / NANOS_PER_USD
}

/// One tenant's figures on this host.
fn stats(s: &TenantStats) -> Value {
    json!({
        "calls": s.calls,
        "in_flight": s.in_flight,
        "grants": s.grants,
        "refused": s.refused,
        "tokens": s.tokens,
        "usd": usd(s.spend),
    })
}

/// A scope's `tenants` object in `StatusJson`: fairness, how many this host tracks,
/// the totals and the top tenants by dollars settled here.
pub(super) fn tenants_json(t: &TenantsStatus) -> Value {
    json!({
        "fairness": t.fairness,
        "tracked": t.tracked,
        "max_tenants": t.max_tenants,
        "totals": stats(&t.totals),
        "top": t.top.iter().map(|(id, s)| {
            let mut v = stats(s);
            v["tenant"] = json!(id);
            v
        }).collect::<Vec<_>>(),
    })
}

/// A tenant's limits (`null`: none).
fn limits(p: &TenantParams, weight: f64) -> Value {
    json!({
        "tpm": p.q.tpm,
        "rpm": p.q.rpm,
        "tpd": p.q.tpd,
        "rpd": p.q.rpd,
        "usd_per_day": p.usd_per_day.map(usd),
        "usd_per_month": p.usd_per_month.map(usd),
        "weight": weight,
    })
}

/// The answer to `TenantStatus`: `{"tenant": …, "scopes": {NAME: {…}}}`.
pub fn tenant_json(t: &TenantStatus) -> String {
    let mut scopes = serde_json::Map::new();
    for s in &t.scopes {
        let ledger = s.ledger.map(|l| {
            let buckets: serde_json::Map<String, Value> = TENANT_BUCKETS
                .iter()
                .zip(l.levels)
                .filter_map(|(b, level)| Some((b.as_str().to_string(), json!(level?))))
                .collect();
            json!({
                "levels": buckets,
                "usd_spent_day": usd(l.spent_day),
                "usd_spent_month": usd(l.spent_month),
                "in_flight": l.in_flight,
            })
        });
        scopes.insert(
            s.scope.clone(),
            json!({
                "limits": limits(&s.params, s.weight),
                "ledger": ledger,
                "ledger_error": s.ledger_error,
                "host": s.host.as_ref().map(stats),
                "waiting": s.waiting,
                "fair_counter": s.counter,
            }),
        );
    }
    json!({ "tenant": t.tenant, "scopes": scopes }).to_string()
}
