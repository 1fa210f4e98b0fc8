//! Per-source families (§12): the breaker and quota gauges read from the backend's
//! view (refreshed in the background on a remote backend, see [`super::SharedView`]),
//! the host-local pacer and memo, and the grant, probe, abandon and report counters.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use super::{counter, family, gauge, Scrape};
use crate::backend::{Backend, SourceSnapshot, State};
use crate::engine::BucketView;

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

/// Reads one host-local gauge of a source.
type LocalRead = fn(&crate::engine::SourceStatus) -> Num;

/// How one bucket family reads its value from a bucket (`None`: no sample).
type BucketRead = fn(&BucketView) -> Option<f64>;

impl<B: Backend> Scrape<B> {
    /// Every source once (a source named by several scopes is one source), with
    /// whether its shared state is known.
    pub(super) fn sources(&self) -> Vec<(&crate::engine::SourceStatus, bool)> {
        let mut seen = HashSet::new();
        self.status
            .iter()
            .zip(&self.known)
            .flat_map(|(sc, k)| sc.sources.iter().zip(k.iter().copied()))
            .filter(|(s, _)| seen.insert(s.name.as_str()))
            .collect()
    }

    pub(super) fn encode_sources(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
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
        let bucket_families: [(&str, &str, BucketRead); 7] = [
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
            // §18: the provider's last word on each bucket.
            (
                "polygate_quota_observed_remaining",
                "What the provider's rate-limit headers last said was left in each bucket.",
                |v| v.observed.map(|o| o.remaining as f64),
            ),
            (
                "polygate_quota_observed_age_seconds",
                "How long ago the provider's last rate-limit headers on each bucket were seen.",
                |v| v.observed.map(|o| o.age.as_secs_f64()),
            ),
            (
                "polygate_quota_observed_removed",
                "Running total the provider's headers took off each bucket: the traffic PolyGate did not see.",
                |v| v.observed.map(|o| o.removed as f64),
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
                            observed: None,
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

    pub(super) fn encode_source_counters(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
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
        // §12: the breaker transitions this host observed (the same events as the
        // log lines, none dropped); `to="blocked"` counts 429 blocks of the quota.
        let mut m = family(
            enc,
            "polygate_breaker_transitions",
            "Breaker state changes this host observed, by scope, source, from, to and reason.",
            None,
            MetricType::Counter,
        )?;
        for (scope, source, from, to, reason, n) in engine.breaker_transitions() {
            let labels = [
                ("scope", scope),
                ("source", source),
                ("from", from),
                ("to", to),
                ("reason", reason),
            ];
            m.encode_family(&labels)?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, u64, u64>(&n, None)?;
        }
        Ok(())
    }
}
