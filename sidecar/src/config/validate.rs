//! Validation of the raw file (with its environment overrides) into the model
//! (§12a): every default filled in from [`super::model`], every value checked. Each
//! error names the full key path (`scopes.chat.quota_full`) — or the variable that set
//! it — the bad value and, for enumerations, the allowed spellings.

use std::collections::HashMap;
use std::time::Duration;

use super::env::Origins;
use super::raw::{RawBreaker, RawFile, RawPacer, RawPriority, RawScope, RawSidecar, RawSource};
use super::{
    BreakerConfig, Config, ConfigError, PacerConfig, PriorityConfig, ScopeConfig, SidecarConfig,
    SourceConfig, Spelling, DEFAULT_BURST, DEFAULT_CIRCUIT_OPEN, DEFAULT_MAX_ATTEMPTS,
    DEFAULT_POLL_INTERVAL, DEFAULT_QUOTA_FULL, DEFAULT_SATURATION, DEFAULT_SELECTOR,
    DEFAULT_SOURCE_TIMEOUT, DEFAULT_STALL_WINDOW, DEFAULT_TOKENS_CHARGED, MAX_PRIORITIES,
    MAX_PRIORITY_NAME,
};
use crate::limits::{MAX_CONFIG_DURATION, MAX_NAME, MAX_PACER, MAX_RATE, MAX_TOKENS};

/// Smallest accepted `sidecar.max_frame`.
const MIN_MAX_FRAME: u64 = 1024;
/// Largest accepted `sidecar.max_frame` (16 MiB).
const MAX_MAX_FRAME: u64 = 16 * 1024 * 1024;

/// Largest accepted `sidecar.max_connections` (fds are the real bound, checked at
/// start-up against `RLIMIT_NOFILE`).
const MAX_MAX_CONNECTIONS: i64 = 1_000_000;
/// Accepted `sidecar.max_buffered`: 1 MiB ..= 64 GiB.
const MAX_BUFFERED_RANGE: std::ops::RangeInclusive<i64> = (1 << 20)..=(64 << 30);

/// Longest socket path the kernel accepts (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The model from `raw`; `ctx` says which keys came from the environment.
pub(super) fn validate(raw: RawFile, ctx: &Origins) -> Result<Config, ConfigError> {
    let sidecar = validate_sidecar(raw.sidecar, ctx)?;
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
        .map(|(name, scope)| validate_scope(name, scope, ctx))
        .collect::<Result<Vec<_>, _>>()?;
    check_shared_sources(&scopes)?;
    Ok(Config { sidecar, scopes })
}

/// One of the enumeration's spellings (trimmed, any case), else `default`.
fn choice<T: Spelling>(
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
fn duration(
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
fn count(
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
fn positive(
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

fn finite(ctx: &Origins, key: &str, v: f64) -> Result<f64, ConfigError> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ctx.err(key, v, "must be a finite number"))
    }
}

fn non_empty(
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

fn redis_url(ctx: &Origins, key: &str, url: &str) -> Result<(), ConfigError> {
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

fn validate_sidecar(raw: RawSidecar, ctx: &Origins) -> Result<SidecarConfig, ConfigError> {
    let d = SidecarConfig::default();

    let socket = non_empty(ctx, "sidecar.socket", raw.socket, &d.socket)?;
    if socket.len() > MAX_SOCKET_PATH {
        return Err(ctx.err(
            "sidecar.socket",
            format_args!("{socket:?}"),
            format!("a Unix socket path may be at most {MAX_SOCKET_PATH} bytes"),
        ));
    }

    let socket_mode = match raw.socket_mode {
        None => d.socket_mode,
        Some(s) => {
            let digits = s.trim();
            let digits = digits.strip_prefix("0o").unwrap_or(digits);
            match u32::from_str_radix(digits, 8) {
                Ok(m) if !digits.is_empty() && m <= 0o777 => m,
                _ => return Err(ctx.err(
                    "sidecar.socket_mode",
                    format_args!("{s:?}"),
                    "expected an octal file mode between \"0000\" and \"0777\", such as \"0660\"",
                )),
            }
        }
    };

    let backend = choice(ctx, "sidecar.backend", raw.backend, d.backend)?;
    let redis_url_v = non_empty(ctx, "sidecar.redis_url", raw.redis_url, &d.redis_url)?;
    redis_url(ctx, "sidecar.redis_url", &redis_url_v)?;
    let redis_cluster_nodes = raw.redis_cluster_nodes.unwrap_or_default();
    for (i, node) in redis_cluster_nodes.iter().enumerate() {
        // From SIDECAR__REDIS_CLUSTER_NODES the error names the variable.
        let list = "sidecar.redis_cluster_nodes";
        let key = if ctx.set_by_env(list) {
            list.to_string()
        } else {
            format!("{list}[{i}]")
        };
        redis_url(ctx, &key, node)?;
    }

    let key_prefix = non_empty(ctx, "sidecar.key_prefix", raw.key_prefix, &d.key_prefix)?;
    if key_prefix.contains(['{', '}']) {
        return Err(ctx.err(
            "sidecar.key_prefix",
            format_args!("{key_prefix:?}"),
            "must not contain `{` or `}` (the sidecar adds the Redis hash tag itself)",
        ));
    }

    let on_backend_error = choice(
        ctx,
        "sidecar.on_backend_error",
        raw.on_backend_error,
        d.on_backend_error,
    )?;
    let redis_timeout = duration(
        ctx,
        "sidecar.redis_timeout",
        raw.redis_timeout,
        d.redis_timeout,
    )?;
    let shutdown_grace = duration(
        ctx,
        "sidecar.shutdown_grace",
        raw.shutdown_grace,
        d.shutdown_grace,
    )?;
    let max_rate_limit_block = duration(
        ctx,
        "sidecar.max_rate_limit_block",
        raw.max_rate_limit_block,
        d.max_rate_limit_block,
    )?;

    let max_frame = match raw.max_frame {
        None => d.max_frame,
        Some(v) => match u64::try_from(v) {
            Ok(n) if (MIN_MAX_FRAME..=MAX_MAX_FRAME).contains(&n) => n as u32,
            _ => {
                return Err(ctx.err(
                    "sidecar.max_frame",
                    v,
                    format!("must be between {MIN_MAX_FRAME} and {MAX_MAX_FRAME} bytes (16 MiB)"),
                ))
            }
        },
    };

    let admin_listen =
        match raw.admin_listen {
            None => d.admin_listen,
            Some(a) if a.is_empty() => None,
            Some(a) => match a.parse::<std::net::SocketAddr>() {
                Ok(addr) => Some(addr),
                Err(_) => return Err(ctx.err(
                    "sidecar.admin_listen",
                    format_args!("{a:?}"),
                    "must be an IP address and port such as \"127.0.0.1:9464\" (or \"\" for none)",
                )),
            },
        };

    let log_format = choice(ctx, "sidecar.log_format", raw.log_format, d.log_format)?;
    let metrics_refresh = duration(
        ctx,
        "sidecar.metrics_refresh",
        raw.metrics_refresh,
        d.metrics_refresh,
    )?;
    let max_connections = match raw.max_connections {
        None => d.max_connections,
        Some(v) if (1..=MAX_MAX_CONNECTIONS).contains(&v) => Some(v as u32),
        Some(v) => {
            return Err(ctx.err(
                "sidecar.max_connections",
                v,
                format!("must be between 1 and {MAX_MAX_CONNECTIONS}"),
            ))
        }
    };
    let idle_timeout = duration(
        ctx,
        "sidecar.idle_timeout",
        raw.idle_timeout,
        d.idle_timeout,
    )?;
    let max_buffered = match raw.max_buffered {
        None => d.max_buffered,
        Some(v) if MAX_BUFFERED_RANGE.contains(&v) => v as u64,
        Some(v) => {
            return Err(ctx.err(
                "sidecar.max_buffered",
                v,
                format!(
                    "must be between {} (1 MiB) and {} bytes (64 GiB)",
                    MAX_BUFFERED_RANGE.start(),
                    MAX_BUFFERED_RANGE.end()
                ),
            ))
        }
    };

    Ok(SidecarConfig {
        max_connections,
        idle_timeout,
        max_buffered,
        admin_listen,
        log_format,
        metrics_refresh,
        socket,
        socket_mode,
        allowed_uids: raw.allowed_uids.unwrap_or(d.allowed_uids),
        allowed_gids: raw.allowed_gids.unwrap_or(d.allowed_gids),
        admin_uids: raw.admin_uids.unwrap_or(d.admin_uids),
        backend,
        redis_url: redis_url_v,
        redis_cluster_nodes,
        key_prefix,
        on_backend_error,
        redis_timeout,
        max_frame,
        shutdown_grace,
        max_rate_limit_block,
    })
}

fn validate_scope(name: String, raw: RawScope, ctx: &Origins) -> Result<ScopeConfig, ConfigError> {
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

    Ok(ScopeConfig {
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

/// A scope's validated §15 settings.
struct Classes {
    /// The classes, config order.
    priorities: Vec<PriorityConfig>,
    /// Index of the default class.
    default: usize,
    /// Share in use above which reserves apply.
    saturation: f64,
}

/// §15: `[[scopes.NAME.priorities]]`, `default_priority` and `saturation`. Every
/// share is a fraction of one source's capacity; reserves may not promise more than
/// the whole, and a class cannot be capped below what is reserved for it.
fn validate_priorities(
    scope: &str,
    raw: Vec<RawPriority>,
    default_priority: Option<String>,
    saturation: Option<f64>,
    ctx: &Origins,
) -> Result<Classes, ConfigError> {
    let k = |key: &str| format!("scopes.{scope}.{key}");
    let saturation = match saturation {
        None => DEFAULT_SATURATION,
        Some(v) if v.is_finite() && v > 0.0 && v <= 1.0 => v,
        Some(v) => {
            return Err(ctx.err(
                &k("saturation"),
                v,
                "must be in (0, 1]: greater than 0, at most 1",
            ))
        }
    };
    if raw.len() > MAX_PRIORITIES {
        return Err(ConfigError::Invalid {
            key: k("priorities"),
            reason: format!("at most {MAX_PRIORITIES} priority classes per scope"),
        });
    }
    let mut priorities: Vec<PriorityConfig> = Vec::with_capacity(raw.len());
    for (i, p) in raw.into_iter().enumerate() {
        let at = |key: &str| format!("scopes.{scope}.priorities[{i}].{key}");
        let name = match p.name {
            None => {
                return Err(ConfigError::Invalid {
                    key: at("name"),
                    reason: "every priority class needs a name".into(),
                })
            }
            Some(n) => n,
        };
        let valid = !name.is_empty()
            && name.len() <= MAX_PRIORITY_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !valid {
            return Err(ctx.err(
                &at("name"),
                format_args!("{name:?}"),
                format!("must be 1 to {MAX_PRIORITY_NAME} characters of A-Z, a-z, 0-9, `_` or `-`"),
            ));
        }
        if let Some(j) = priorities.iter().position(|c| c.name == name) {
            return Err(ConfigError::Invalid {
                key: at("name"),
                reason: format!(
                    "priority class {name:?} is already declared by \
                     scopes.{scope}.priorities[{j}]; names must be unique within a scope"
                ),
            });
        }
        let weight = match p.weight {
            None => 1.0,
            Some(w) if w.is_finite() && w > 0.0 && w <= 1e6 => w,
            Some(w) => {
                return Err(ctx.err(
                    &at("weight"),
                    w,
                    "must be greater than 0 and at most 1000000 (a class of weight 0 \
                     would starve)",
                ))
            }
        };
        let share = |key: &str, v: f64, low_open: bool| -> Result<f64, ConfigError> {
            let ok = v.is_finite() && v <= 1.0 && if low_open { v > 0.0 } else { v >= 0.0 };
            if ok {
                Ok(v)
            } else if low_open {
                Err(ctx.err(&at(key), v, "must be in (0, 1]: greater than 0, at most 1"))
            } else {
                Err(ctx.err(&at(key), v, "must be in [0, 1]: at least 0, at most 1"))
            }
        };
        let reserve = share("reserve", p.reserve.unwrap_or(0.0), false)?;
        let limit = share("limit", p.limit.unwrap_or(1.0), true)?;
        if limit < reserve {
            return Err(ConfigError::Invalid {
                key: format!("{}, {}", at("limit"), at("reserve")),
                reason: format!(
                    "limit ({limit}) must not be below reserve ({reserve}): the class could \
                     never use what is kept for it"
                ),
            });
        }
        priorities.push(PriorityConfig {
            name,
            weight,
            reserve,
            limit,
        });
    }
    let total: f64 = priorities.iter().map(|p| p.reserve).sum();
    if total > 1.0 + 1e-9 {
        return Err(ConfigError::Invalid {
            key: k("priorities[*].reserve"),
            reason: format!(
                "the reserves sum to {total}, more than 1 (the whole of a source's capacity)"
            ),
        });
    }
    let default = match default_priority {
        None => priorities.len().saturating_sub(1),
        Some(d) => {
            if priorities.is_empty() {
                return Err(ctx.err(
                    &k("default_priority"),
                    format_args!("{d:?}"),
                    format!(
                        "scope {scope:?} declares no priority classes (add \
                         [[scopes.{scope}.priorities]] tables, or remove default_priority)"
                    ),
                ));
            }
            match priorities.iter().position(|p| p.name == d) {
                Some(i) => i,
                None => {
                    let names: Vec<&str> = priorities.iter().map(|p| p.name.as_str()).collect();
                    return Err(ctx.err(
                        &k("default_priority"),
                        format_args!("{d:?}"),
                        format!("expected one of the scope's classes: {}", names.join(", ")),
                    ));
                }
            }
        }
    };
    Ok(Classes {
        priorities,
        default,
        saturation,
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

fn validate_source(
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
    Ok(SourceConfig {
        tpm: positive(ctx, &k("tpm"), raw.tpm, MAX_RATE)?,
        rpm: positive(ctx, &k("rpm"), raw.rpm, MAX_RATE)?,
        est_tokens: positive(ctx, &k("est_tokens"), raw.est_tokens, MAX_TOKENS)?,
        timeout: duration(ctx, &k("timeout"), raw.timeout, DEFAULT_SOURCE_TIMEOUT)?,
        burst,
        tokens_charged: choice(
            ctx,
            &k("tokens_charged"),
            raw.tokens_charged,
            DEFAULT_TOKENS_CHARGED,
        )?,
        itpm: positive(ctx, &k("itpm"), raw.itpm, MAX_RATE)?,
        otpm: positive(ctx, &k("otpm"), raw.otpm, MAX_RATE)?,
        rpd: positive(ctx, &k("rpd"), raw.rpd, MAX_RATE)?,
        tpd: positive(ctx, &k("tpd"), raw.tpd, MAX_RATE)?,
        est_output_tokens: positive(
            ctx,
            &k("est_output_tokens"),
            raw.est_output_tokens,
            MAX_TOKENS,
        )?,
        name,
    })
}

/// §2: a source is one breaker and one quota by its name, so every scope naming it
/// must configure the same quota keys (`tpm`, `rpm` and §7a's `burst`,
/// `tokens_charged`, `itpm`, `otpm`, `rpd`, `tpd`).
fn check_shared_sources(scopes: &[ScopeConfig]) -> Result<(), ConfigError> {
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
fn quota_keys(s: &SourceConfig) -> [(&'static str, Box<str>); 8] {
    let n = |v: Option<u64>| v.map_or_else(|| "unset".into(), |v| v.to_string().into());
    [
        ("tpm", n(s.tpm)),
        ("rpm", n(s.rpm)),
        ("itpm", n(s.itpm)),
        ("otpm", n(s.otpm)),
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
    ]
}
