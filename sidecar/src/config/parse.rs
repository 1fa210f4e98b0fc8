//! TOML + environment parsing and validation (§12, §12a).
//!
//! Two steps: the file is deserialized into *raw* structs (every key optional,
//! unknown keys rejected), environment overrides are applied onto those, and the
//! result is validated into the [model](super) — every default filled in, every
//! value checked. Each error names the full key path (`scopes.chat.quota_full`),
//! the bad value and, for enumerations, the allowed values; a bad environment
//! override names the variable instead (`CHAT__CIRCUIT_OPEN=sometimes: expected one
//! of: wait, fail_fast`).
//!
//! Environment overrides have the form `{SCOPE}__{KEY}`: `SCOPE` is the scope name
//! uppercased with `-` turned into `_`, or `SIDECAR` for the `[sidecar]` table;
//! `KEY` is the key uppercased, nested tables joined with `__`
//! (`CHAT__BREAKER__COOLDOWN=30s`). A variable whose prefix is no known scope is
//! ignored (other software uses `__` too); a known prefix with an unknown key fails.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use toml::de::{DeTable, DeValue};

use super::{
    BackendKind, BreakerConfig, Config, Mode, OnBackendError, PacerConfig, ScopeConfig, Selector,
    SidecarConfig, SourceConfig, DEFAULT_MAX_ATTEMPTS, DEFAULT_POLL_INTERVAL,
    DEFAULT_SOURCE_TIMEOUT, DEFAULT_STALL_WINDOW,
};

/// The example configuration shipped in `examples/polygate.toml`; the daemon's
/// embedded default when run without `--config`.
pub const EXAMPLE_CONFIG: &str = include_str!("../../../examples/polygate.toml");

/// Default `quota_full` of a scope (§12a).
pub const DEFAULT_QUOTA_FULL: Mode = Mode::Wait;
/// Default `circuit_open` of a scope (§12a).
pub const DEFAULT_CIRCUIT_OPEN: Mode = Mode::FailFast;
/// Default `selector` of a scope (§12a).
pub const DEFAULT_SELECTOR: Selector = Selector::Priority;

/// Smallest accepted `sidecar.max_frame`.
pub const MIN_MAX_FRAME: u64 = 1024;
/// Largest accepted `sidecar.max_frame` (16 MiB).
pub const MAX_MAX_FRAME: u64 = 16 * 1024 * 1024;

/// Longest socket path the kernel accepts (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Why a configuration was rejected. Every variant's message names where the bad
/// value came from: a key path, a `line, column`, or an environment variable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Not valid TOML, an unknown key, or a value of the wrong TOML type.
    #[error("{at}: {message}")]
    Toml {
        /// Key path and/or `line L, column C`.
        at: String,
        /// What the parser said.
        message: String,
    },
    /// A key from the file has a bad value.
    #[error("{key} = {value}: {reason}")]
    Value {
        /// Full key path (`scopes.chat.quota_full`).
        key: String,
        /// The bad value as written.
        value: String,
        /// What is wrong / what is allowed.
        reason: String,
    },
    /// An environment override has a bad value.
    #[error("{var}={value}: {reason}")]
    Env {
        /// The variable (`CHAT__CIRCUIT_OPEN`).
        var: String,
        /// The key path it overrides.
        key: String,
        /// The bad value.
        value: String,
        /// What is wrong / what is allowed.
        reason: String,
    },
    /// An environment variable with a known prefix names no overridable key.
    #[error("{var}: unknown key `{key}` for {prefix}__ overrides; expected one of: {expected}")]
    UnknownEnvKey {
        /// The variable.
        var: String,
        /// Its prefix (`CHAT`, `SIDECAR`).
        prefix: String,
        /// The key part after the prefix.
        key: String,
        /// The keys that can be overridden.
        expected: String,
    },
    /// A structural problem (no scopes, no sources, duplicate names, inconsistent
    /// pair of keys).
    #[error("{key}: {reason}")]
    Invalid {
        /// The key path (or paths) concerned.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// One source configured with different quotas in two scopes.
    #[error(
        "source `{source_name}`: scopes.{first_scope} sets {field} = {} but \
         scopes.{second_scope} sets {field} = {}; a source is one global quota, \
         so every scope naming it must agree",
        show_quota(*.first_value),
        show_quota(*.second_value)
    )]
    SourceConflict {
        /// The source.
        source_name: String,
        /// `tpm` or `rpm`.
        field: &'static str,
        /// The scope that named the source first.
        first_scope: String,
        /// Its value (`None` = unset).
        first_value: Option<u64>,
        /// The scope that disagrees.
        second_scope: String,
        /// Its value (`None` = unset).
        second_value: Option<u64>,
    },
}

fn show_quota(v: Option<u64>) -> String {
    v.map_or_else(|| "unset".into(), |v| v.to_string())
}

/// Reads `path` and parses it with [`parse_str`].
pub fn load_file(
    path: &Path,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_str(&text, env)
}

/// Parses a TOML document, applies the environment overrides found in `env`
/// (usually `std::env::vars()`), and validates the result.
pub fn parse_str(
    toml: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    let mut raw = parse_raw(toml)?;
    let mut ctx = Ctx::default();
    apply_env(&mut raw, env, &mut ctx)?;
    validate(raw, &ctx)
}

// ---------------------------------------------------------------------------------
// Raw structs: the file as written.

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    sidecar: RawSidecar,
    #[serde(default)]
    scopes: Ordered<RawScope>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSidecar {
    socket: Option<String>,
    socket_mode: Option<String>,
    allowed_uids: Option<Vec<u32>>,
    allowed_gids: Option<Vec<u32>>,
    admin_uids: Option<Vec<u32>>,
    backend: Option<String>,
    redis_url: Option<String>,
    redis_cluster_nodes: Option<Vec<String>>,
    key_prefix: Option<String>,
    on_backend_error: Option<String>,
    redis_timeout: Option<String>,
    max_frame: Option<i64>,
    shutdown_grace: Option<String>,
    admin_listen: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawScope {
    quota_full: Option<String>,
    circuit_open: Option<String>,
    max_attempts: Option<i64>,
    poll_interval: Option<String>,
    stall_window: Option<String>,
    selector: Option<String>,
    #[serde(default)]
    breaker: RawBreaker,
    #[serde(default)]
    pacer: RawPacer,
    sources: Option<Vec<RawSource>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    failure_threshold: Option<i64>,
    failure_rate: Option<f64>,
    min_calls: Option<i64>,
    window: Option<String>,
    cooldown: Option<String>,
    max_cooldown: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPacer {
    initial: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    increase: Option<f64>,
    decrease: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    name: Option<String>,
    tpm: Option<i64>,
    rpm: Option<i64>,
    est_tokens: Option<i64>,
    timeout: Option<String>,
}

/// A TOML table kept in document order (scope order matters for status output).
struct Ordered<V>(Vec<(String, V)>);

impl<V> Default for Ordered<V> {
    fn default() -> Self {
        Ordered(Vec::new())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Vis<V> {
            type Value = Ordered<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Ordered(entries))
            }
        }
        d.deserialize_map(Vis(PhantomData))
    }
}

fn parse_raw(text: &str) -> Result<RawFile, ConfigError> {
    // Parse once for spans (syntax errors surface here) and once into the raw
    // structs; a serde error's span is mapped back to the key path it falls in.
    let doc = DeTable::parse(text).map_err(|e| toml_error(text, None, &e))?;
    toml::from_str::<RawFile>(text).map_err(|e| toml_error(text, Some(doc.get_ref()), &e))
}

fn toml_error(text: &str, doc: Option<&DeTable<'_>>, e: &toml::de::Error) -> ConfigError {
    let mut message = e
        .message()
        .trim()
        .replacen("unknown field", "unknown key", 1);
    // Our raw struct names mean nothing to an operator.
    if let Some(i) = message.find("expected struct Raw") {
        message.replace_range(i.., "expected a table");
    }
    let mut at = String::new();
    if let Some(span) = e.span() {
        if let Some(path) = doc.and_then(|d| key_path_at(d, span.start)) {
            message.push_str(type_hint(&path));
            at = path;
        }
        let (line, column) = line_col(text, span.start);
        let loc = format!("line {line}, column {column}");
        at = if at.is_empty() {
            loc
        } else {
            format!("{at} ({loc})")
        };
    }
    if at.is_empty() {
        at = "config".into();
    }
    ConfigError::Toml { at, message }
}

/// A reminder of the expected spelling for keys whose TOML type is easy to get wrong.
fn type_hint(path: &str) -> &'static str {
    const DURATIONS: &[&str] = &[
        "poll_interval",
        "stall_window",
        "window",
        "cooldown",
        "max_cooldown",
        "timeout",
        "redis_timeout",
        "shutdown_grace",
    ];
    let last = path.rsplit('.').next().unwrap_or(path);
    if DURATIONS.contains(&last) {
        " (durations are strings such as \"50ms\", \"30s\" or \"10m\")"
    } else if last == "socket_mode" {
        " (an octal string such as \"0660\")"
    } else {
        ""
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// The dotted path of the deepest key whose key or value contains `pos`.
fn key_path_at(table: &DeTable<'_>, pos: usize) -> Option<String> {
    fn contains(span: Range<usize>, pos: usize) -> bool {
        span.start <= pos && pos < span.end.max(span.start + 1)
    }
    fn walk(value: &DeValue<'_>, path: &str, pos: usize) -> Option<String> {
        match value {
            DeValue::Table(t) => key_path_in(t, path, pos),
            DeValue::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
                let p = format!("{path}[{i}]");
                walk(item.get_ref(), &p, pos).or_else(|| contains(item.span(), pos).then_some(p))
            }),
            _ => None,
        }
    }
    fn key_path_in(table: &DeTable<'_>, prefix: &str, pos: usize) -> Option<String> {
        table.iter().find_map(|(k, v)| {
            let path = if prefix.is_empty() {
                k.get_ref().to_string()
            } else {
                format!("{prefix}.{}", k.get_ref())
            };
            walk(v.get_ref(), &path, pos)
                .or_else(|| (contains(k.span(), pos) || contains(v.span(), pos)).then_some(path))
        })
    }
    key_path_in(table, "", pos)
}

// ---------------------------------------------------------------------------------
// Environment overrides.

/// Where each overridden key's value came from, so errors can name the variable.
#[derive(Default)]
struct Ctx {
    /// key path → (variable, raw value).
    env_origin: HashMap<String, (String, String)>,
}

impl Ctx {
    /// An error for a bad value at `key`; `shown` is the value as TOML would show it.
    fn err(&self, key: &str, shown: impl fmt::Display, reason: impl Into<String>) -> ConfigError {
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
                reason: reason.into(),
            },
        }
    }

    /// How to name `key` in a message about two keys.
    fn label(&self, key: &str) -> String {
        match self.env_origin.get(key) {
            Some((var, _)) => format!("{key} (from {var})"),
            None => key.into(),
        }
    }
}

const SIDECAR_ENV_KEYS: &[&str] = &[
    "ADMIN_LISTEN",
    "SOCKET",
    "SOCKET_MODE",
    "BACKEND",
    "REDIS_URL",
    "REDIS_CLUSTER_NODES",
    "KEY_PREFIX",
    "ON_BACKEND_ERROR",
    "REDIS_TIMEOUT",
    "MAX_FRAME",
    "SHUTDOWN_GRACE",
];

const SCOPE_ENV_KEYS: &[&str] = &[
    "QUOTA_FULL",
    "CIRCUIT_OPEN",
    "MAX_ATTEMPTS",
    "POLL_INTERVAL",
    "STALL_WINDOW",
    "SELECTOR",
    "BREAKER__FAILURE_THRESHOLD",
    "BREAKER__FAILURE_RATE",
    "BREAKER__MIN_CALLS",
    "BREAKER__WINDOW",
    "BREAKER__COOLDOWN",
    "BREAKER__MAX_COOLDOWN",
    "PACER__INITIAL",
    "PACER__MIN",
    "PACER__MAX",
    "PACER__INCREASE",
    "PACER__DECREASE",
];

/// The environment prefix of a scope: uppercased, `-` → `_`.
pub fn scope_env_prefix(scope: &str) -> String {
    scope.to_uppercase().replace('-', "_")
}

fn apply_env(
    raw: &mut RawFile,
    env: impl IntoIterator<Item = (String, String)>,
    ctx: &mut Ctx,
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
            let key = key.to_string();
            apply_sidecar_env(&mut raw.sidecar, &var, &key, value, ctx)?;
        } else if let Some((i, prefix, key)) = scope_hit {
            let (prefix, key) = (prefix.clone(), key.to_string());
            let (name, scope) = &mut raw.scopes.0[i];
            apply_scope_env(scope, name, &prefix, &var, &key, value, ctx)?;
        }
    }
    Ok(())
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

fn env_int(var: &str, key: &str, value: &str) -> Result<i64, ConfigError> {
    value.trim().parse().map_err(|_| ConfigError::Env {
        var: var.into(),
        key: key.into(),
        value: value.into(),
        reason: "expected an integer".into(),
    })
}

fn env_float(var: &str, key: &str, value: &str) -> Result<f64, ConfigError> {
    value.trim().parse().map_err(|_| ConfigError::Env {
        var: var.into(),
        key: key.into(),
        value: value.into(),
        reason: "expected a number".into(),
    })
}

fn apply_sidecar_env(
    s: &mut RawSidecar,
    var: &str,
    key: &str,
    value: String,
    ctx: &mut Ctx,
) -> Result<(), ConfigError> {
    let path = format!("sidecar.{}", key.to_lowercase());
    match key {
        "SOCKET" => s.socket = Some(value.clone()),
        "SOCKET_MODE" => s.socket_mode = Some(value.clone()),
        "BACKEND" => s.backend = Some(value.clone()),
        "REDIS_URL" => s.redis_url = Some(value.clone()),
        "REDIS_CLUSTER_NODES" => {
            s.redis_cluster_nodes = Some(
                value
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(String::from)
                    .collect(),
            )
        }
        "KEY_PREFIX" => s.key_prefix = Some(value.clone()),
        "ON_BACKEND_ERROR" => s.on_backend_error = Some(value.clone()),
        "REDIS_TIMEOUT" => s.redis_timeout = Some(value.clone()),
        "MAX_FRAME" => s.max_frame = Some(env_int(var, &path, &value)?),
        "SHUTDOWN_GRACE" => s.shutdown_grace = Some(value.clone()),
        "ADMIN_LISTEN" => s.admin_listen = Some(value.clone()),
        _ => return Err(unknown_env_key(var, "SIDECAR", key, SIDECAR_ENV_KEYS)),
    }
    ctx.env_origin.insert(path, (var.into(), value));
    Ok(())
}

fn apply_scope_env(
    s: &mut RawScope,
    scope: &str,
    prefix: &str,
    var: &str,
    key: &str,
    value: String,
    ctx: &mut Ctx,
) -> Result<(), ConfigError> {
    let path = format!("scopes.{scope}.{}", key.to_lowercase().replace("__", "."));
    let int = || env_int(var, &path, &value);
    let float = || env_float(var, &path, &value);
    match key {
        "QUOTA_FULL" => s.quota_full = Some(value.clone()),
        "CIRCUIT_OPEN" => s.circuit_open = Some(value.clone()),
        "MAX_ATTEMPTS" => s.max_attempts = Some(int()?),
        "POLL_INTERVAL" => s.poll_interval = Some(value.clone()),
        "STALL_WINDOW" => s.stall_window = Some(value.clone()),
        "SELECTOR" => s.selector = Some(value.clone()),
        "BREAKER__FAILURE_THRESHOLD" => s.breaker.failure_threshold = Some(int()?),
        "BREAKER__FAILURE_RATE" => s.breaker.failure_rate = Some(float()?),
        "BREAKER__MIN_CALLS" => s.breaker.min_calls = Some(int()?),
        "BREAKER__WINDOW" => s.breaker.window = Some(value.clone()),
        "BREAKER__COOLDOWN" => s.breaker.cooldown = Some(value.clone()),
        "BREAKER__MAX_COOLDOWN" => s.breaker.max_cooldown = Some(value.clone()),
        "PACER__INITIAL" => s.pacer.initial = Some(float()?),
        "PACER__MIN" => s.pacer.min = Some(float()?),
        "PACER__MAX" => s.pacer.max = Some(float()?),
        "PACER__INCREASE" => s.pacer.increase = Some(float()?),
        "PACER__DECREASE" => s.pacer.decrease = Some(float()?),
        _ => return Err(unknown_env_key(var, prefix, key, SCOPE_ENV_KEYS)),
    }
    ctx.env_origin.insert(path, (var.into(), value));
    Ok(())
}

fn unknown_env_key(var: &str, prefix: &str, key: &str, allowed: &[&str]) -> ConfigError {
    ConfigError::UnknownEnvKey {
        var: var.into(),
        prefix: prefix.into(),
        key: key.into(),
        expected: allowed.join(", "),
    }
}

// ---------------------------------------------------------------------------------
// Validation into the model.

fn validate(raw: RawFile, ctx: &Ctx) -> Result<Config, ConfigError> {
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

const MODES: &[(&str, Mode)] = &[("wait", Mode::Wait), ("fail_fast", Mode::FailFast)];
const SELECTORS: &[(&str, Selector)] = &[
    ("priority", Selector::Priority),
    ("health", Selector::Health),
];
const BACKENDS: &[(&str, BackendKind)] = &[
    ("memory", BackendKind::Memory),
    ("redis", BackendKind::Redis),
];
const ON_BACKEND_ERRORS: &[(&str, OnBackendError)] = &[
    ("local", OnBackendError::Local),
    ("fail_closed", OnBackendError::FailClosed),
];

fn choice<T: Copy>(
    ctx: &Ctx,
    key: &str,
    raw: Option<String>,
    default: T,
    allowed: &[(&str, T)],
) -> Result<T, ConfigError> {
    let Some(raw) = raw else { return Ok(default) };
    let wanted = raw.trim().to_ascii_lowercase();
    allowed
        .iter()
        .find(|(name, _)| *name == wanted)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
            ctx.err(
                key,
                format_args!("{raw:?}"),
                format!("expected one of: {}", names.join(", ")),
            )
        })
}

/// A humantime duration, strictly positive.
fn duration(
    ctx: &Ctx,
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
    Ok(d)
}

/// An integer ≥ `min` that fits in a `u32`.
fn count(
    ctx: &Ctx,
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

/// An optional integer that must be > 0 when set.
fn positive(ctx: &Ctx, key: &str, raw: Option<i64>) -> Result<Option<u64>, ConfigError> {
    match raw {
        None => Ok(None),
        Some(v) if v > 0 => Ok(Some(v.unsigned_abs())),
        Some(v) => Err(ctx.err(key, v, "must be greater than zero when set")),
    }
}

fn finite(ctx: &Ctx, key: &str, v: f64) -> Result<f64, ConfigError> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ctx.err(key, v, "must be a finite number"))
    }
}

fn non_empty(
    ctx: &Ctx,
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

fn redis_url(ctx: &Ctx, key: &str, url: &str) -> Result<(), ConfigError> {
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

fn validate_sidecar(raw: RawSidecar, ctx: &Ctx) -> Result<SidecarConfig, ConfigError> {
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

    let backend = choice(ctx, "sidecar.backend", raw.backend, d.backend, BACKENDS)?;
    let redis_url_v = non_empty(ctx, "sidecar.redis_url", raw.redis_url, &d.redis_url)?;
    redis_url(ctx, "sidecar.redis_url", &redis_url_v)?;
    let redis_cluster_nodes = raw.redis_cluster_nodes.unwrap_or_default();
    for (i, node) in redis_cluster_nodes.iter().enumerate() {
        // From SIDECAR__REDIS_CLUSTER_NODES the error names the variable.
        let list = "sidecar.redis_cluster_nodes";
        let key = if ctx.env_origin.contains_key(list) {
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
        ON_BACKEND_ERRORS,
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

    Ok(SidecarConfig {
        admin_listen,
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
    })
}

fn validate_scope(name: String, raw: RawScope, ctx: &Ctx) -> Result<ScopeConfig, ConfigError> {
    let k = |key: &str| format!("scopes.{name}.{key}");
    let quota_full = choice(
        ctx,
        &k("quota_full"),
        raw.quota_full,
        DEFAULT_QUOTA_FULL,
        MODES,
    )?;
    let circuit_open = choice(
        ctx,
        &k("circuit_open"),
        raw.circuit_open,
        DEFAULT_CIRCUIT_OPEN,
        MODES,
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
    let selector = choice(
        ctx,
        &k("selector"),
        raw.selector,
        DEFAULT_SELECTOR,
        SELECTORS,
    )?;
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

    Ok(ScopeConfig {
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
    ctx: &Ctx,
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

fn validate_pacer(prefix: &str, raw: RawPacer, ctx: &Ctx) -> Result<PacerConfig, ConfigError> {
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
    if increase <= 0.0 {
        return Err(ctx.err(&k("increase"), increase, "must be greater than 0"));
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

fn validate_source(prefix: &str, raw: RawSource, ctx: &Ctx) -> Result<SourceConfig, ConfigError> {
    let k = |key: &str| format!("{prefix}.{key}");
    let name = match raw.name {
        Some(n) if !n.trim().is_empty() => n,
        Some(_) => return Err(ctx.err(&k("name"), "\"\"", "must not be empty")),
        None => {
            return Err(ConfigError::Invalid {
                key: k("name"),
                reason: "every source needs a name".into(),
            })
        }
    };
    Ok(SourceConfig {
        tpm: positive(ctx, &k("tpm"), raw.tpm)?,
        rpm: positive(ctx, &k("rpm"), raw.rpm)?,
        est_tokens: positive(ctx, &k("est_tokens"), raw.est_tokens)?,
        timeout: duration(ctx, &k("timeout"), raw.timeout, DEFAULT_SOURCE_TIMEOUT)?,
        name,
    })
}

/// §2: a source is one breaker and one quota by its name, so every scope naming it
/// must configure the same `tpm` and `rpm`.
fn check_shared_sources(scopes: &[ScopeConfig]) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, (&str, &SourceConfig)> = HashMap::new();
    for scope in scopes {
        for src in &scope.sources {
            let Some((first_scope, first)) = seen.get(src.name.as_str()).copied() else {
                seen.insert(&src.name, (&scope.name, src));
                continue;
            };
            for (field, a, b) in [("tpm", first.tpm, src.tpm), ("rpm", first.rpm, src.rpm)] {
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
