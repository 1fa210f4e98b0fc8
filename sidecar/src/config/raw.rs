//! The configuration file as written (§12a): every key optional, unknown keys
//! rejected, scopes in document order. Environment overrides ([`super::env`]) are
//! applied onto these structs, and [`super::validate`] turns them into the model.
//! TOML errors are mapped back to the key path they fall in.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use toml::de::{DeTable, DeValue};

use super::ConfigError;

/// The whole file.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    /// `[sidecar]`.
    #[serde(default)]
    pub sidecar: RawSidecar,
    /// `[scopes.NAME]`, in document order.
    #[serde(default)]
    pub scopes: Ordered<RawScope>,
}

/// `[sidecar]` as written; see [`SidecarConfig`](super::SidecarConfig) for meanings.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSidecar {
    /// Unix socket path.
    pub socket: Option<String>,
    /// Octal file mode, as a string (`"0660"`).
    pub socket_mode: Option<String>,
    /// Peer uids allowed to connect.
    pub allowed_uids: Option<Vec<u32>>,
    /// Peer gids allowed to connect.
    pub allowed_gids: Option<Vec<u32>>,
    /// Peer uids allowed to send admin requests.
    pub admin_uids: Option<Vec<u32>>,
    /// `memory` | `redis`.
    pub backend: Option<String>,
    /// Single-node Redis URL.
    pub redis_url: Option<String>,
    /// Redis Cluster seed nodes.
    pub redis_cluster_nodes: Option<Vec<String>>,
    /// Key prefix inside the hash tag.
    pub key_prefix: Option<String>,
    /// `local` | `fail_closed`.
    pub on_backend_error: Option<String>,
    /// Redis timeout, a duration string.
    pub redis_timeout: Option<String>,
    /// Largest frame payload; signed so a negative value is reported, not a type error.
    pub max_frame: Option<i64>,
    /// SIGTERM drain bound, a duration string.
    pub shutdown_grace: Option<String>,
    /// Admin HTTP address (`""` = none).
    pub admin_listen: Option<String>,
    /// `text` | `json`.
    pub log_format: Option<String>,
    /// Duration string: background refresh of the metrics' shared state.
    pub metrics_refresh: Option<String>,
    /// Cap of a 429's quota block, a duration string.
    pub max_rate_limit_block: Option<String>,
    /// `"auto"` or a fraction; a number is kept as its text (validation parses it).
    #[serde(default, deserialize_with = "text_or_number")]
    pub degraded_share: Option<String>,
    /// Connection cap; signed so a negative value is reported by key.
    pub max_connections: Option<i64>,
    /// Idle connection timeout, a duration string.
    pub idle_timeout: Option<String>,
    /// Global buffer budget in bytes; signed so a negative value is reported by key.
    pub max_buffered: Option<i64>,
    /// Sidecar-wide cap on waiting requests (0 = derived from memory); signed so a
    /// negative value is reported by key.
    pub max_waiters: Option<i64>,
    /// Runtime threads; signed so a negative value is reported by key.
    pub worker_threads: Option<i64>,
    /// §20: `"off"` or a duration string: exit after this long without a connection.
    pub idle_exit: Option<String>,
    /// §19: per-tenant metric families for this many tenants per scope.
    pub tenant_metrics_top: Option<i64>,
}

/// A key that is a string or a number (`degraded_share = "auto"` or `= 0.25`), kept
/// as text so that the environment's override (always text) takes the same path.
fn text_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum TextOrNumber {
        Text(String),
        Int(i64),
        Float(f64),
    }
    Ok(Some(match TextOrNumber::deserialize(d)? {
        TextOrNumber::Text(t) => t,
        TextOrNumber::Int(n) => n.to_string(),
        TextOrNumber::Float(f) => f.to_string(),
    }))
}

/// `[scopes.NAME]` as written; see [`ScopeConfig`](super::ScopeConfig).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawScope {
    /// `wait` | `fail_fast`.
    pub quota_full: Option<String>,
    /// `wait` | `fail_fast`.
    pub circuit_open: Option<String>,
    /// Attempts per call; signed so a negative value is reported by key.
    pub max_attempts: Option<i64>,
    /// Duration string.
    pub poll_interval: Option<String>,
    /// Duration string.
    pub stall_window: Option<String>,
    /// `priority` | `health`.
    pub selector: Option<String>,
    /// `[scopes.NAME.breaker]`.
    #[serde(default)]
    pub breaker: RawBreaker,
    /// `[scopes.NAME.pacer]`.
    #[serde(default)]
    pub pacer: RawPacer,
    /// `[[scopes.NAME.sources]]`; required (validation says so by key).
    pub sources: Option<Vec<RawSource>>,
    /// §15: the class of a call that names none.
    pub default_priority: Option<String>,
    /// §15: share in use above which reserves apply.
    pub saturation: Option<f64>,
    /// `[[scopes.NAME.priorities]]` (§15).
    pub priorities: Option<Vec<RawPriority>>,
    /// `[scopes.NAME.tenants]` (§19).
    pub tenants: Option<RawTenants>,
}

/// `[scopes.NAME.tenants]` as written; see [`TenantsConfig`](super::TenantsConfig).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenants {
    /// `vtc` | `fifo`.
    pub fairness: Option<String>,
    /// Limits of every tenant no override names.
    pub default: Option<RawTenantLimits>,
    /// Limits of the calls that name no tenant.
    pub anonymous: Option<RawTenantLimits>,
    /// `[[scopes.NAME.tenants.override]]`.
    #[serde(rename = "override")]
    pub overrides: Option<Vec<RawTenantOverride>>,
    /// Most tenants tracked at once; signed so a negative value is reported by key.
    pub max_tenants: Option<i64>,
}

/// A tenant's limits as written (`default = {…}`, `anonymous = {…}`); see
/// [`TenantLimits`](super::TenantLimits).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenantLimits {
    /// Tokens per minute.
    pub tpm: Option<i64>,
    /// Requests per minute.
    pub rpm: Option<i64>,
    /// Tokens per day.
    pub tpd: Option<i64>,
    /// Requests per day.
    pub rpd: Option<i64>,
    /// Dollars per UTC day.
    pub usd_per_day: Option<f64>,
    /// Dollars per UTC month.
    pub usd_per_month: Option<f64>,
    /// Share of fair turns.
    pub weight: Option<f64>,
}

/// `[[scopes.NAME.tenants.override]]` as written: a name and the keys of
/// [`RawTenantLimits`] (spelled out: `deny_unknown_fields` does not combine with
/// `flatten`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenantOverride {
    /// Required; validation says so by key.
    pub name: Option<String>,
    /// Tokens per minute.
    pub tpm: Option<i64>,
    /// Requests per minute.
    pub rpm: Option<i64>,
    /// Tokens per day.
    pub tpd: Option<i64>,
    /// Requests per day.
    pub rpd: Option<i64>,
    /// Dollars per UTC day.
    pub usd_per_day: Option<f64>,
    /// Dollars per UTC month.
    pub usd_per_month: Option<f64>,
    /// Share of fair turns.
    pub weight: Option<f64>,
}

impl RawTenantOverride {
    /// The name and the limits, as a limits table.
    pub(super) fn split(self) -> (Option<String>, RawTenantLimits) {
        let RawTenantOverride {
            name,
            tpm,
            rpm,
            tpd,
            rpd,
            usd_per_day,
            usd_per_month,
            weight,
        } = self;
        (
            name,
            RawTenantLimits {
                tpm,
                rpm,
                tpd,
                rpd,
                usd_per_day,
                usd_per_month,
                weight,
            },
        )
    }
}

/// `[[scopes.NAME.priorities]]` as written; see
/// [`PriorityConfig`](super::PriorityConfig).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPriority {
    /// Required; validation says so by key.
    pub name: Option<String>,
    /// Share of freed capacity among waiting classes.
    pub weight: Option<f64>,
    /// Share kept for the class when saturated.
    pub reserve: Option<f64>,
    /// Share the class may never exceed.
    pub limit: Option<f64>,
}

/// `[scopes.NAME.breaker]` as written; see [`BreakerConfig`](super::BreakerConfig).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBreaker {
    /// Streak threshold.
    pub failure_threshold: Option<i64>,
    /// Rate threshold, a fraction.
    pub failure_rate: Option<f64>,
    /// Samples before the rate channel applies.
    pub min_calls: Option<i64>,
    /// Duration string.
    pub window: Option<String>,
    /// Duration string.
    pub cooldown: Option<String>,
    /// Duration string.
    pub max_cooldown: Option<String>,
}

/// `[scopes.NAME.pacer]` as written; see [`PacerConfig`](super::PacerConfig).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPacer {
    /// Starting ceiling.
    pub initial: Option<f64>,
    /// Lowest ceiling.
    pub min: Option<f64>,
    /// Highest ceiling.
    pub max: Option<f64>,
    /// Additive increase.
    pub increase: Option<f64>,
    /// Multiplicative decrease.
    pub decrease: Option<f64>,
}

/// `[[scopes.NAME.sources]]` as written; see [`SourceConfig`](super::SourceConfig).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSource {
    /// Required; validation says so by key.
    pub name: Option<String>,
    /// Tokens per minute, or `"auto"` (§18).
    pub tpm: Option<RawRate>,
    /// Requests per minute, or `"auto"` (§18).
    pub rpm: Option<RawRate>,
    /// Per-attempt token estimate.
    pub est_tokens: Option<i64>,
    /// Duration string.
    pub timeout: Option<String>,
    /// Duration string (§7a).
    pub burst: Option<String>,
    /// `actual` | `estimate` (§7a).
    pub tokens_charged: Option<String>,
    /// Input tokens per minute (§7a), or `"auto"` (§18).
    pub itpm: Option<RawRate>,
    /// Output tokens per minute (§7a), or `"auto"` (§18).
    pub otpm: Option<RawRate>,
    /// Requests per day (§7a).
    pub rpd: Option<i64>,
    /// Tokens per day (§7a).
    pub tpd: Option<i64>,
    /// Output estimate (§7a).
    pub est_output_tokens: Option<i64>,
    /// `on` | `off` (§18).
    pub observe_limits: Option<String>,
    /// `aimd` | `off` (§18: the rate learned from 429s).
    pub learn_rate: Option<String>,
    /// §19: dollars per million input tokens.
    pub usd_per_1m_input: Option<f64>,
    /// §19: dollars per million output tokens.
    pub usd_per_1m_output: Option<f64>,
    /// §19: dollars per million cached input reads.
    pub usd_per_1m_cached_input: Option<f64>,
}

/// A per-minute limit as written: a number, or text (`"auto"`, §18; validation
/// names anything else).
#[derive(Deserialize, Debug, Clone, PartialEq)]
#[serde(untagged)]
pub enum RawRate {
    /// A number of tokens or requests per minute.
    Count(i64),
    /// Text: `"auto"` learns the limit from the provider's headers.
    Text(String),
}

/// A TOML table kept in document order (scope order matters for status output).
pub(super) struct Ordered<V>(pub(super) Vec<(String, V)>);

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

/// The file as written: unknown keys and wrong TOML types are errors that name the
/// key path and the line.
pub(super) fn parse_raw(text: &str) -> Result<RawFile, ConfigError> {
    // Parse once for spans (syntax errors surface here) and once into the raw
    // structs; a serde error's span is mapped back to the key path it falls in.
    let doc = DeTable::parse(text).map_err(|e| toml_error(text, None, &e))?;
    toml::from_str::<RawFile>(text).map_err(|e| toml_error(text, Some(doc.get_ref()), &e))
}

fn toml_error(text: &str, doc: Option<&DeTable<'_>>, e: &toml::de::Error) -> ConfigError {
    let mut message = plain_types(e.message().trim()).replacen("unknown field", "unknown key", 1);
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
        "metrics_refresh",
        "max_rate_limit_block",
        "idle_exit",
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

/// The line of `path` (`scopes.chat.sources[1].tpm`) in `text`: its value's line,
/// `None` when the path is not in the file (a default, an environment override).
pub(super) fn line_of_key(text: &str, path: &str) -> Option<usize> {
    let doc = DeTable::parse(text).ok()?;
    let mut table: &DeTable<'_> = doc.get_ref();
    let mut span = None;
    let segments: Vec<&str> = path.split('.').collect();
    for (n, seg) in segments.iter().enumerate() {
        let (name, index) = match seg.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (*seg, None),
        };
        let (_, v) = table.iter().find(|(k, _)| k.get_ref() == name)?;
        let mut value = v;
        if let Some(i) = index {
            match value.get_ref() {
                DeValue::Array(items) => value = items.get(i)?,
                _ => return None,
            }
        }
        span = Some(value.span());
        if n + 1 < segments.len() {
            match value.get_ref() {
                DeValue::Table(t) => table = t,
                _ => return None,
            }
        }
    }
    span.map(|s| line_col(text, s.start).0)
}

/// serde's Rust type names in a type error, as an operator would say them.
fn plain_types(message: &str) -> String {
    const WORDS: &[(&str, &str)] = &[
        ("expected i64", "expected a whole number"),
        ("expected u64", "expected a whole number"),
        ("expected u32", "expected a whole number"),
        ("expected i32", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected a table"),
    ];
    let mut out = message.to_string();
    for (rust, words) in WORDS {
        if let Some(i) = out.find(rust) {
            // Only a whole word: "expected i64" but not "expected i640".
            let end = i + rust.len();
            if out[end..]
                .chars()
                .next()
                .is_none_or(|c| !c.is_alphanumeric())
            {
                out.replace_range(i..end, words);
            }
        }
    }
    out
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
