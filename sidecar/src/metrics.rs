//! Prometheus text exposition (format 0.0.4) of the engine's live state and counters,
//! served on the admin listener's `/metrics` (see [`crate::admin_http`]).

use std::collections::HashSet;
use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::backend::{Backend, State};
use crate::engine::Engine;

/// Escape a label value (backslash, double quote, newline).
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Writes `# HELP` / `# TYPE` once per family, then samples.
struct Out {
    text: String,
}

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", esc(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }
}

/// The whole exposition.
pub async fn render<B: Backend>(engine: &Engine<B>) -> String {
    let status = engine.status().await;
    let mut o = Out {
        text: String::with_capacity(4096),
    };
    o.family(
        "polygate_info",
        "gauge",
        "Constant 1, labelled with version and backend.",
    );
    o.sample(
        "polygate_info",
        &[
            ("version", env!("CARGO_PKG_VERSION")),
            ("backend", engine.backend_name()),
        ],
        1.0,
    );

    o.family(
        "polygate_scope_waiters",
        "gauge",
        "Acquires currently waiting in the scope.",
    );
    for sc in &status {
        o.sample(
            "polygate_scope_waiters",
            &[("scope", &sc.name)],
            sc.waiters as f64,
        );
    }
    o.family("polygate_scope_calls", "gauge", "Live calls of the scope.");
    for sc in &status {
        o.sample(
            "polygate_scope_calls",
            &[("scope", &sc.name)],
            sc.calls as f64,
        );
    }
    o.family(
        "polygate_waits_total",
        "counter",
        "Acquires that started waiting.",
    );
    for sc in &engine.scopes {
        o.sample(
            "polygate_waits_total",
            &[("scope", &sc.name)],
            sc.counters.waits.load(Ordering::Relaxed) as f64,
        );
    }
    o.family(
        "polygate_acquire_errors_total",
        "counter",
        "Acquires that ended in a gateway error, by kind.",
    );
    for sc in &engine.scopes {
        let c = &sc.counters;
        for (kind, v) in [
            ("circuit_open", &c.circuit_open),
            ("stalled", &c.stalled),
            ("quota_exhausted", &c.quota_exhausted),
            ("retry_exhausted", &c.retry_exhausted),
            ("backend_unavailable", &c.backend_unavailable),
        ] {
            o.sample(
                "polygate_acquire_errors_total",
                &[("scope", &sc.name), ("kind", kind)],
                v.load(Ordering::Relaxed) as f64,
            );
        }
    }

    // Source-level families: a source named by several scopes is one source.
    let mut seen = HashSet::new();
    let sources: Vec<_> = status
        .iter()
        .flat_map(|sc| sc.sources.iter())
        .filter(|s| seen.insert(s.name.clone()))
        .collect();
    let gauges: [(&str, &str); 11] = [
        (
            "polygate_breaker_epoch",
            "Breaker epoch (bumped by every transition).",
        ),
        (
            "polygate_breaker_retry_after_seconds",
            "Seconds until a retry is certainly worth attempting (0 = now).",
        ),
        ("polygate_breaker_cooldown_level", "Cooldown exponent k."),
        (
            "polygate_breaker_window_successes",
            "Successes in the breaker window.",
        ),
        (
            "polygate_breaker_window_failures",
            "Failures in the breaker window.",
        ),
        ("polygate_breaker_streak", "Consecutive failures."),
        (
            "polygate_memo_remaining_seconds",
            "Seconds this host still skips the source.",
        ),
        (
            "polygate_pacer_ceiling",
            "AIMD concurrency ceiling on this host.",
        ),
        (
            "polygate_pacer_in_flight",
            "Permits in flight on this host.",
        ),
        (
            "polygate_quota_blocked_seconds",
            "Seconds the quota stays blocked by a 429.",
        ),
        (
            "polygate_source_degraded",
            "1 while the source is served from local state (shared backend down).",
        ),
    ];
    for (name, help) in gauges {
        o.family(name, "gauge", help);
        for s in &sources {
            let v = match name {
                "polygate_breaker_epoch" => s.shared.epoch as f64,
                "polygate_breaker_retry_after_seconds" => s.shared.retry_after.as_secs_f64(),
                "polygate_breaker_cooldown_level" => s.shared.cooldown_level as f64,
                "polygate_breaker_window_successes" => s.shared.window_successes as f64,
                "polygate_breaker_window_failures" => s.shared.window_failures as f64,
                "polygate_breaker_streak" => s.shared.streak as f64,
                "polygate_memo_remaining_seconds" => s.memo_remaining.as_secs_f64(),
                "polygate_pacer_ceiling" => s.pacer_ceiling,
                "polygate_pacer_in_flight" => s.in_flight as f64,
                "polygate_quota_blocked_seconds" => s.shared.quota_blocked.as_secs_f64(),
                _ => s.degraded as u8 as f64,
            };
            o.sample(name, &[("source", &s.name)], v);
        }
    }
    o.family(
        "polygate_breaker_state",
        "gauge",
        "1 for the breaker's current state, 0 for the others.",
    );
    for s in &sources {
        for (label, st) in [
            ("closed", State::Closed),
            ("open", State::Open),
            ("half_open", State::HalfOpen),
        ] {
            o.sample(
                "polygate_breaker_state",
                &[("source", &s.name), ("state", label)],
                (s.shared.state == st) as u8 as f64,
            );
        }
    }
    o.family(
        "polygate_quota_tokens_available",
        "gauge",
        "Tokens left in the tpm bucket (negative: debt).",
    );
    for s in &sources {
        if let Some(v) = s.shared.tokens_available {
            o.sample("polygate_quota_tokens_available", &[("source", &s.name)], v);
        }
    }
    o.family(
        "polygate_quota_requests_available",
        "gauge",
        "Requests left in the rpm bucket.",
    );
    for s in &sources {
        if let Some(v) = s.shared.requests_available {
            o.sample(
                "polygate_quota_requests_available",
                &[("source", &s.name)],
                v,
            );
        }
    }

    let counters: [(&str, &str); 3] = [
        ("polygate_grants_total", "Permits granted."),
        ("polygate_probes_total", "Half-open probes granted."),
        (
            "polygate_abandoned_total",
            "Permits never reported (connection closed, call ended, lease expired).",
        ),
    ];
    for (name, help) in counters {
        o.family(name, "counter", help);
        for src in &engine.sources {
            let c = &src.counters;
            let v = match name {
                "polygate_grants_total" => &c.grants,
                "polygate_probes_total" => &c.probes,
                _ => &c.abandoned,
            };
            o.sample(
                name,
                &[("source", &src.name)],
                v.load(Ordering::Relaxed) as f64,
            );
        }
    }
    o.family(
        "polygate_reports_total",
        "counter",
        "Reported outcomes, by outcome.",
    );
    for src in &engine.sources {
        let c = &src.counters;
        for (outcome, v) in [
            ("success", &c.successes),
            ("failure", &c.failures),
            ("rate_limited", &c.rate_limited),
            ("cancelled", &c.cancelled),
        ] {
            o.sample(
                "polygate_reports_total",
                &[("source", &src.name), ("outcome", outcome)],
                v.load(Ordering::Relaxed) as f64,
            );
        }
    }
    o.text
}
