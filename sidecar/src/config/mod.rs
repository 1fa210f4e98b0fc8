//! Configuration (§12, §12a): the validated model ([`Config`]) and how a TOML file and
//! the environment become one.
//!
//! [`parse_str`] runs three steps, one module each: the file is deserialized into
//! *raw* structs (`raw`: every key optional, unknown keys rejected), environment
//! overrides are applied onto those (`env`: `{SCOPE}__{KEY}`, one table per target
//! listing the keys and storing their values), and the result is validated into the
//! model (`validate`: every default from `model`, every value checked). Each error
//! ([`ConfigError`]) names the full key path or the variable, the bad value and, for
//! enumerations, the allowed spellings — which come from the enumeration's one
//! [`Spelling`] table, the same one status, metrics and logs print from.

mod env;
mod error;
mod model;
mod raw;
mod tenants;
mod validate;

use std::path::Path;

pub use env::scope_env_prefix;
pub use error::ConfigError;
pub use model::*;
pub use tenants::*;

/// The example configuration shipped in `examples/polygate.toml`; the daemon's
/// embedded default when run without `--config`.
pub const EXAMPLE_CONFIG: &str = include_str!("../../../examples/polygate.toml");

/// The configuration from `path`, or the embedded [`EXAMPLE_CONFIG`] without one,
/// with the overrides found in `env` (the daemon's start-up, reload and `status`).
pub fn load(
    path: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Config, ConfigError> {
    match path {
        Some(p) => load_file(p, env),
        None => parse_str(EXAMPLE_CONFIG, env),
    }
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
    let mut raw = raw::parse_raw(toml)?;
    let mut origins = env::Origins::default();
    env::apply_env(&mut raw, env, &mut origins)?;
    validate::validate(raw, &origins).map_err(|e| match e {
        // Where in the file the bad value is (its key path located in the document).
        ConfigError::Value {
            key,
            value,
            line: None,
            reason,
        } => ConfigError::Value {
            line: raw::line_of_key(toml, &key),
            key,
            value,
            reason,
        },
        e => e,
    })
}
