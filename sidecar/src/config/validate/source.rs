//! One `[[scopes.NAME.sources]]` entry (§12a) with §7a's quota keys (`burst`,
//! `tokens_charged`, `itpm`, `otpm`, `rpd`, `tpd`), and §2's rule that every scope
//! naming a source configures its one quota alike.

use std::collections::HashMap;

use super::{choice, duration, positive};
use crate::config::env::Origins;
use crate::config::raw::{RawRate, RawSource};
use crate::config::{
    ConfigError, ScopeConfig, SourceConfig, DEFAULT_BURST, DEFAULT_LEARN_RATE,
    DEFAULT_OBSERVE_LIMITS, DEFAULT_SOURCE_TIMEOUT, DEFAULT_TOKENS_CHARGED,
};
use crate::limits::{MAX_NAME, MAX_RATE, MAX_TOKENS};

pub(super) fn validate_source(
    prefix: &str,
    raw: RawSource,
    ctx: &Origins,
) -> Result<SourceConfig, ConfigError> {
    let k = |key: &str| format!("{prefix}.{key}");
    let name = match raw.name {
        Some(n) if n.len() > MAX_NAME => {
            return Err(ctx.err(
                &k("name"),
                format_args!("{:?}", crate::limits::echo(&n)),
                format!("must be at most {MAX_NAME} bytes"),
            ))
        }
        Some(n) if !n.trim().is_empty() => n,
        Some(_) => return Err(ctx.err(&k("name"), "\"\"", "must not be empty")),
        None => {
            return Err(ConfigError::Invalid {
                key: k("name"),
                reason: "every source needs a name".into(),
            })
        }
    };
    let burst = duration(ctx, &k("burst"), raw.burst.clone(), DEFAULT_BURST)?;
    if burst > DEFAULT_BURST {
        return Err(ctx.err(
            &k("burst"),
            format_args!("{:?}", raw.burst.unwrap_or_default()),
            "must be at most 60s: a per-minute bucket never holds more than a minute's worth",
        ));
    }
    // §18: `"auto"` learns a per-minute limit from the provider (bits in tpm, rpm,
    // itpm, otpm order, as the quota's buckets).
    let mut auto = 0u8;
    let mut rate = |bit: u8, key: &str, v: Option<RawRate>| -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(RawRate::Count(n)) => positive(ctx, &k(key), Some(n), MAX_RATE),
            Some(RawRate::Text(t)) if t.trim().eq_ignore_ascii_case("auto") => {
                auto |= 1 << bit;
                Ok(None)
            }
            Some(RawRate::Text(t)) => Err(ctx.err(
                &k(key),
                format_args!("{:?}", crate::limits::echo(&t)),
                "expected a positive integer or \"auto\"",
            )),
        }
    };
    let tpm = rate(0, "tpm", raw.tpm)?;
    let rpm = rate(1, "rpm", raw.rpm)?;
    let itpm = rate(2, "itpm", raw.itpm)?;
    let otpm = rate(3, "otpm", raw.otpm)?;
    Ok(SourceConfig {
        tpm,
        rpm,
        est_tokens: positive(ctx, &k("est_tokens"), raw.est_tokens, MAX_TOKENS)?,
        timeout: duration(ctx, &k("timeout"), raw.timeout, DEFAULT_SOURCE_TIMEOUT)?,
        burst,
        tokens_charged: choice(
            ctx,
            &k("tokens_charged"),
            raw.tokens_charged,
            DEFAULT_TOKENS_CHARGED,
        )?,
        itpm,
        otpm,
        rpd: positive(ctx, &k("rpd"), raw.rpd, MAX_RATE)?,
        tpd: positive(ctx, &k("tpd"), raw.tpd, MAX_RATE)?,
        est_output_tokens: positive(
            ctx,
            &k("est_output_tokens"),
            raw.est_output_tokens,
            MAX_TOKENS,
        )?,
        observe_limits: choice(
            ctx,
            &k("observe_limits"),
            raw.observe_limits,
            DEFAULT_OBSERVE_LIMITS,
        )?,
        learn_rate: choice(ctx, &k("learn_rate"), raw.learn_rate, DEFAULT_LEARN_RATE)?,
        auto,
        usd_per_1m_input: price(ctx, &k("usd_per_1m_input"), raw.usd_per_1m_input)?,
        usd_per_1m_output: price(ctx, &k("usd_per_1m_output"), raw.usd_per_1m_output)?,
        usd_per_1m_cached_input: price(
            ctx,
            &k("usd_per_1m_cached_input"),
            raw.usd_per_1m_cached_input,
        )?,
        name,
    })
}

/// §19: a price in dollars per million tokens: finite, at least 0, at most
/// [`MAX_PRICE`].
fn price(ctx: &Origins, key: &str, v: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match v {
        None => Ok(None),
        Some(p) if p.is_finite() && (0.0..=MAX_PRICE).contains(&p) => Ok(Some(p)),
        Some(p) => Err(ctx.err(
            key,
            p,
            format!("must be a price in dollars per million tokens, from 0 to {MAX_PRICE}"),
        )),
    }
}

/// The highest price per million tokens accepted (a typo guard: the dearest models
/// cost a few hundred dollars per million tokens).
const MAX_PRICE: f64 = 100_000.0;

/// §2: a source is one breaker and one quota by its name, so every scope naming it
/// must configure the same quota keys (`tpm`, `rpm` and §7a's `burst`,
/// `tokens_charged`, `itpm`, `otpm`, `rpd`, `tpd`) and the same prices (§19: one
/// deployment has one price).
pub(super) fn check_shared_sources(scopes: &[ScopeConfig]) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, (&str, &SourceConfig)> = HashMap::new();
    for scope in scopes {
        for src in &scope.sources {
            let Some((first_scope, first)) = seen.get(src.name.as_str()).copied() else {
                seen.insert(&src.name, (&scope.name, src));
                continue;
            };
            for (field, a, b) in quota_keys(first)
                .into_iter()
                .zip(quota_keys(src))
                .map(|((field, a), (_, b))| (field, a, b))
            {
                if a != b {
                    return Err(ConfigError::SourceConflict {
                        source_name: src.name.clone(),
                        field,
                        first_scope: first_scope.into(),
                        first_value: a,
                        second_scope: scope.name.clone(),
                        second_value: b,
                    });
                }
            }
        }
    }
    Ok(())
}

/// The keys of a source that make up its one global quota, each as its value shows.
pub(super) fn quota_keys(s: &SourceConfig) -> [(&'static str, Box<str>); 13] {
    let n = |v: Option<u64>| v.map_or_else(|| "unset".into(), |v| v.to_string().into());
    let usd =
        |v: Option<f64>| -> Box<str> { v.map_or_else(|| "unset".into(), |v| v.to_string().into()) };
    let r = |bit: u8, v: Option<u64>| -> Box<str> {
        if s.auto & (1 << bit) != 0 {
            "\"auto\"".into()
        } else {
            n(v)
        }
    };
    [
        ("tpm", r(0, s.tpm)),
        ("rpm", r(1, s.rpm)),
        ("itpm", r(2, s.itpm)),
        ("otpm", r(3, s.otpm)),
        ("rpd", n(s.rpd)),
        ("tpd", n(s.tpd)),
        (
            "burst",
            format!("{:?}", humantime::format_duration(s.burst).to_string()).into(),
        ),
        (
            "tokens_charged",
            format!("{:?}", s.tokens_charged.as_str()).into(),
        ),
        (
            "observe_limits",
            format!("{:?}", s.observe_limits.as_str()).into(),
        ),
        ("learn_rate", format!("{:?}", s.learn_rate.as_str()).into()),
        ("usd_per_1m_input", usd(s.usd_per_1m_input)),
        ("usd_per_1m_output", usd(s.usd_per_1m_output)),
        ("usd_per_1m_cached_input", usd(s.usd_per_1m_cached_input)),
    ]
}
