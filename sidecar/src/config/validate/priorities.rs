//! A scope's priority classes (§15): `[[scopes.NAME.priorities]]`, `default_priority`
//! and `saturation`.

use crate::config::env::Origins;
use crate::config::raw::RawPriority;
use crate::config::{
    ConfigError, PriorityConfig, DEFAULT_SATURATION, MAX_PRIORITIES, MAX_PRIORITY_NAME,
};

/// A scope's validated §15 settings.
pub(super) struct Classes {
    /// The classes, config order.
    pub(super) priorities: Vec<PriorityConfig>,
    /// Index of the default class.
    pub(super) default: usize,
    /// Share in use above which reserves apply.
    pub(super) saturation: f64,
}

/// §15: `[[scopes.NAME.priorities]]`, `default_priority` and `saturation`. Every
/// share is a fraction of one source's capacity; reserves may not promise more than
/// the whole, and a class cannot be capped below what is reserved for it.
pub(super) fn validate_priorities(
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
