//! `polygate-sidecar status --tenant NAME [--scope S]` (§19 "Visibility"): ask a
//! running sidecar for one tenant (`TenantStatus`, bindings/PROTOCOL.md §15) and print
//! its limits, bucket levels, spend in the current UTC day and month, calls in flight
//! and waiting, per scope with tenants (`--json`: the document as received); and the
//! top tenants by spend that `status` prints after its tables, from each scope's
//! `tenants` object of the `StatusJson` document.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;

use ipc_protocol::Request;
use serde_json::Value;

use super::status::{ask_and_print, Printable};

/// Fetch tenant `tenant` (`""`: the anonymous one) in `scope` (`None`: every scope
/// with tenants) from `socket` and print it; failures (an unknown scope, a scope
/// without tenants, no scope with tenants at all) go to stderr and exit 1.
pub fn run(socket: &Path, tenant: &str, scope: Option<&str>, json: bool) -> ExitCode {
    let request = Request::TenantStatus {
        scope: scope.map(str::to_string),
        tenant: tenant.to_string(),
    };
    ask_and_print(socket, request, |answer| match answer {
        Printable::Json(doc) if json => Ok(format!("{doc}\n")),
        Printable::Json(doc) => render_tenant(&doc),
        Printable::Report(..) => Err("unexpected answer to TenantStatus".into()),
    })
}

/// A tenant id for a table: as it is when it is plain, else quoted with Rust's
/// escapes (an id is any UTF-8: a newline or a quote must not break a line).
fn id(t: &str) -> String {
    let plain = !t.is_empty()
        && t.chars()
            .all(|c| c.is_alphanumeric() || "-_.:@/+".contains(c));
    match plain {
        true => t.to_string(),
        false => format!("\"{}\"", t.escape_debug()),
    }
}

/// Dollars for a person: `$0.0003`, `$5.00`, `$12.50` (at least cents, at most
/// micro-dollars).
fn dollars(x: f64) -> String {
    let mut s = format!("{x:.6}");
    while s.ends_with('0') && s.len() - s.find('.').unwrap_or(0) > 3 {
        s.pop();
    }
    format!("${s}")
}

/// A count or level from the document, `-` when absent.
fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.fract() == 0.0 => format!("{x:.0}"),
        Some(x) => format!("{:.0}", x.floor()),
        None => "-".into(),
    }
}

/// Rows as left-aligned first column and right-aligned others, indented two spaces.
fn table(out: &mut String, rows: &[Vec<String>]) {
    let mut widths = vec![0; rows.iter().map(Vec::len).max().unwrap_or(0)];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    for r in rows {
        let mut line = String::from(" ");
        for (i, (c, w)) in r.iter().zip(&widths).enumerate() {
            let pad = " ".repeat(w - c.chars().count());
            match i {
                0 => {
                    let _ = write!(line, " {c}{pad}");
                }
                _ => {
                    let _ = write!(line, "  {pad}{c}");
                }
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// One tenant's figures on this host in words (`anonymous`: the calls that name no
/// tenant, which no book counts).
fn host_line(h: &Value, anonymous: bool) -> String {
    match h.is_object() {
        false if anonymous => {
            "this host: calls that name no tenant are not counted per tenant".into()
        }
        false => "this host: not seen (no call of it since it was last forgotten)".into(),
        true => format!(
            "this host: calls {}, in flight {}, grants {}, refused {}, tokens {}, {} settled",
            num(&h["calls"]),
            num(&h["in_flight"]),
            num(&h["grants"]),
            num(&h["refused"]),
            num(&h["tokens"]),
            dollars(h["usd"].as_f64().unwrap_or(0.0)),
        ),
    }
}

/// The answer to `TenantStatus` as text: per scope, the tenant's limits and levels,
/// its spend against its budgets, in flight (every host) and waiting (here).
pub fn render_tenant(doc: &str) -> Result<String, String> {
    let v: Value =
        serde_json::from_str(doc).map_err(|e| format!("the sidecar's answer is not JSON: {e}"))?;
    let tenant = v["tenant"].as_str().unwrap_or_default();
    let scopes = v["scopes"].as_object().filter(|s| !s.is_empty()).ok_or(
        "no scope of this sidecar has tenants (a scope needs a [scopes.NAME.tenants] table)",
    )?;
    let mut out = match tenant {
        "" => "tenant \"\" (the anonymous tenant: calls that name none)\n".to_string(),
        t => format!("tenant {}\n", id(t)),
    };
    for (name, s) in scopes {
        let limits = &s["limits"];
        let ledger = &s["ledger"];
        let _ = writeln!(
            out,
            "\nscope {name}: weight {}, waiting here {}, fair counter here {}",
            limits["weight"].as_f64().unwrap_or(1.0),
            num(&s["waiting"]),
            num(&s["fair_counter"]),
        );
        let mut rows = vec![vec!["BUCKET".into(), "LIMIT".into(), "LEVEL".into()]];
        for b in ["tpm", "rpm", "tpd", "rpd"] {
            if !limits[b].is_null() {
                rows.push(vec![b.into(), num(&limits[b]), num(&ledger["levels"][b])]);
            }
        }
        match rows.len() {
            1 => out.push_str("  no token or request limit\n"),
            _ => table(&mut out, &rows),
        }
        for (key, spent, window) in [
            ("usd_per_day", "usd_spent_day", "today (UTC)"),
            ("usd_per_month", "usd_spent_month", "this month (UTC)"),
        ] {
            // A dollar window is kept only under its budget (gate/tenant.rs).
            let _ = match (limits[key].as_f64(), ledger[spent].as_f64()) {
                (Some(b), Some(x)) => {
                    writeln!(out, "  spent {window}: {} of {}", dollars(x), dollars(b))
                }
                (Some(b), None) => writeln!(out, "  spent {window}: unknown, of {}", dollars(b)),
                (None, _) => writeln!(out, "  spent {window}: not counted (no {key} budget)"),
            };
        }
        match s["ledger_error"].as_str() {
            Some(e) => {
                let _ = writeln!(out, "  ledger unreadable: {e}");
            }
            None if ledger.is_null() => {
                out.push_str("  no limit: no shared ledger (this host's figures below)\n")
            }
            None => {
                let _ = writeln!(
                    out,
                    "  in flight (every host): {}",
                    num(&ledger["in_flight"])
                );
            }
        }
        let _ = writeln!(out, "  {}", host_line(&s["host"], tenant.is_empty()));
    }
    Ok(out)
}

/// `status`'s tail: per scope with tenants, the top tenants by dollars settled on this
/// host and the scope's totals (nothing for a scope without tenants, or a document
/// that does not parse).
pub fn render_top(doc: &str) -> String {
    let mut out = String::new();
    let Ok(v) = serde_json::from_str::<Value>(doc) else {
        return out;
    };
    for scope in v["scopes"].as_array().into_iter().flatten() {
        let t = &scope["tenants"];
        if !t.is_object() {
            continue;
        }
        let _ = writeln!(
            out,
            "\nscope {} tenants: {} tracked here (max {}), fair turns {}; top by spend here:",
            scope["name"].as_str().unwrap_or("?"),
            num(&t["tracked"]),
            num(&t["max_tenants"]),
            t["fairness"].as_str().unwrap_or("?"),
        );
        let row = |name: String, s: &Value| {
            vec![
                name,
                num(&s["calls"]),
                num(&s["in_flight"]),
                num(&s["grants"]),
                num(&s["refused"]),
                num(&s["tokens"]),
                dollars(s["usd"].as_f64().unwrap_or(0.0)),
            ]
        };
        let head = [
            "TENANT",
            "CALLS",
            "IN-FLIGHT",
            "GRANTS",
            "REFUSED",
            "TOKENS",
            "SPENT",
        ];
        let mut rows = vec![head.map(String::from).to_vec()];
        for s in t["top"].as_array().into_iter().flatten() {
            rows.push(row(id(s["tenant"].as_str().unwrap_or_default()), s));
        }
        rows.push(row("(all tenants)".into(), &t["totals"]));
        table(&mut out, &rows);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dollars_and_ids_read_well() {
        assert_eq!(dollars(0.0), "$0.00");
        assert_eq!(dollars(0.0003), "$0.0003");
        assert_eq!(dollars(5.0), "$5.00");
        assert_eq!(dollars(12.5), "$12.50");
        assert_eq!(dollars(0.000_001_4), "$0.000001");
        assert_eq!(id("acme-7"), "acme-7");
        assert_eq!(id("a b\n\"c\""), "\"a b\\n\\\"c\\\"\"");
        assert_eq!(id(""), "\"\"");
    }

    #[test]
    fn no_scope_with_tenants_is_an_error_and_bad_json_too() {
        let e = render_tenant(r#"{"tenant":"acme","scopes":{}}"#).unwrap_err();
        assert!(e.contains("[scopes.NAME.tenants]"), "{e}");
        assert!(render_tenant("nope").is_err());
        assert_eq!(render_top("nope"), "");
        assert_eq!(render_top(r#"{"scopes":[{"name":"chat"}]}"#), "");
    }
}
