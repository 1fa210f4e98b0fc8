//! Validation of the raw file (with its environment overrides) into the model
//! (§12a): every default filled in from [`crate::config::model`], every value checked.
//! Each error names the full key path (`scopes.chat.quota_full`) — or the variable that
//! set it — the bad value and, for enumerations, the allowed spellings.
//!
//! One submodule per table of the §12a shape: [`sidecar`] (`[sidecar]`), [`scope`]
//! (`[scopes.NAME]` with its breaker and pacer), [`priorities`] (§15's
//! `[[scopes.NAME.priorities]]`), [`tenants`] (§19's `[scopes.NAME.tenants]`) and
//! [`source`] (`[[scopes.NAME.sources]]`, §7a's quota keys, §19's prices, and §2's
//! rule that a shared source is configured alike). This module holds the
//! entry point and the shared checks that name the bad key.

mod priorities;
mod scope;
mod sidecar;
mod source;
mod tenants;

use std::time::Duration;

use super::env::Origins;
use super::raw::RawFile;
use super::{Config, ConfigError, Spelling};
use crate::limits::MAX_CONFIG_DURATION;

/// The model from `raw`; `ctx` says which keys came from the environment.
pub(super) fn validate(raw: RawFile, ctx: &Origins) -> Result<Config, ConfigError> {
    let sidecar = sidecar::validate_sidecar(raw.sidecar, ctx)?;
    if raw.scopes.0.is_empty() {
        return Err(ConfigError::Invalid {
            key: "scopes".into(),
            reason: "at least one scope is required (add a [scopes.NAME] table with \
                     [[scopes.NAME.sources]])"
                .into(),
        });
    }
    let scopes = raw
        .scopes
        .0
        .into_iter()
        .map(|(name, scope)| scope::validate_scope(name, scope, ctx))
        .collect::<Result<Vec<_>, _>>()?;
    source::check_shared_sources(&scopes)?;
    Ok(Config { sidecar, scopes })
}

/// One of the enumeration's spellings (trimmed, any case), else `default`.
pub(super) fn choice<T: Spelling>(
    ctx: &Origins,
    key: &str,
    raw: Option<String>,
    default: T,
) -> Result<T, ConfigError> {
    let Some(raw) = raw else { return Ok(default) };
    T::parse(&raw.trim().to_ascii_lowercase()).ok_or_else(|| {
        ctx.err(
            key,
            format_args!("{raw:?}"),
            format!("expected one of: {}", T::allowed()),
        )
    })
}

/// A humantime duration, strictly positive.
pub(super) fn duration(
    ctx: &Origins,
    key: &str,
    raw: Option<String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let Some(raw) = raw else { return Ok(default) };
    let d = humantime::parse_duration(raw.trim()).map_err(|e| {
        ctx.err(
            key,
            format_args!("{raw:?}"),
            format!("expected a duration such as 50ms, 30s or 10m ({e})"),
        )
    })?;
    if d.is_zero() {
        return Err(ctx.err(key, format_args!("{raw:?}"), "must be greater than zero"));
    }
    if d > MAX_CONFIG_DURATION {
        return Err(ctx.err(
            key,
            format_args!("{raw:?}"),
            format!(
                "must be at most {} (a year)",
                humantime::format_duration(MAX_CONFIG_DURATION)
            ),
        ));
    }
    Ok(d)
}

/// An integer ≥ `min` that fits in a `u32`.
pub(super) fn count(
    ctx: &Origins,
    key: &str,
    raw: Option<i64>,
    default: u32,
    min: u32,
) -> Result<u32, ConfigError> {
    let Some(v) = raw else { return Ok(default) };
    if v < i64::from(min) {
        return Err(ctx.err(key, v, format!("must be at least {min}")));
    }
    u32::try_from(v).map_err(|_| ctx.err(key, v, format!("must be at most {}", u32::MAX)))
}

/// An optional integer that must be in `1..=max` when set.
pub(super) fn positive(
    ctx: &Origins,
    key: &str,
    raw: Option<i64>,
    max: u64,
) -> Result<Option<u64>, ConfigError> {
    match raw {
        None => Ok(None),
        Some(v) if v > 0 && v.unsigned_abs() <= max => Ok(Some(v.unsigned_abs())),
        Some(v) if v > 0 => Err(ctx.err(key, v, format!("must be at most {max}"))),
        Some(v) => Err(ctx.err(key, v, "must be greater than zero when set")),
    }
}

pub(super) fn finite(ctx: &Origins, key: &str, v: f64) -> Result<f64, ConfigError> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ctx.err(key, v, "must be a finite number"))
    }
}

pub(super) fn non_empty(
    ctx: &Origins,
    key: &str,
    raw: Option<String>,
    default: &str,
) -> Result<String, ConfigError> {
    match raw {
        None => Ok(default.into()),
        Some(s) if s.trim().is_empty() => Err(ctx.err(key, "\"\"", "must not be empty")),
        Some(s) => Ok(s),
    }
}

pub(super) fn redis_url(ctx: &Origins, key: &str, url: &str) -> Result<(), ConfigError> {
    const SCHEMES: &[&str] = &["redis://", "rediss://", "redis+unix://", "unix://"];
    if SCHEMES.iter().any(|s| url.starts_with(s)) && url.len() > url.find("://").unwrap_or(0) + 3 {
        Ok(())
    } else {
        Err(ctx.err(
            key,
            format_args!("{url:?}"),
            format!(
                "expected a URL starting with one of: {}",
                SCHEMES.join(", ")
            ),
        ))
    }
}
