//! `polygate-sidecar status` (§12): ask a running sidecar for its live state over
//! the worker socket (Hello, then Status) and print it as one text table per scope;
//! `status --json` asks for the JSON document instead (`StatusJson`,
//! bindings/PROTOCOL.md §14.4) and prints it as received, one line.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{
    BreakerState, ClientCodec, ClientFrame, Reply, Request, ScopeStatus, SourceStatus, StatusReport,
};
use tokio::net::UnixStream;
use tokio_util::codec::Framed;

use crate::config::default_socket;

/// How long `status` waits for the sidecar.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// The socket to ask: `--socket`, else `$POLYGATE_SOCKET`, else the `--config`
/// file's socket, else the default socket for this uid ([`default_socket`]: root
/// `/run/polygate/sidecar.sock`, anyone else `$XDG_RUNTIME_DIR/polygate/sidecar.sock`).
/// A `--config` that does not load, or no default (non-root without
/// `XDG_RUNTIME_DIR`), is reported (exit status 2).
pub fn socket_path(socket: Option<PathBuf>, config: Option<&Path>) -> Result<PathBuf, ExitCode> {
    match socket.or_else(|| std::env::var_os("POLYGATE_SOCKET").map(Into::into)) {
        Some(s) => Ok(s),
        None if config.is_some() => super::load_config(config).map(|c| c.sidecar.socket.into()),
        None => default_socket().map(Into::into).map_err(|e| {
            eprintln!("polygate-sidecar status: {e}; or pass --socket");
            ExitCode::from(super::EXIT_CONFIG)
        }),
    }
}

/// Fetch the report from `socket` and print it (tables, or with `json` the JSON
/// document); failures go to stderr and exit 1.
pub fn run(socket: &Path, json: bool) -> ExitCode {
    let request = if json {
        Request::StatusJson
    } else {
        Request::Status
    };
    ask_and_print(socket, request, |answer| match answer {
        Printable::Report(report, doc) => {
            let classes = doc.as_deref().map(classes_of).unwrap_or_default();
            let mut text = render_with_classes(&report, &classes);
            if let Some(doc) = doc {
                text.push_str(&render_share(&doc));
                text.push_str(&render_buckets(&doc));
                text.push_str(&super::tenant::render_top(&doc));
            }
            Ok(text)
        }
        Printable::Json(doc) => Ok(format!("{doc}\n")),
    })
}

/// Send `request` to `socket` (after Hello) and print what `print` makes of the
/// answer; a failure (no runtime, no answer within [`STATUS_TIMEOUT`], an error
/// reply, an answer `print` refuses) goes to stderr and exits 1.
pub(super) fn ask_and_print(
    socket: &Path,
    request: Request,
    print: impl FnOnce(Printable) -> Result<String, String>,
) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("polygate-sidecar status: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let fetch = async { tokio::time::timeout(STATUS_TIMEOUT, fetch(socket, request)).await };
    match rt.block_on(fetch).map(|r| r.and_then(print)) {
        Ok(Ok(text)) => super::print_out(&text),
        Ok(Err(e)) => {
            eprintln!("polygate-sidecar status: {}: {e}", socket.display());
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!(
                "polygate-sidecar status: {}: no answer within {STATUS_TIMEOUT:?}",
                socket.display()
            );
            ExitCode::FAILURE
        }
    }
}

/// What a status request brought back.
pub(super) enum Printable {
    /// The answer to `Status`, and the JSON document when the sidecar speaks it: it
    /// carries what the fixed-layout version-1 report cannot (each scope's §15
    /// classes, each bucket's §7a detail).
    Report(StatusReport, Option<String>),
    /// The answer to `StatusJson` or `TenantStatus`: the document as the sidecar
    /// wrote it.
    Json(String),
}

/// A frame of id 0 — the sidecar's word on the whole connection, sent before it
/// closes it — in words.
fn refusal(reply: &Reply) -> String {
    match reply {
        Reply::Error(e) if e.kind == ipc_protocol::ErrorKind::Overloaded => {
            format!(
                "the sidecar refused the connection (Overloaded): {}",
                e.message
            )
        }
        Reply::Error(e) => format!(
            "the sidecar refused the connection ({:?}): {}",
            e.kind, e.message
        ),
        other => format!("unexpected frame for the whole connection: {other:?}"),
    }
}

/// Hello, then `request` (`Status`, `StatusJson` or `TenantStatus`), on one
/// connection.
async fn fetch(socket: &Path, request: Request) -> Result<Printable, String> {
    let stream = UnixStream::connect(socket).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::PermissionDenied => {
                "; this user may not open the socket: ask the sidecar's operator to admit \
                 it (socket_mode, the socket directory's group) or point --socket / \
                 POLYGATE_SOCKET at a sidecar of this user"
            }
            std::io::ErrorKind::NotFound => {
                "; is the sidecar running? Its socket is [sidecar] socket; pass the same \
                 path with --socket or POLYGATE_SOCKET"
            }
            _ => "",
        };
        format!("cannot connect: {e}{hint}")
    })?;
    // A status report may be larger than a request frame: accept up to the decoder's limit.
    let mut framed = Framed::new(stream, ClientCodec::new(ipc_protocol::codec::DECODE_LIMIT));
    let mut ask = async |id: u64, request: Request| -> Result<Reply, String> {
        // A send that fails may still have a refusal waiting to be read (the
        // sidecar refuses before any Hello, then closes): read it before giving up.
        let sent = framed.send(ClientFrame { id, request }).await;
        loop {
            match framed.next().await {
                Some(Ok(f)) if f.id == id => return Ok(f.reply),
                // Id 0: the sidecar speaks for the connection (a refusal, then it
                // closes): say it in words.
                Some(Ok(f)) if f.id == 0 => return Err(refusal(&f.reply)),
                Some(Ok(_)) => continue,
                Some(Err(e)) => {
                    return Err(match sent {
                        Err(s) => format!("send failed: {s}"),
                        Ok(()) => format!("receive failed: {e}"),
                    })
                }
                None => {
                    return Err(match sent {
                        Err(s) => format!("send failed: {s}"),
                        Ok(()) => "the sidecar closed the connection".into(),
                    })
                }
            }
        }
    };
    let hello = Request::Hello {
        protocol_version: ipc_protocol::PROTOCOL_VERSION,
        client_name: format!("polygate-sidecar-status/{}", env!("CARGO_PKG_VERSION")),
        pid: std::process::id(),
    };
    let agreed = match ask(1, hello).await? {
        Reply::Welcome {
            protocol_version, ..
        } => protocol_version,
        Reply::Error(e) => return Err(format!("{:?}: {}", e.kind, e.message)),
        other => return Err(format!("unexpected answer to Hello: {other:?}")),
    };
    let (name, command) = match request {
        Request::StatusJson => ("StatusJson", "status --json"),
        Request::TenantStatus { .. } => ("TenantStatus", "status --tenant"),
        _ => ("Status", "status"),
    };
    if agreed < request.min_version() {
        return Err(format!(
            "this sidecar speaks protocol version {agreed}; {command} needs version {}",
            request.min_version()
        ));
    }
    let wants_doc =
        matches!(request, Request::Status) && agreed >= Request::StatusJson.min_version();
    match ask(2, request.clone()).await? {
        Reply::Status(report) => {
            let doc = match wants_doc {
                true => match ask(3, Request::StatusJson).await? {
                    Reply::StatusJson(doc) => Some(doc),
                    _ => None,
                },
                false => None,
            };
            Ok(Printable::Report(report, doc))
        }
        Reply::StatusJson(doc) => Ok(Printable::Json(doc)),
        Reply::Error(e) => Err(format!("{:?}: {}", e.kind, e.message)),
        other => Err(format!("unexpected answer to {name}: {other:?}")),
    }
}

/// Scope name → its §15 classes as `status --json` shows them.
pub type Classes = std::collections::HashMap<String, Vec<serde_json::Value>>;

fn classes_of(doc: &str) -> Classes {
    let mut out = Classes::new();
    let Ok(v) = serde_json::from_str::<serde_json::Value>(doc) else {
        return out;
    };
    for sc in v["scopes"].as_array().into_iter().flatten() {
        if let (Some(name), Some(cl)) = (sc["name"].as_str(), sc["classes"].as_array()) {
            out.insert(name.to_string(), cl.clone());
        }
    }
    out
}

// ---------------------------------------------------------------------------------
// rendering

/// §10: the share of every shared quota this host uses while degraded, as one line
/// (nothing for a backend without one).
pub fn render_share(doc: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(doc) else {
        return String::new();
    };
    let s = &v["degraded_share"];
    match (
        s["share"].as_f64(),
        s["live_hosts"].as_u64(),
        s["setting"].as_str(),
    ) {
        (Some(share), Some(hosts), Some(setting)) => format!(
            "\ndegraded share: {share:.4} of every shared quota while redis cannot be read \
             (degraded_share = {setting}; live hosts last seen: {hosts})\n"
        ),
        _ => String::new(),
    }
}

/// Column alignment.
#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

const COLUMNS: &[(&str, Align)] = &[
    ("SOURCE", Align::Left),
    ("STATE", Align::Left),
    ("EPOCH", Align::Right),
    ("RETRY", Align::Right),
    ("LEVEL", Align::Right),
    ("WIN OK/FAIL", Align::Right),
    ("STREAK", Align::Right),
    ("MEMO", Align::Right),
    ("PACER", Align::Right),
    ("IN-FLIGHT", Align::Right),
    ("TOKENS", Align::Right),
    ("REQUESTS", Align::Right),
    ("BLOCKED", Align::Right),
    ("DEGRADED", Align::Left),
];

/// The whole report as a text table per scope, ending with a newline.
pub fn render(report: &StatusReport) -> String {
    render_with_classes(report, &Classes::new())
}

/// [`render`], with a table of each scope's priority classes (§15) after its sources.
pub fn render_with_classes(report: &StatusReport, classes: &Classes) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "polygate-sidecar {} (backend: {})",
        report.sidecar_version, report.backend
    );
    if report.scopes.is_empty() {
        out.push_str("\nno scopes configured\n");
    }
    for scope in &report.scopes {
        out.push('\n');
        render_scope(&mut out, scope);
        if let Some(cl) = classes.get(&scope.name).filter(|c| !c.is_empty()) {
            render_classes(&mut out, cl);
        }
    }
    out
}

/// One line per class: weight, reserve, limit, waiters, grants and their share,
/// slots held, and the refusals that are not zero.
fn render_classes(out: &mut String, classes: &[serde_json::Value]) {
    let _ = writeln!(
        out,
        "  {:<16} {:>7} {:>7} {:>5} {:>7} {:>8} {:>6} {:>9}  REFUSED",
        "CLASS", "WEIGHT", "RESERVE", "LIMIT", "WAITERS", "GRANTS", "SHARE", "IN-FLIGHT"
    );
    for c in classes {
        let f = |k: &str| c[k].as_f64().unwrap_or(0.0);
        let refused: Vec<String> = c["refusals"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(_, v)| v.as_u64().unwrap_or(0) > 0)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = writeln!(
            out,
            "  {:<16} {:>7} {:>7} {:>5} {:>7} {:>8} {:>5.0}% {:>9}  {}",
            c["name"].as_str().unwrap_or("?"),
            f("weight"),
            f("reserve"),
            f("limit"),
            f("waiters"),
            f("grants"),
            100.0 * f("grant_share"),
            f("in_flight"),
            if refused.is_empty() {
                "-".to_string()
            } else {
                refused.join(" ")
            }
        );
    }
}

fn render_scope(out: &mut String, s: &ScopeStatus) {
    let _ = writeln!(
        out,
        "scope {}: circuit_open={} quota_full={} calls={} waiters={}",
        s.name, s.circuit_open, s.quota_full, s.calls, s.waiters
    );
    let rows: Vec<Vec<String>> = s.sources.iter().map(source_row).collect();
    let mut widths: Vec<usize> = COLUMNS.iter().map(|(h, _)| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = COLUMNS.iter().map(|(h, _)| h.to_string()).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::from(" ");
        for ((cell, w), (_, align)) in row.iter().zip(&widths).zip(COLUMNS) {
            line.push(' ');
            let pad = w - cell.chars().count();
            match align {
                Align::Left => {
                    line.push_str(cell);
                    line.extend(std::iter::repeat_n(' ', pad));
                }
                Align::Right => {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                }
            }
            line.push(' ');
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

fn source_row(s: &SourceStatus) -> Vec<String> {
    vec![
        s.name.clone(),
        state(s.state).to_string(),
        // Degraded, the state is this host's local stand-in, whose epoch (a large
        // number far from the shared one) means nothing to an operator.
        match s.degraded {
            true => "unknown".to_string(),
            false => s.epoch.to_string(),
        },
        secs(s.retry_after_s),
        s.cooldown_level.to_string(),
        format!("{}/{}", s.window_successes, s.window_failures),
        s.streak.to_string(),
        secs(s.memo_remaining_s),
        format!("{:.2}", s.pacer_ceiling),
        s.in_flight.to_string(),
        level(s.tokens_available),
        level(s.requests_available),
        secs(s.quota_blocked_s),
        if s.degraded { "yes" } else { "no" }.to_string(),
    ]
}

/// Every source's quota buckets from the JSON status document (§7a): level,
/// capacity (`auto` marked, §18), refill per second and debt, and the provider's
/// last word (§18: what it said was left, how long ago, and what the corrections
/// removed in total), one table per scope that has any.
pub fn render_buckets(doc: &str) -> String {
    let mut out = String::new();
    let Ok(v) = serde_json::from_str::<serde_json::Value>(doc) else {
        return out;
    };
    let none = Vec::new();
    for scope in v["scopes"].as_array().unwrap_or(&none) {
        let mut rows: Vec<[String; 9]> = Vec::new();
        for src in scope["sources"].as_array().unwrap_or(&none) {
            for b in src["buckets"].as_array().unwrap_or(&none) {
                let num = |k: &str, digits: usize| {
                    b[k].as_f64()
                        .map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
                };
                rows.push([
                    src["name"].as_str().unwrap_or("?").to_string(),
                    b["bucket"].as_str().unwrap_or("?").to_string(),
                    b["level"]
                        .as_f64()
                        .map_or_else(|| "-".into(), |x| format!("{:.0}", x.floor())),
                    if b["auto"].as_bool() == Some(true) {
                        format!("{} auto", num("capacity", 0))
                    } else {
                        num("capacity", 0)
                    },
                    num("refill_per_s", 3),
                    b["debt"]
                        .as_f64()
                        .map_or_else(|| "-".into(), |x| format!("{:.0}", x.ceil())),
                    b["observed"]["remaining"]
                        .as_u64()
                        .map_or_else(|| "-".into(), |x| x.to_string()),
                    secs(b["observed"]["age_s"].as_f64().unwrap_or(0.0)),
                    b["observed"]["removed"]
                        .as_u64()
                        .map_or_else(|| "-".into(), |x| x.to_string()),
                ]);
            }
        }
        if rows.is_empty() {
            continue;
        }
        let header = [
            "SOURCE", "BUCKET", "LEVEL", "CAPACITY", "REFILL/S", "DEBT", "SEEN", "AGE", "REMOVED",
        ];
        let mut widths = header.map(str::len);
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let _ = writeln!(
            out,
            "\nscope {} quota buckets:",
            scope["name"].as_str().unwrap_or("?")
        );
        let head = header.map(String::from);
        for r in std::iter::once(&head).chain(&rows) {
            let mut line = String::from(" ");
            for (i, (c, w)) in r.iter().zip(widths).enumerate() {
                let pad = " ".repeat(w - c.chars().count());
                if i < 2 {
                    let _ = write!(line, " {c}{pad}");
                } else {
                    let _ = write!(line, " {pad}{c}");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
    out
}

fn state(s: BreakerState) -> &'static str {
    match s {
        BreakerState::Closed => "closed",
        BreakerState::Open => "OPEN",
        BreakerState::HalfOpen => "half-open",
    }
}

/// Seconds for a person: `-` for none, `0.25s`, `12.5s`, `4m05s`, `2h03m`.
fn secs(s: f64) -> String {
    if !s.is_finite() || s <= 0.0 {
        return "-".into();
    }
    if s < 10.0 {
        return format!("{s:.2}s");
    }
    if s < 60.0 {
        return format!("{s:.1}s");
    }
    let whole = s.round() as u64;
    if whole < 3600 {
        format!("{}m{:02}s", whole / 60, whole % 60)
    } else {
        format!("{}h{:02}m", whole / 3600, whole % 3600 / 60)
    }
}

/// A bucket level: `-` without that bucket, whole units otherwise (negative = debt).
fn level(l: Option<f64>) -> String {
    match l {
        None => "-".into(),
        Some(v) => format!("{:.0}", v.floor()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(name: &str) -> SourceStatus {
        SourceStatus {
            name: name.into(),
            state: BreakerState::Open,
            epoch: 7,
            retry_after_s: 42.3,
            cooldown_level: 2,
            window_successes: 10,
            window_failures: 3,
            streak: 1,
            memo_remaining_s: 0.0,
            pacer_ceiling: 7.5,
            in_flight: 2,
            tokens_available: Some(-120.4),
            requests_available: None,
            quota_blocked_s: 125.0,
            degraded: true,
        }
    }

    #[test]
    fn renders_every_field() {
        let report = StatusReport {
            sidecar_version: "0.1.0".into(),
            backend: "memory".into(),
            scopes: vec![ScopeStatus {
                name: "chat".into(),
                circuit_open: "wait".into(),
                quota_full: "fail_fast".into(),
                waiters: 1,
                calls: 4,
                sources: vec![source("openai-gpt4o-eu"), source("b")],
            }],
        };
        let text = render(&report);
        assert!(text.starts_with("polygate-sidecar 0.1.0 (backend: memory)\n"));
        assert!(
            text.contains("scope chat: circuit_open=wait quota_full=fail_fast calls=4 waiters=1")
        );
        let row = text
            .lines()
            .find(|l| l.contains("openai-gpt4o-eu"))
            .unwrap();
        for cell in [
            "OPEN", "unknown", "42.3s", "10/3", "7.50", "-121", "2m05s", "yes",
        ] {
            assert!(row.contains(cell), "{cell:?} missing from {row:?}");
        }
        // Not degraded: the epoch itself.
        let mut healthy = source("c");
        healthy.degraded = false;
        healthy.epoch = 4_611_686_018_427_387_911;
        let row = source_row(&healthy);
        assert_eq!(row[2], "4611686018427387911");
        // Columns line up: the header and both rows have the same width.
        let lens: Vec<usize> = text
            .lines()
            .filter(|l| l.starts_with("  "))
            .map(|l| l.find("DEGRADED").or_else(|| l.find("yes")).unwrap())
            .collect();
        assert_eq!(lens.len(), 3);
        assert!(lens.windows(2).all(|w| w[0] == w[1]), "{text}");
    }

    #[test]
    fn buckets_render_level_capacity_refill_and_debt() {
        let doc = r#"{"scopes":[{"name":"chat","sources":[
            {"name":"anthropic","buckets":[
              {"bucket":"rpm","level":0.4,"capacity":1,"refill_per_s":1.0,"debt":0.0},
              {"bucket":"otpm","level":-250.2,"capacity":8000,"refill_per_s":133.33333,"debt":250.2}]},
            {"name":"local","buckets":[]}]},
            {"name":"empty","sources":[{"name":"x","buckets":[]}]}]}"#;
        let text = render_buckets(doc);
        assert!(text.contains("scope chat quota buckets:"), "{text}");
        assert!(!text.contains("scope empty"), "{text}");
        let otpm = text.lines().find(|l| l.contains("otpm")).unwrap();
        for cell in ["anthropic", "-251", "8000", "133.333", "251"] {
            assert!(otpm.contains(cell), "{cell:?} missing from {otpm:?}");
        }
        let rpm = text.lines().find(|l| l.contains(" rpm")).unwrap();
        let cells: Vec<&str> = rpm.split_whitespace().collect();
        assert_eq!((cells[2], cells[5]), ("0", "0"), "level, debt: {rpm:?}");
        assert_eq!(render_buckets("not json"), "");
    }

    #[test]
    fn the_degraded_share_renders_in_one_line_or_not_at_all() {
        let doc = r#"{"degraded_share":{"share":0.25,"live_hosts":4,"setting":"auto"}}"#;
        assert_eq!(
            render_share(doc),
            "\ndegraded share: 0.2500 of every shared quota while redis cannot be read \
             (degraded_share = auto; live hosts last seen: 4)\n"
        );
        assert_eq!(render_share(r#"{"backend":"memory"}"#), "");
        assert_eq!(render_share("not json"), "");
    }

    #[test]
    fn buckets_render_the_providers_last_word() {
        let doc = r#"{"scopes":[{"name":"chat","sources":[
            {"name":"openai","buckets":[
              {"bucket":"tpm","level":200.0,"capacity":30000,"refill_per_s":500.0,"debt":0.0,
               "auto":true,"observed":{"remaining":250,"limit":30000,"age_s":1.5,"removed":4100}},
              {"bucket":"rpm","level":9.0,"capacity":10,"refill_per_s":0.1,"debt":0.0,
               "auto":false,"observed":null}]}]}]}"#;
        let text = render_buckets(doc);
        assert!(text.contains("SEEN") && text.contains("REMOVED"), "{text}");
        let tpm = text.lines().find(|l| l.contains("tpm")).unwrap();
        for cell in ["30000 auto", " 250", "1.50s", "4100"] {
            assert!(tpm.contains(cell), "{cell:?} missing from {tpm:?}");
        }
        let rpm = text.lines().find(|l| l.contains(" rpm")).unwrap();
        assert!(rpm.trim_end().ends_with('-'), "never observed: {rpm:?}");
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(secs(0.0), "-");
        assert_eq!(secs(0.25), "0.25s");
        assert_eq!(secs(59.94), "59.9s");
        assert_eq!(secs(3725.0), "1h02m");
    }
}
