//! `/metrics` (§12): the engine's live state, its counters and the latency
//! histograms in OpenMetrics text, encoded by `prometheus-client` (the Prometheus
//! project's Rust client) and served by [`crate::admin_http`].
//!
//! A scrape costs the shared backend nothing: on a remote backend (Redis) the
//! breaker and quota of each source come from a view refreshed in the background
//! every `metrics_refresh` ([`SharedView`], [`spawn_refresh`]), whatever the scrape
//! rate; everything host-local (pacer, memo, waiters, calls, counters, histograms) is
//! read live. On the memory backend everything is read live.
//!
//! Counters keep the names they always had on the wire (`polygate_grants_total`);
//! as OpenMetrics wants, their family (`# TYPE`) is the name without `_total`.

pub mod histogram;
mod shared;

use crate::engine::BucketView;
use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ipc_protocol::Request;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::backend::{Backend, SourceSnapshot, State};
use crate::engine::{Engine, ScopeStatus};
pub use histogram::Histogram;
pub use shared::{spawn_refresh, SharedView};

/// The `Content-Type` of the exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `request` label of `polygate_request_duration_seconds`, indexed by
/// [`request_type`].
pub const REQUEST_TYPES: [&str; 16] = [
    "hello",
    "begin_call",
    "acquire",
    "report",
    "end_call",
    "status",
    "force_open",
    "force_close",
    "reset",
    "ping",
    "cancel",
    "start",
    "retry",
    "finish",
    "begin",
    "status_json",
];

/// The index of `r`'s type in [`REQUEST_TYPES`] (a match, no lookup).
pub fn request_type(r: &Request) -> usize {
    match r {
        Request::Hello { .. } => 0,
        Request::BeginCall { .. } => 1,
        Request::Acquire { .. } => 2,
        Request::Report { .. } => 3,
        Request::EndCall { .. } => 4,
        Request::Status => 5,
        Request::ForceOpen { .. } => 6,
        Request::ForceClose { .. } => 7,
        Request::Reset { .. } => 8,
        Request::Ping => 9,
        Request::Cancel { .. } => 10,
        Request::Start(_) => 11,
        Request::Retry { .. } => 12,
        Request::Finish { .. } => 13,
        Request::Begin(_) => 14,
        Request::StatusJson => 15,
    }
}

/// What the worker-socket server records: the time each request spends in the
/// sidecar, one histogram per request type in a fixed array (recording is an index
/// and two atomic adds).
#[derive(Debug)]
pub struct ServerMetrics {
    /// By [`request_type`].
    requests: Box<[Histogram]>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            requests: REQUEST_TYPES
                .iter()
                .map(|_| Histogram::new(histogram::REQUEST_BUCKETS))
                .collect(),
        }
    }
}

impl ServerMetrics {
    /// Record that a request of type `ty` ([`request_type`]) took `d`.
    pub fn observe(&self, ty: usize, d: Duration) {
        if let Some(h) = self.requests.get(ty) {
            h.observe(d);
        }
    }

    /// The histogram of request type `ty` ([`request_type`]).
    pub fn requests(&self, ty: usize) -> Option<&Histogram> {
        self.requests.get(ty)
    }
}

/// Everything `/metrics` is rendered from.
pub struct Exposition<B: Backend> {
    /// The engine: host-local state and counters.
    pub engine: Arc<Engine<B>>,
    /// The worker server's request histograms.
    pub server: Arc<ServerMetrics>,
    /// On a remote backend, the periodically refreshed shared state; `None` reads
    /// the (local, free) backend at each scrape.
    pub shared: Option<Arc<SharedView>>,
}

impl<B: Backend> Clone for Exposition<B> {
    fn clone(&self) -> Self {
        Exposition {
            engine: self.engine.clone(),
            server: self.server.clone(),
            shared: self.shared.clone(),
        }
    }
}

/// One scrape's data, owned, as a prometheus-client collector.
struct Scrape<B: Backend> {
    /// Where the counters and histograms are read.
    exp: Exposition<B>,
    /// Host-local status, `shared` filled where known.
    status: Vec<ScopeStatus>,
    /// For each source of `status` (same shape): whether `shared` is known.
    known: Vec<Vec<bool>>,
    /// Seconds since the shared view was refreshed (remote backends only).
    shared_age: Option<f64>,
}

impl<B: Backend> fmt::Debug for Scrape<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scrape").finish_non_exhaustive()
    }
}

/// The whole exposition, ending with `# EOF`.
pub async fn render<B: Backend>(exp: &Exposition<B>) -> String {
    let engine = &exp.engine;
    let (status, known, shared_age) = match &exp.shared {
        None => {
            let status = engine.status().await;
            let known = status
                .iter()
                .map(|sc| sc.sources.iter().map(|s| !s.degraded).collect())
                .collect();
            (status, known, None)
        }
        Some(view) => {
            let mut status = engine.status_local();
            let known = view.overlay(&mut status);
            (status, known, view.age())
        }
    };
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape {
        exp: exp.clone(),
        status,
        known,
        shared_age,
    }));
    let mut out = String::with_capacity(16 * 1024);
    // Writing to a String cannot fail; an encoder error would be a bug in a label.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        tracing::warn!(error = %e, "metrics encoding failed");
    }
    out
}

/// A family's header; its samples follow through the returned encoder.
fn family<'a>(
    enc: &'a mut DescriptorEncoder<'_>,
    name: &'a str,
    help: &str,
    unit: Option<&'a Unit>,
    ty: MetricType,
) -> Result<MetricEncoder<'a>, fmt::Error> {
    enc.encode_descriptor(name, help, unit, ty)
}

/// One gauge sample.
fn gauge(
    m: &mut MetricEncoder<'_>,
    labels: &impl EncodeLabelSet,
    v: impl prometheus_client::encoding::EncodeGaugeValue,
) -> fmt::Result {
    m.encode_family(labels)?.encode_gauge(&v)
}

/// One counter sample.
fn counter(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, v: &AtomicU64) -> fmt::Result {
    m.encode_family(labels)?
        .encode_counter::<NoLabelSet, u64, u64>(&v.load(Ordering::Relaxed), None)
}

/// A gauge's value: integers print as integers (an epoch may pass 2^53).
#[derive(Clone, Copy)]
enum Num {
    /// A count, an epoch, a flag.
    Int(u64),
    /// Seconds, a ceiling, a bucket level.
    Float(f64),
}

impl prometheus_client::encoding::EncodeGaugeValue for Num {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::GaugeValueEncoder<'_>,
    ) -> fmt::Result {
        match *self {
            Num::Int(v) => v.encode(encoder),
            Num::Float(v) => v.encode(encoder),
        }
    }
}

/// Per-source gauges read from the backend's view.
type SharedGauge = (
    &'static str,
    &'static str,
    Option<Unit>,
    fn(&SourceSnapshot) -> Num,
);

const SHARED_GAUGES: &[SharedGauge] = &[
    (
        "polygate_breaker_epoch",
        "Breaker epoch (bumped by every transition).",
        None,
        |s| Num::Int(s.epoch),
    ),
    (
        "polygate_breaker_retry_after",
        "Seconds until a retry is certainly worth attempting (0 = now).",
        Some(Unit::Seconds),
        |s| Num::Float(s.retry_after.as_secs_f64()),
    ),
    (
        "polygate_breaker_cooldown_level",
        "Cooldown exponent k.",
        None,
        |s| Num::Int(s.cooldown_level.into()),
    ),
    (
        "polygate_breaker_window_successes",
        "Successes in the breaker window.",
        None,
        |s| Num::Int(s.window_successes),
    ),
    (
        "polygate_breaker_window_failures",
        "Failures in the breaker window.",
        None,
        |s| Num::Int(s.window_failures),
    ),
    (
        "polygate_breaker_streak",
        "Consecutive failures.",
        None,
        |s| Num::Int(s.streak.into()),
    ),
    (
        "polygate_quota_blocked",
        "Seconds the quota stays blocked by a 429.",
        Some(Unit::Seconds),
        |s| Num::Float(s.quota_blocked.as_secs_f64()),
    ),
];

impl<B: Backend> Scrape<B> {
    /// Every source once (a source named by several scopes is one source), with
    /// whether its shared state is known.
    fn sources(&self) -> Vec<(&crate::engine::SourceStatus, bool)> {
        let mut seen = HashSet::new();
        self.status
            .iter()
            .zip(&self.known)
            .flat_map(|(sc, k)| sc.sources.iter().zip(k.iter().copied()))
            .filter(|(s, _)| seen.insert(s.name.as_str()))
            .collect()
    }

    fn encode_scopes(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let engine = &self.exp.engine;
        let mut m = family(
            enc,
            "polygate_scope_waiters",
            "Acquires currently waiting in the scope.",
            None,
            MetricType::Gauge,
        )?;
        for sc in &self.status {
            gauge(&mut m, &[("scope", sc.name.as_str())], sc.waiters)?;
        }
        let mut m = family(
            enc,
            "polygate_scope_calls",
            "Live calls of the scope.",
            None,
            MetricType::Gauge,
        )?;
        for sc in &self.status {
            gauge(&mut m, &[("scope", sc.name.as_str())], sc.calls)?;
        }
        let mut m = family(
            enc,
            "polygate_waits",
            "Acquires that started waiting.",
            None,
            MetricType::Counter,
        )?;
        for sc in &engine.scopes {
            counter(&mut m, &[("scope", sc.name.as_str())], &sc.counters.waits)?;
        }
        let mut m = family(
            enc,
            "polygate_acquire_errors",
            "Acquires that ended in a gateway error, by kind.",
            None,
            MetricType::Counter,
        )?;
        for sc in &engine.scopes {
            let c = &sc.counters;
            for (kind, v) in [
                ("circuit_open", &c.circuit_open),
                ("stalled", &c.stalled),
                ("quota_exhausted", &c.quota_exhausted),
                ("retry_exhausted", &c.retry_exhausted),
                ("backend_unavailable", &c.backend_unavailable),
            ] {
                counter(&mut m, &[("scope", sc.name.as_str()), ("kind", kind)], v)?;
            }
        }
        let mut m = family(
            enc,
            "polygate_acquire_wait",
            "Time an Acquire (or the acquire of a Start or Retry) took in the engine, \
             waiting included, however it ended.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for sc in &engine.scopes {
            sc.counters
                .wait
                .encode(m.encode_family(&[("scope", sc.name.as_str())])?)?;
        }
        self.encode_classes(enc)
    }

    /// §15: per priority class, labelled {scope, class}; scopes without classes add
    /// no series.
    fn encode_classes(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let classes = || {
            self.status
                .iter()
                .flat_map(|sc| sc.classes.iter().map(move |c| (sc.name.as_str(), c)))
        };
        let mut m = family(
            enc,
            "polygate_class_waiters",
            "Acquires of the priority class currently waiting.",
            None,
            MetricType::Gauge,
        )?;
        for (scope, c) in classes() {
            gauge(
                &mut m,
                &[("scope", scope), ("class", c.name.as_str())],
                c.waiters,
            )?;
        }
        let mut m = family(
            enc,
            "polygate_class_grant_share",
            "The class's share of the scope's grants on this host.",
            None,
            MetricType::Gauge,
        )?;
        for (scope, c) in classes() {
            gauge(
                &mut m,
                &[("scope", scope), ("class", c.name.as_str())],
                c.grant_share,
            )?;
        }
        let mut m = family(
            enc,
            "polygate_class_in_flight",
            "Pacer slots the class holds on this host.",
            None,
            MetricType::Gauge,
        )?;
        for (scope, c) in classes() {
            gauge(
                &mut m,
                &[("scope", scope), ("class", c.name.as_str())],
                c.in_flight,
            )?;
        }
        let mut m = family(
            enc,
            "polygate_class_grants",
            "Permits granted to calls of the class.",
            None,
            MetricType::Counter,
        )?;
        for (scope, c) in classes() {
            let labels = [("scope", scope), ("class", c.name.as_str())];
            m.encode_family(&labels)?
                .encode_counter::<NoLabelSet, u64, u64>(&c.grants, None)?;
        }
        let mut m = family(
            enc,
            "polygate_class_refusals",
            "Refusals of the class by reason: call-ending errors, and sources held back \
             by its limit or another class's reserve.",
            None,
            MetricType::Counter,
        )?;
        for (scope, c) in classes() {
            for (reason, v) in &c.refusals {
                let labels = [
                    ("scope", scope),
                    ("class", c.name.as_str()),
                    ("reason", reason),
                ];
                m.encode_family(&labels)?
                    .encode_counter::<NoLabelSet, u64, u64>(v, None)?;
            }
        }
        Ok(())
    }

    fn encode_sources(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let sources = self.sources();
        for (name, help, unit, read) in SHARED_GAUGES {
            let mut m = family(enc, name, help, unit.as_ref(), MetricType::Gauge)?;
            for (s, known) in &sources {
                if *known {
                    gauge(&mut m, &[("source", s.name.as_str())], read(&s.shared))?;
                }
            }
        }
        let mut m = family(
            enc,
            "polygate_breaker_state",
            "1 for the breaker's current state, 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for (s, known) in &sources {
            if !known {
                continue;
            }
            for (label, st) in [
                ("closed", State::Closed),
                ("open", State::Open),
                ("half_open", State::HalfOpen),
            ] {
                let labels = [("source", s.name.as_str()), ("state", label)];
                gauge(&mut m, &labels, u32::from(s.shared.state == st))?;
            }
        }
        let mut m = family(
            enc,
            "polygate_quota_tokens_available",
            "Tokens left in the tpm bucket (negative: debt).",
            None,
            MetricType::Gauge,
        )?;
        for (s, known) in &sources {
            if let (true, Some(v)) = (known, s.shared.tokens_available) {
                gauge(&mut m, &[("source", s.name.as_str())], v)?;
            }
        }
        let mut m = family(
            enc,
            "polygate_quota_requests_available",
            "Requests left in the rpm bucket.",
            None,
            MetricType::Gauge,
        )?;
        for (s, known) in &sources {
            if let (true, Some(v)) = (known, s.shared.requests_available) {
                gauge(&mut m, &[("source", s.name.as_str())], v)?;
            }
        }
        // §7a: every configured bucket, labelled by its config key.
        let bucket_families: [(&str, &str, BucketRead); 4] = [
            (
                "polygate_quota_bucket_level",
                "Level of each quota bucket (negative: debt).",
                |v| v.level,
            ),
            (
                "polygate_quota_bucket_capacity",
                "What each quota bucket holds when full (limit x burst / 60 s per minute).",
                |v| Some(v.capacity as f64),
            ),
            (
                "polygate_quota_bucket_refill_per_second",
                "Refill rate of each quota bucket.",
                |v| Some(v.refill_per_s),
            ),
            (
                "polygate_quota_bucket_debt",
                "How far each quota bucket is below zero.",
                |v| v.debt,
            ),
        ];
        for (name, help, read) in bucket_families {
            let mut m = family(enc, name, help, None, MetricType::Gauge)?;
            for (s, known) in &sources {
                // Capacity and refill come from the config; level and debt only from
                // a backend view this refresh could read.
                for v in s.buckets() {
                    let v = if *known {
                        v
                    } else {
                        BucketView {
                            level: None,
                            debt: None,
                            ..v
                        }
                    };
                    if let Some(x) = read(&v) {
                        let labels = [("source", s.name.as_str()), ("bucket", v.bucket.as_str())];
                        gauge(&mut m, &labels, x)?;
                    }
                }
            }
        }
        // Host-local, always live.
        let local: [(&str, &str, Option<Unit>, LocalRead); 4] = [
            (
                "polygate_memo_remaining",
                "Seconds this host still skips the source.",
                Some(Unit::Seconds),
                |s| Num::Float(s.memo_remaining.as_secs_f64()),
            ),
            (
                "polygate_pacer_ceiling",
                "AIMD concurrency ceiling on this host.",
                None,
                |s| Num::Float(s.pacer_ceiling),
            ),
            (
                "polygate_pacer_in_flight",
                "Permits in flight on this host.",
                None,
                |s| Num::Int(s.in_flight.into()),
            ),
            (
                "polygate_source_degraded",
                "1 while the source is served from local state (shared backend down).",
                None,
                |s| Num::Int(s.degraded.into()),
            ),
        ];
        for (name, help, unit, read) in &local {
            let mut m = family(enc, name, help, unit.as_ref(), MetricType::Gauge)?;
            for (s, _) in &sources {
                gauge(&mut m, &[("source", s.name.as_str())], read(s))?;
            }
        }
        Ok(())
    }

    fn encode_source_counters(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let engine = &self.exp.engine;
        type Pick = fn(&crate::engine::SourceCounters) -> &AtomicU64;
        let counters: [(&str, &str, Pick); 3] = [
            ("polygate_grants", "Permits granted.", |c| &c.grants),
            ("polygate_probes", "Half-open probes granted.", |c| {
                &c.probes
            }),
            (
                "polygate_abandoned",
                "Permits never reported (connection closed, call ended, lease expired).",
                |c| &c.abandoned,
            ),
        ];
        for (name, help, pick) in counters {
            let mut m = family(enc, name, help, None, MetricType::Counter)?;
            for src in &engine.sources {
                counter(&mut m, &[("source", &*src.name)], pick(&src.counters))?;
            }
        }
        let mut m = family(
            enc,
            "polygate_reports",
            "Reported outcomes, by outcome.",
            None,
            MetricType::Counter,
        )?;
        for src in &engine.sources {
            let c = &src.counters;
            for (outcome, v) in [
                ("success", &c.successes),
                ("failure", &c.failures),
                ("rate_limited", &c.rate_limited),
                ("cancelled", &c.cancelled),
            ] {
                counter(&mut m, &[("source", &*src.name), ("outcome", outcome)], v)?;
            }
        }
        Ok(())
    }

    fn encode_server(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let mut m = family(
            enc,
            "polygate_request_duration",
            "Time a worker request spent in the sidecar, from its task's start to its \
             reply being queued, by request type (an Acquire's waiting included).",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for (i, ty) in REQUEST_TYPES.iter().enumerate() {
            if let Some(h) = self.exp.server.requests(i) {
                h.encode(m.encode_family(&[("request", *ty)])?)?;
            }
        }
        if let Some(age) = self.shared_age {
            let mut m = family(
                enc,
                "polygate_shared_state_age",
                "Seconds since the breaker and quota gauges were last read from the \
                 shared backend (refreshed every metrics_refresh, never per scrape).",
                Some(&Unit::Seconds),
                MetricType::Gauge,
            )?;
            m.encode_gauge(&age)?;
        }
        Ok(())
    }
}

/// Reads one host-local gauge of a source.
type LocalRead = fn(&crate::engine::SourceStatus) -> Num;

/// How one bucket family reads its value from a bucket (`None`: no sample).
type BucketRead = fn(&BucketView) -> Option<f64>;

impl<B: Backend> prometheus_client::collector::Collector for Scrape<B> {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let engine = &self.exp.engine;
        let info = [
            ("version", env!("CARGO_PKG_VERSION")),
            ("backend", engine.backend_name()),
        ];
        family(
            &mut enc,
            "polygate",
            "Constant 1, labelled with version and backend.",
            None,
            MetricType::Info,
        )?
        .encode_info(&info)?;
        self.encode_scopes(&mut enc)?;
        self.encode_sources(&mut enc)?;
        self.encode_source_counters(&mut enc)?;
        self.encode_server(&mut enc)
    }
}
