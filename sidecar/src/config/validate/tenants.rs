//! A scope's tenants (§19): `[scopes.NAME.tenants]` with its `default` and
//! `anonymous` limits and its `[[scopes.NAME.tenants.override]]` tables.

use super::{choice, positive};
use crate::config::env::Origins;
use crate::config::raw::{RawTenantLimits, RawTenants};
use crate::config::{
    ConfigError, Fairness, TenantLimits, TenantOverride, TenantsConfig, DEFAULT_MAX_TENANTS,
    MAX_TENANT_ID, NANOS_PER_USD,
};
use crate::limits::MAX_RATE;

/// The default fair-turn order of a scope with tenants.
const DEFAULT_FAIRNESS: Fairness = Fairness::Vtc;

/// Most overrides per scope: each is looked up by name per call and shown in status.
const MAX_OVERRIDES: usize = 100_000;

/// Largest accepted `max_tenants`.
const MAX_MAX_TENANTS: i64 = 10_000_000;

/// The largest dollar budget accepted: $1,000,000 a window (n$ stay exact in a
/// Redis script's doubles, which hold integers up to 2^53 ≈ 9 × 10^15).
const MAX_USD: f64 = 1_000_000.0;

/// §19: `[scopes.NAME.tenants]`. An override names a tenant once, takes every key it
/// leaves unset from `default`, and the anonymous tenant has no limit unless
/// `anonymous` sets one.
pub(super) fn validate_tenants(
    scope: &str,
    raw: RawTenants,
    ctx: &Origins,
) -> Result<TenantsConfig, ConfigError> {
    let k = |key: &str| format!("scopes.{scope}.tenants.{key}");
    let fairness = choice(ctx, &k("fairness"), raw.fairness, DEFAULT_FAIRNESS)?;
    let max_tenants = match raw.max_tenants {
        None => DEFAULT_MAX_TENANTS,
        Some(v) if (1..=MAX_MAX_TENANTS).contains(&v) => v as u32,
        Some(v) => {
            return Err(ctx.err(
                &k("max_tenants"),
                v,
                format!("must be between 1 and {MAX_MAX_TENANTS}"),
            ))
        }
    };
    let default = limits(&k("default"), raw.default.unwrap_or_default(), ctx)?;
    let anonymous = limits(&k("anonymous"), raw.anonymous.unwrap_or_default(), ctx)?;
    let raw_overrides = raw.overrides.unwrap_or_default();
    if raw_overrides.len() > MAX_OVERRIDES {
        return Err(ConfigError::Invalid {
            key: k("override"),
            reason: format!("at most {MAX_OVERRIDES} tenant overrides per scope"),
        });
    }
    let mut overrides: Vec<TenantOverride> = Vec::with_capacity(raw_overrides.len());
    let mut seen = std::collections::HashMap::new();
    for (i, o) in raw_overrides.into_iter().enumerate() {
        let at = format!("scopes.{scope}.tenants.override[{i}]");
        let (name, raw_limits) = o.split();
        let name = match name {
            None => {
                return Err(ConfigError::Invalid {
                    key: format!("{at}.name"),
                    reason: "every tenant override needs a name".into(),
                })
            }
            Some(n) if n.is_empty() || n.len() > MAX_TENANT_ID => {
                return Err(ctx.err(
                    &format!("{at}.name"),
                    format_args!("{:?}", crate::limits::echo(&n)),
                    format!(
                        "must be 1 to {MAX_TENANT_ID} bytes (the anonymous tenant's limits \
                         go in scopes.{scope}.tenants.anonymous)"
                    ),
                ))
            }
            Some(n) => n,
        };
        if let Some(j) = seen.insert(name.clone(), i) {
            return Err(ConfigError::Invalid {
                key: format!("{at}.name"),
                reason: format!(
                    "tenant {name:?} is already overridden by \
                     scopes.{scope}.tenants.override[{j}]; each tenant is named once"
                ),
            });
        }
        let limits = limits(&at, raw_limits, ctx)?.or(default);
        overrides.push(TenantOverride { name, limits });
    }
    Ok(TenantsConfig {
        fairness,
        default,
        anonymous,
        overrides,
        max_tenants,
    })
}

/// One limits table (`prefix` = its key path): counts in `1..=MAX_RATE`, dollar
/// budgets finite and of at least one n$, a weight in (0, 10^6].
fn limits(prefix: &str, raw: RawTenantLimits, ctx: &Origins) -> Result<TenantLimits, ConfigError> {
    let k = |key: &str| format!("{prefix}.{key}");
    let usd = |key: &str, v: Option<f64>| -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            // At least one n$ (1e-9 dollars, the ledgers' unit): a smaller amount
            // would round to a budget of nothing, which refuses every priced call.
            Some(d) if d.is_finite() && d * NANOS_PER_USD >= 0.5 && d <= MAX_USD => {
                Ok(Some((d * NANOS_PER_USD).round() as u64))
            }
            Some(d) => Err(ctx.err(
                &k(key),
                d,
                format!(
                    "must be a dollar amount of at least 0.000000001 (one nano-dollar) \
                     and at most {MAX_USD}"
                ),
            )),
        }
    };
    let weight = match raw.weight {
        None => None,
        Some(w) if w.is_finite() && w > 0.0 && w <= 1e6 => Some(w),
        Some(w) => {
            return Err(ctx.err(
                &k("weight"),
                w,
                "must be greater than 0 and at most 1000000 (a tenant of weight 0 would \
                 starve)",
            ))
        }
    };
    Ok(TenantLimits {
        tpm: positive(ctx, &k("tpm"), raw.tpm, MAX_RATE)?,
        rpm: positive(ctx, &k("rpm"), raw.rpm, MAX_RATE)?,
        tpd: positive(ctx, &k("tpd"), raw.tpd, MAX_RATE)?,
        rpd: positive(ctx, &k("rpd"), raw.rpd, MAX_RATE)?,
        usd_per_day: usd("usd_per_day", raw.usd_per_day)?,
        usd_per_month: usd("usd_per_month", raw.usd_per_month)?,
        weight,
    })
}
