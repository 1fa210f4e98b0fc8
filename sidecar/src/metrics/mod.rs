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
//!
//! This module holds the exposition, the scope and server families and the shared
//! encoding helpers; the per-source families live in `sources`, §15's per-class
//! families in `classes`.

mod classes;
mod shared;
mod sources;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ipc_protocol::Request;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::backend::Backend;
use crate::engine::{Engine, ScopeStatus};
pub use crate::histogram::Histogram;
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
        Request::Report { .. } | Request::ReportObserved { .. } => 3,
        Request::EndCall { .. } => 4,
        Request::Status => 5,
        Request::ForceOpen { .. } => 6,
        Request::ForceClose { .. } => 7,
        Request::Reset { .. } => 8,
        Request::Ping => 9,
        Request::Cancel { .. } => 10,
        Request::Start(_) => 11,
        Request::Retry { .. } | Request::RetryObserved { .. } => 12,
        Request::Finish { .. } | Request::FinishObserved { .. } => 13,
        Request::Begin(_) => 14,
        Request::StatusJson => 15,
    }
}

/// Whether requests of type `ty` ([`request_type`]) change nothing: `Status`,
/// `StatusJson` and `Ping` (the status snapshots count every other answer as a
/// change).
pub fn is_read_only(ty: usize) -> bool {
    matches!(ty, 5 | 9 | 15)
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
                .map(|_| Histogram::new(crate::histogram::REQUEST_BUCKETS))
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

impl<B: Backend> Scrape<B> {
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
            for (kind, v) in sc.counters.errors.by_kind() {
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
        if let Some(v) = self.exp.engine.degraded_share() {
            let mut m = family(
                enc,
                "polygate_degraded_share",
                "Share of every shared quota this host uses while Redis cannot be read \
                 (sidecar.degraded_share: 1 / live hosts under auto).",
                None,
                MetricType::Gauge,
            )?;
            m.encode_gauge(&v.share)?;
            let mut m = family(
                enc,
                "polygate_live_hosts",
                "Sidecars whose heartbeat under this key prefix was live when last read.",
                None,
                MetricType::Gauge,
            )?;
            m.encode_gauge(&(v.live_hosts as i64))?;
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
