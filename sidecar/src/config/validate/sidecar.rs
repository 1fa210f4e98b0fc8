//! The `[sidecar]` table (§12, §12a): socket and its access lists, backend and Redis
//! addresses, limits on frames, connections and buffering, and the timings of shutdown.

use super::{choice, duration, non_empty, redis_url};
use crate::config::env::Origins;
use crate::config::raw::RawSidecar;
use crate::config::{ConfigError, DegradedShare, IdleExit, SidecarConfig};

/// Smallest accepted `sidecar.max_frame`.
const MIN_MAX_FRAME: u64 = 1024;
/// Largest accepted `sidecar.max_frame` (16 MiB).
const MAX_MAX_FRAME: u64 = 16 * 1024 * 1024;

/// Largest accepted `sidecar.max_connections` (fds are the real bound, checked at
/// start-up against `RLIMIT_NOFILE`).
const MAX_MAX_CONNECTIONS: i64 = 1_000_000;
/// Largest accepted `sidecar.tenant_metrics_top`: a scrape's per-tenant series stay
/// a few thousand at most.
const MAX_TENANT_METRICS_TOP: i64 = 1000;

/// Largest accepted `sidecar.worker_threads`.
const MAX_WORKER_THREADS: i64 = 1024;
/// Accepted `sidecar.max_buffered`: 1 MiB ..= 64 GiB.
const MAX_BUFFERED_RANGE: std::ops::RangeInclusive<i64> = (1 << 20)..=(64 << 30);

/// Largest accepted `sidecar.max_waiters`.
const MAX_MAX_WAITERS: i64 = 100_000_000;

/// Longest socket path the kernel accepts (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

pub(super) fn validate_sidecar(
    raw: RawSidecar,
    ctx: &Origins,
) -> Result<SidecarConfig, ConfigError> {
    let d = SidecarConfig::default();

    // §12: unset, the socket depends on who runs the sidecar (root or not).
    let socket = match raw.socket {
        Some(s) => non_empty(ctx, "sidecar.socket", Some(s), &d.socket)?,
        None => crate::config::default_socket().map_err(|reason| ConfigError::Invalid {
            key: "sidecar.socket".into(),
            reason,
        })?,
    };
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

    let degraded_share = match raw.degraded_share {
        None => d.degraded_share,
        Some(t) if t.trim() == "auto" => DegradedShare::Auto,
        Some(t) => match t.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => DegradedShare::Fraction(f),
            _ => {
                return Err(ctx.err(
                    "sidecar.degraded_share",
                    format_args!("{t:?}"),
                    "expected \"auto\" (1 / the live hosts last seen) or a fraction \
                     greater than 0 and at most 1, such as 0.25",
                ))
            }
        },
    };

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
    let max_waiters = match raw.max_waiters {
        None | Some(0) => d.max_waiters,
        Some(v) if (1..=MAX_MAX_WAITERS).contains(&v) => Some(v as u32),
        Some(v) => {
            return Err(ctx.err(
                "sidecar.max_waiters",
                v,
                format!(
                    "must be between 1 and {MAX_MAX_WAITERS}, or 0 to derive it from the \
                     host's memory"
                ),
            ))
        }
    };
    let worker_threads = match raw.worker_threads {
        None => d.worker_threads,
        Some(0) => None,
        Some(v) if (1..=MAX_WORKER_THREADS).contains(&v) => Some(v as usize),
        Some(v) => {
            return Err(ctx.err(
                "sidecar.worker_threads",
                v,
                format!("must be between 1 and {MAX_WORKER_THREADS}, or 0 for one per core"),
            ))
        }
    };

    // §20: "off", or a positive duration; unset depends on how the process started.
    let idle_exit = match raw.idle_exit {
        None => d.idle_exit,
        Some(s) if s.trim().eq_ignore_ascii_case("off") => IdleExit::Off,
        Some(s) => match humantime::parse_duration(s.trim()) {
            Ok(v) if !v.is_zero() && v <= crate::limits::MAX_CONFIG_DURATION => IdleExit::After(v),
            _ => {
                return Err(ctx.err(
                    "sidecar.idle_exit",
                    format_args!("{s:?}"),
                    "expected \"off\" or a duration greater than zero and at most a year, \
                     such as 30s or 10m",
                ))
            }
        },
    };

    let tenant_metrics_top = match raw.tenant_metrics_top {
        None => d.tenant_metrics_top,
        Some(v) if (0..=MAX_TENANT_METRICS_TOP).contains(&v) => v as u32,
        Some(v) => {
            return Err(ctx.err(
                "sidecar.tenant_metrics_top",
                v,
                format!(
                    "must be between 0 and {MAX_TENANT_METRICS_TOP} (per-tenant metric \
                     families per scope; 0 = totals only)"
                ),
            ))
        }
    };

    Ok(SidecarConfig {
        idle_exit,
        tenant_metrics_top,
        worker_threads,
        max_connections,
        idle_timeout,
        max_buffered,
        max_waiters,
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
        degraded_share,
    })
}
