//! One `[scopes.NAME]` table (§12a): its policy keys, its `[scopes.NAME.breaker]` (§6)
//! and `[scopes.NAME.pacer]` (§8), and the sources and classes it is made of.

use super::priorities::validate_priorities;
use super::source::validate_source;
use super::tenants::validate_tenants;
use super::{choice, count, duration, finite};
use crate::config::env::Origins;
use crate::config::raw::{RawBreaker, RawPacer, RawScope};
use crate::config::{
    BreakerConfig, ConfigError, PacerConfig, ScopeConfig, SourceConfig, DEFAULT_CIRCUIT_OPEN,
    DEFAULT_MAX_ATTEMPTS, DEFAULT_POLL_INTERVAL, DEFAULT_QUOTA_FULL, DEFAULT_SELECTOR,
    DEFAULT_STALL_WINDOW,
};
use crate::limits::{MAX_NAME, MAX_PACER};

pub(super) fn validate_scope(
    name: String,
    raw: RawScope,
    ctx: &Origins,
) -> Result<ScopeConfig, ConfigError> {
    if name.len() > MAX_NAME {
        return Err(ConfigError::Invalid {
            key: format!("scopes.{}", crate::limits::echo(&name)),
            reason: format!("a scope name must be at most {MAX_NAME} bytes"),
        });
    }
    let k = |key: &str| format!("scopes.{name}.{key}");
    let quota_full = choice(ctx, &k("quota_full"), raw.quota_full, DEFAULT_QUOTA_FULL)?;
    let circuit_open = choice(
        ctx,
        &k("circuit_open"),
        raw.circuit_open,
        DEFAULT_CIRCUIT_OPEN,
    )?;
    let max_attempts = count(
        ctx,
        &k("max_attempts"),
        raw.max_attempts,
        DEFAULT_MAX_ATTEMPTS,
        1,
    )?;
    let poll_interval = duration(
        ctx,
        &k("poll_interval"),
        raw.poll_interval,
        DEFAULT_POLL_INTERVAL,
    )?;
    let stall_window = duration(
        ctx,
        &k("stall_window"),
        raw.stall_window,
        DEFAULT_STALL_WINDOW,
    )?;
    let selector = choice(ctx, &k("selector"), raw.selector, DEFAULT_SELECTOR)?;
    let breaker = validate_breaker(&k("breaker"), raw.breaker, ctx)?;
    let pacer = validate_pacer(&k("pacer"), raw.pacer, ctx)?;

    let sources_key = k("sources");
    let raw_sources = raw.sources.unwrap_or_default();
    if raw_sources.is_empty() {
        return Err(ConfigError::Invalid {
            key: sources_key,
            reason: format!(
                "at least one source is required (add a [[scopes.{name}.sources]] table)"
            ),
        });
    }
    let mut sources: Vec<SourceConfig> = Vec::with_capacity(raw_sources.len());
    for (i, src) in raw_sources.into_iter().enumerate() {
        let source = validate_source(&format!("{sources_key}[{i}]"), src, ctx)?;
        if let Some(j) = sources.iter().position(|s| s.name == source.name) {
            return Err(ConfigError::Invalid {
                key: format!("{sources_key}[{i}].name"),
                reason: format!(
                    "source name {:?} is already used by {sources_key}[{j}]; names must be \
                     unique within a scope",
                    source.name
                ),
            });
        }
        sources.push(source);
    }
    let classes = validate_priorities(
        &name,
        raw.priorities.unwrap_or_default(),
        raw.default_priority,
        raw.saturation,
        ctx,
    )?;

    let tenants = raw
        .tenants
        .map(|t| validate_tenants(&name, t, ctx))
        .transpose()?;

    Ok(ScopeConfig {
        tenants,
        priorities: classes.priorities,
        default_priority: classes.default,
        saturation: classes.saturation,
        name,
        quota_full,
        circuit_open,
        max_attempts,
        poll_interval,
        stall_window,
        selector,
        breaker,
        pacer,
        sources,
    })
}

fn validate_breaker(
    prefix: &str,
    raw: RawBreaker,
    ctx: &Origins,
) -> Result<BreakerConfig, ConfigError> {
    let d = BreakerConfig::default();
    let k = |key: &str| format!("{prefix}.{key}");
    let failure_threshold = count(
        ctx,
        &k("failure_threshold"),
        raw.failure_threshold,
        d.failure_threshold,
        1,
    )?;
    let failure_rate = match raw.failure_rate {
        None => d.failure_rate,
        Some(r) if r > 0.0 && r <= 1.0 => r,
        Some(r) => {
            return Err(ctx.err(
                &k("failure_rate"),
                r,
                "must be in (0, 1]: greater than 0, at most 1",
            ))
        }
    };
    let min_calls = count(ctx, &k("min_calls"), raw.min_calls, d.min_calls, 1)?;
    let window = duration(ctx, &k("window"), raw.window, d.window)?;
    let cooldown = duration(ctx, &k("cooldown"), raw.cooldown, d.cooldown)?;
    let max_cooldown = duration(ctx, &k("max_cooldown"), raw.max_cooldown, d.max_cooldown)?;
    if cooldown > max_cooldown {
        return Err(ConfigError::Invalid {
            key: format!(
                "{}, {}",
                ctx.label(&k("cooldown")),
                ctx.label(&k("max_cooldown"))
            ),
            reason: format!(
                "cooldown ({}) must not exceed max_cooldown ({})",
                humantime::format_duration(cooldown),
                humantime::format_duration(max_cooldown)
            ),
        });
    }
    Ok(BreakerConfig {
        failure_threshold,
        failure_rate,
        min_calls,
        window,
        cooldown,
        max_cooldown,
    })
}

fn validate_pacer(prefix: &str, raw: RawPacer, ctx: &Origins) -> Result<PacerConfig, ConfigError> {
    let d = PacerConfig::default();
    let k = |key: &str| format!("{prefix}.{key}");
    let initial = finite(ctx, &k("initial"), raw.initial.unwrap_or(d.initial))?;
    let min = finite(ctx, &k("min"), raw.min.unwrap_or(d.min))?;
    let max = finite(ctx, &k("max"), raw.max.unwrap_or(d.max))?;
    let increase = finite(ctx, &k("increase"), raw.increase.unwrap_or(d.increase))?;
    let decrease = finite(ctx, &k("decrease"), raw.decrease.unwrap_or(d.decrease))?;
    if min < 1.0 {
        return Err(ctx.err(&k("min"), min, "must be at least 1"));
    }
    if !(min <= initial && initial <= max) {
        return Err(ConfigError::Invalid {
            key: format!(
                "{}, {}, {}",
                ctx.label(&k("min")),
                ctx.label(&k("initial")),
                ctx.label(&k("max"))
            ),
            reason: format!(
                "need 1 <= min <= initial <= max, got min = {min}, initial = {initial}, max = {max}"
            ),
        });
    }
    if max > MAX_PACER {
        return Err(ctx.err(&k("max"), max, format!("must be at most {MAX_PACER}")));
    }
    if increase <= 0.0 || increase > MAX_PACER {
        return Err(ctx.err(
            &k("increase"),
            increase,
            format!("must be greater than 0 and at most {MAX_PACER}"),
        ));
    }
    if !(decrease > 0.0 && decrease < 1.0) {
        return Err(ctx.err(
            &k("decrease"),
            decrease,
            "must be in (0, 1): greater than 0, less than 1",
        ));
    }
    Ok(PacerConfig {
        initial,
        min,
        max,
        increase,
        decrease,
    })
}
