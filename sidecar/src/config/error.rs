//! Why a configuration was rejected (§12: every invalid value fails startup with a
//! message naming the key — or the environment variable — and the allowed values).

use std::path::PathBuf;

/// Why a configuration was rejected. Every variant's message names where the bad
/// value came from: a key path, a `line, column`, or an environment variable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read (a missing file says so in those words).
    #[error("{}", read_error(path, source))]
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
    #[error("{key} = {value}{}: {reason}", at_line(*line))]
    Value {
        /// Full key path (`scopes.chat.quota_full`).
        key: String,
        /// The bad value as written.
        value: String,
        /// The line of the file it is on (unknown for a value built in code).
        line: Option<usize>,
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
        .first_value,
        .second_value
    )]
    SourceConflict {
        /// The source.
        source_name: String,
        /// The quota key (`tpm`, `rpm`, `burst`, …).
        field: &'static str,
        /// The scope that named the source first.
        first_scope: String,
        /// Its value as the file shows it (`unset` when absent).
        first_value: Box<str>,
        /// The scope that disagrees.
        second_scope: String,
        /// Its value as the file shows it (`unset` when absent).
        second_value: Box<str>,
    },
}

/// ` (line N)`, or nothing.
fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" (line {l})")).unwrap_or_default()
}

/// `config file X not found`, else `cannot read config file X: why`.
fn read_error(path: &std::path::Path, e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => format!("config file {} not found", path.display()),
        _ => format!("cannot read config file {}: {e}", path.display()),
    }
}
