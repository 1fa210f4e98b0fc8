//! Environment overrides (§12): `{SCOPE}__{KEY}=value`.
//!
//! `SCOPE` is the scope name uppercased with `-` turned into `_`, or `SIDECAR` for
//! the `[sidecar]` table; `KEY` is the key uppercased, nested tables joined with `__`
//! (`CHAT__BREAKER__COOLDOWN=30s`); a source's keys are reached by its index in the
//! file, `CHAT__SOURCES__0__BURST=1s`. A variable whose prefix is no known scope is
//! ignored (other software uses `__` too); a known prefix with an unknown key fails,
//! listing the keys that can be overridden. One table per target ([`SIDECAR_KEYS`],
//! [`SCOPE_KEYS`]) is both that list and how each value is stored, so a new key is
//! added in one place. An override lands in the raw file before validation, and
//! [`Origins`] remembers where it came from, so a bad value names the variable
//! (`CHAT__CIRCUIT_OPEN=sometimes: expected one of: wait, fail_fast`).
//!
//! Arrays of tables have no override: `[[scopes.X.sources]]` and §15's
//! `[[scopes.X.priorities]]` are written in the file only (an entry has no stable
//! name to spell as a variable); the scope-level `DEFAULT_PRIORITY` and
//! `SATURATION` are overridable like every other scope key.

use std::collections::HashMap;
use std::fmt;

use super::raw::{Ordered, RawFile, RawRate, RawScope, RawSidecar, RawSource};
use super::ConfigError;

/// Where each overridden key's value came from, so errors can name the variable.
#[derive(Default)]
pub(super) struct Origins {
    /// key path → (variable, raw value).
    env_origin: HashMap<String, (String, String)>,
}

impl Origins {
    /// An error for a bad value at `key`; `shown` is the value as TOML would show it.
    pub(super) fn err(
        &self,
        key: &str,
        shown: impl fmt::Display,
        reason: impl Into<String>,
    ) -> ConfigError {
        match self.env_origin.get(key) {
            Some((var, value)) => ConfigError::Env {
                var: var.clone(),
                key: key.into(),
                value: value.clone(),
                reason: reason.into(),
            },
            None => ConfigError::Value {
                key: key.into(),
                value: shown.to_string(),
                line: None,
                reason: reason.into(),
            },
        }
    }

    /// How to name `key` in a message about two keys.
    pub(super) fn label(&self, key: &str) -> String {
        match self.env_origin.get(key) {
            Some((var, _)) => format!("{key} (from {var})"),
            None => key.into(),
        }
    }

    /// `true` when `key` was set from the environment.
    pub(super) fn set_by_env(&self, key: &str) -> bool {
        self.env_origin.contains_key(key)
    }
}

/// Where an override's value goes in a raw table `T`, by the value's TOML type.
enum Slot<T> {
    /// A string key (durations, enumerations, paths, …), stored as written.
    Text(fn(&mut T) -> &mut Option<String>),
    /// An integer key: the value must parse as one.
    Int(fn(&mut T) -> &mut Option<i64>),
    /// A number key: the value must parse as one.
    Float(fn(&mut T) -> &mut Option<f64>),
    /// A list of strings, written comma-separated (empty items dropped).
    List(fn(&mut T) -> &mut Option<Vec<String>>),
    /// A per-minute limit: an integer, or text such as `auto` (§18).
    Rate(fn(&mut T) -> &mut Option<RawRate>),
}

/// Every `SIDECAR__` key, in the order an unknown-key error lists them.
const SIDECAR_KEYS: &[(&str, Slot<RawSidecar>)] = &[
    ("ADMIN_LISTEN", Slot::Text(|s| &mut s.admin_listen)),
    ("SOCKET", Slot::Text(|s| &mut s.socket)),
    ("SOCKET_MODE", Slot::Text(|s| &mut s.socket_mode)),
    ("BACKEND", Slot::Text(|s| &mut s.backend)),
    ("REDIS_URL", Slot::Text(|s| &mut s.redis_url)),
    (
        "REDIS_CLUSTER_NODES",
        Slot::List(|s| &mut s.redis_cluster_nodes),
    ),
    ("KEY_PREFIX", Slot::Text(|s| &mut s.key_prefix)),
    ("ON_BACKEND_ERROR", Slot::Text(|s| &mut s.on_backend_error)),
    ("REDIS_TIMEOUT", Slot::Text(|s| &mut s.redis_timeout)),
    ("MAX_FRAME", Slot::Int(|s| &mut s.max_frame)),
    ("SHUTDOWN_GRACE", Slot::Text(|s| &mut s.shutdown_grace)),
    ("LOG_FORMAT", Slot::Text(|s| &mut s.log_format)),
    ("METRICS_REFRESH", Slot::Text(|s| &mut s.metrics_refresh)),
    (
        "MAX_RATE_LIMIT_BLOCK",
        Slot::Text(|s| &mut s.max_rate_limit_block),
    ),
    ("DEGRADED_SHARE", Slot::Text(|s| &mut s.degraded_share)),
    ("MAX_CONNECTIONS", Slot::Int(|s| &mut s.max_connections)),
    ("IDLE_TIMEOUT", Slot::Text(|s| &mut s.idle_timeout)),
    ("MAX_BUFFERED", Slot::Int(|s| &mut s.max_buffered)),
    ("MAX_WAITERS", Slot::Int(|s| &mut s.max_waiters)),
    ("WORKER_THREADS", Slot::Int(|s| &mut s.worker_threads)),
    ("IDLE_EXIT", Slot::Text(|s| &mut s.idle_exit)),
    (
        "TENANT_METRICS_TOP",
        Slot::Int(|s| &mut s.tenant_metrics_top),
    ),
];

/// Every `{SCOPE}__` key, in the order an unknown-key error lists them.
const SCOPE_KEYS: &[(&str, Slot<RawScope>)] = &[
    ("QUOTA_FULL", Slot::Text(|s| &mut s.quota_full)),
    ("CIRCUIT_OPEN", Slot::Text(|s| &mut s.circuit_open)),
    ("MAX_ATTEMPTS", Slot::Int(|s| &mut s.max_attempts)),
    ("POLL_INTERVAL", Slot::Text(|s| &mut s.poll_interval)),
    ("STALL_WINDOW", Slot::Text(|s| &mut s.stall_window)),
    ("SELECTOR", Slot::Text(|s| &mut s.selector)),
    (
        "BREAKER__FAILURE_THRESHOLD",
        Slot::Int(|s| &mut s.breaker.failure_threshold),
    ),
    (
        "BREAKER__FAILURE_RATE",
        Slot::Float(|s| &mut s.breaker.failure_rate),
    ),
    (
        "BREAKER__MIN_CALLS",
        Slot::Int(|s| &mut s.breaker.min_calls),
    ),
    ("BREAKER__WINDOW", Slot::Text(|s| &mut s.breaker.window)),
    ("BREAKER__COOLDOWN", Slot::Text(|s| &mut s.breaker.cooldown)),
    (
        "BREAKER__MAX_COOLDOWN",
        Slot::Text(|s| &mut s.breaker.max_cooldown),
    ),
    ("PACER__INITIAL", Slot::Float(|s| &mut s.pacer.initial)),
    ("PACER__MIN", Slot::Float(|s| &mut s.pacer.min)),
    ("PACER__MAX", Slot::Float(|s| &mut s.pacer.max)),
    ("PACER__INCREASE", Slot::Float(|s| &mut s.pacer.increase)),
    ("PACER__DECREASE", Slot::Float(|s| &mut s.pacer.decrease)),
    ("DEFAULT_PRIORITY", Slot::Text(|s| &mut s.default_priority)),
    ("SATURATION", Slot::Float(|s| &mut s.saturation)),
];

/// Every `{SCOPE}__SOURCES__{i}__` key (the `i`-th source of the scope, counted
/// from 0 in file order), in the order an unknown-key error lists them.
const SOURCE_KEYS: &[(&str, Slot<RawSource>)] = &[
    ("TPM", Slot::Rate(|s| &mut s.tpm)),
    ("RPM", Slot::Rate(|s| &mut s.rpm)),
    ("EST_TOKENS", Slot::Int(|s| &mut s.est_tokens)),
    ("TIMEOUT", Slot::Text(|s| &mut s.timeout)),
    ("BURST", Slot::Text(|s| &mut s.burst)),
    ("TOKENS_CHARGED", Slot::Text(|s| &mut s.tokens_charged)),
    ("ITPM", Slot::Rate(|s| &mut s.itpm)),
    ("OTPM", Slot::Rate(|s| &mut s.otpm)),
    ("RPD", Slot::Int(|s| &mut s.rpd)),
    ("TPD", Slot::Int(|s| &mut s.tpd)),
    ("EST_OUTPUT_TOKENS", Slot::Int(|s| &mut s.est_output_tokens)),
    ("OBSERVE_LIMITS", Slot::Text(|s| &mut s.observe_limits)),
    ("LEARN_RATE", Slot::Text(|s| &mut s.learn_rate)),
    ("USD_PER_1M_INPUT", Slot::Float(|s| &mut s.usd_per_1m_input)),
    (
        "USD_PER_1M_OUTPUT",
        Slot::Float(|s| &mut s.usd_per_1m_output),
    ),
    (
        "USD_PER_1M_CACHED_INPUT",
        Slot::Float(|s| &mut s.usd_per_1m_cached_input),
    ),
];

/// The environment prefix of a scope: uppercased, `-` → `_`.
pub fn scope_env_prefix(scope: &str) -> String {
    scope.to_uppercase().replace('-', "_")
}

/// Apply every override found in `env` onto `raw`, recording origins in `origins`.
pub(super) fn apply_env(
    raw: &mut RawFile,
    env: impl IntoIterator<Item = (String, String)>,
    origins: &mut Origins,
) -> Result<(), ConfigError> {
    let prefixes: Vec<String> = raw
        .scopes
        .0
        .iter()
        .map(|(name, _)| scope_env_prefix(name))
        .collect();
    check_prefixes(&raw.scopes, &prefixes)?;

    let mut vars: Vec<(String, String)> = env.into_iter().collect();
    vars.sort(); // deterministic: the first bad variable in name order is reported
    for (var, value) in vars {
        // The longest known prefix wins (a scope may itself contain `__`).
        let scope_hit = prefixes
            .iter()
            .enumerate()
            .filter_map(|(i, p)| strip_env_prefix(&var, p).map(|k| (i, p, k)))
            .max_by_key(|(_, p, _)| p.len());
        if let Some(key) = strip_env_prefix(&var, "SIDECAR") {
            let path = format!("sidecar.{}", key.to_lowercase());
            let target = Target {
                var: &var,
                prefix: "SIDECAR",
                key,
                path,
            };
            target.apply(&mut raw.sidecar, SIDECAR_KEYS, value, origins)?;
        } else if let Some((i, prefix, key)) = scope_hit {
            let (name, scope) = &mut raw.scopes.0[i];
            if let Some(rest) = key.strip_prefix("SOURCES__") {
                apply_source(&var, prefix, name, scope, rest, value, origins)?;
                continue;
            }
            let path = format!("scopes.{name}.{}", key.to_lowercase().replace("__", "."));
            let target = Target {
                var: &var,
                prefix,
                key,
                path,
            };
            target.apply(scope, SCOPE_KEYS, value, origins)?;
        }
    }
    Ok(())
}

/// `{SCOPE}__SOURCES__{i}__{KEY}`: `rest` is `{i}__{KEY}`. The source must exist in
/// the file (an override cannot add one).
fn apply_source(
    var: &str,
    prefix: &str,
    scope_name: &str,
    scope: &mut RawScope,
    rest: &str,
    value: String,
    origins: &mut Origins,
) -> Result<(), ConfigError> {
    let sources = scope.sources.get_or_insert_with(Vec::new);
    let (index, key) = rest.split_once("__").unwrap_or((rest, ""));
    let Some(i) = index.parse::<usize>().ok().filter(|i| *i < sources.len()) else {
        return Err(ConfigError::Invalid {
            key: format!("scopes.{scope_name}.sources"),
            reason: format!(
                "{var}: {prefix}__SOURCES__ must be followed by a source index ({} in \
                 the file's order) and __KEY, got {rest:?}",
                match sources.len() {
                    0 | 1 => "0".to_string(),
                    n => format!("0 to {}", n - 1),
                }
            ),
        });
    };
    let target = Target {
        var,
        prefix,
        key,
        path: format!("scopes.{scope_name}.sources[{i}].{}", key.to_lowercase()),
    };
    target.apply(&mut sources[i], SOURCE_KEYS, value, origins)
}

/// One variable, split into what it names.
struct Target<'a> {
    /// The variable (`CHAT__CIRCUIT_OPEN`).
    var: &'a str,
    /// Its prefix (`CHAT`, `SIDECAR`).
    prefix: &'a str,
    /// The key part after the prefix (`CIRCUIT_OPEN`).
    key: &'a str,
    /// The key path it overrides (`scopes.chat.circuit_open`).
    path: String,
}

impl Target<'_> {
    /// Store `value` in `table` where `keys` says, or fail naming the variable.
    fn apply<T>(
        self,
        table: &mut T,
        keys: &[(&str, Slot<T>)],
        value: String,
        origins: &mut Origins,
    ) -> Result<(), ConfigError> {
        let Some((_, slot)) = keys.iter().find(|(k, _)| *k == self.key) else {
            let names: Vec<&str> = keys.iter().map(|(k, _)| *k).collect();
            return Err(ConfigError::UnknownEnvKey {
                var: self.var.into(),
                prefix: self.prefix.into(),
                key: self.key.into(),
                expected: names.join(", "),
            });
        };
        match slot {
            Slot::Text(at) => *at(table) = Some(value.clone()),
            Slot::Int(at) => *at(table) = Some(self.number(&value, "expected an integer")?),
            Slot::Float(at) => *at(table) = Some(self.number(&value, "expected a number")?),
            Slot::Rate(at) => {
                *at(table) = Some(match value.trim().parse::<i64>() {
                    Ok(n) => RawRate::Count(n),
                    Err(_) => RawRate::Text(value.trim().to_string()),
                })
            }
            Slot::List(at) => {
                *at(table) = Some(
                    value
                        .split(',')
                        .map(str::trim)
                        .filter(|n| !n.is_empty())
                        .map(String::from)
                        .collect(),
                )
            }
        }
        origins
            .env_origin
            .insert(self.path, (self.var.into(), value));
        Ok(())
    }

    /// `value` as a number of type `N`, or the error naming the variable.
    fn number<N: std::str::FromStr>(&self, value: &str, expected: &str) -> Result<N, ConfigError> {
        value.trim().parse().map_err(|_| ConfigError::Env {
            var: self.var.into(),
            key: self.path.clone(),
            value: value.into(),
            reason: expected.into(),
        })
    }
}

fn strip_env_prefix<'a>(var: &'a str, prefix: &str) -> Option<&'a str> {
    var.strip_prefix(prefix)?.strip_prefix("__")
}

/// Scope names must be non-empty and map to distinct environment prefixes, none of
/// them `SIDECAR`; otherwise an override would be ambiguous.
fn check_prefixes(scopes: &Ordered<RawScope>, prefixes: &[String]) -> Result<(), ConfigError> {
    for (i, ((name, _), prefix)) in scopes.0.iter().zip(prefixes).enumerate() {
        if name.trim().is_empty() {
            return Err(ConfigError::Invalid {
                key: format!("scopes.{name:?}"),
                reason: "a scope name must not be empty".into(),
            });
        }
        if prefix == "SIDECAR" {
            return Err(ConfigError::Invalid {
                key: format!("scopes.{name}"),
                reason: "the scope name collides with the SIDECAR__ environment prefix".into(),
            });
        }
        if let Some((other, _)) = scopes.0[..i]
            .iter()
            .zip(prefixes)
            .find(|(_, p)| *p == prefix)
            .map(|(s, _)| s)
        {
            return Err(ConfigError::Invalid {
                key: format!("scopes.{other}, scopes.{name}"),
                reason: format!("both scopes map to the environment prefix {prefix}__; rename one"),
            });
        }
    }
    Ok(())
}
