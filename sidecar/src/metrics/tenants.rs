//! §19's families: per scope with tenants, the totals over every tenant this host has
//! served (labelled {scope}), and per-tenant families for the top
//! `sidecar.tenant_metrics_top` tenants by dollars settled here only (labelled
//! {scope, tenant}; 0 = none), so a scrape's series stay bounded however many tenant
//! ids the workers send. A tenant id is any UTF-8: the encoder escapes `\`, `"` and
//! newlines in label values as OpenMetrics says. Scopes without tenants add no series.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::{family, gauge, Scrape};
use crate::backend::Backend;
use crate::config::NANOS_PER_USD;
use crate::engine::{TenantStats, TenantsStatus};

/// A counter's value: an integer, or dollars.
enum Count {
    /// A count.
    Int(u64),
    /// Dollars (from n$).
    Usd(f64),
}

/// A family of [`COUNTERS`] or [`GAUGES`]: its name's tail, the start of its help,
/// and how a tenant's figures give its value.
type Spec<V> = (&'static str, &'static str, fn(&TenantStats) -> V);

/// The counters every tenant and every scope's totals have.
const COUNTERS: [Spec<Count>; 4] = [
    ("grants", "Permits granted to calls of", |s| {
        Count::Int(s.grants)
    }),
    ("refusals", "Calls refused by the tenant limits of", |s| {
        Count::Int(s.refused)
    }),
    ("tokens", "Tokens settled on this host for", |s| {
        Count::Int(s.tokens)
    }),
    ("usd_spent", "Dollars settled on this host for", |s| {
        Count::Usd(s.spend as f64 / NANOS_PER_USD)
    }),
];

/// The gauges.
const GAUGES: [Spec<u32>; 2] = [
    ("calls", "Live calls on this host of", |s| s.calls),
    ("in_flight", "Permits in flight on this host of", |s| {
        s.in_flight
    }),
];

impl<B: Backend> Scrape<B> {
    /// §19: `polygate_tenants_*` {scope} (the totals, and how many tenants this host
    /// tracks), then `polygate_tenant_*` {scope, tenant} for the top N.
    pub(super) fn encode_tenants(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let scopes: Vec<(&str, &TenantsStatus)> = self
            .status
            .iter()
            .filter_map(|sc| Some((sc.name.as_str(), sc.tenants.as_ref()?)))
            .collect();
        if scopes.is_empty() {
            return Ok(());
        }
        let mut m = family(
            enc,
            "polygate_tenants_tracked",
            "Tenants of the scope this host tracks now (at most its max_tenants).",
            None,
            MetricType::Gauge,
        )?;
        for (scope, t) in &scopes {
            gauge(&mut m, &[("scope", *scope)], t.tracked as u64)?;
        }
        for (name, help, v) in GAUGES {
            let full = format!("polygate_tenants_{name}");
            let mut m = family(
                enc,
                &full,
                &format!("{help} every tenant of the scope."),
                None,
                MetricType::Gauge,
            )?;
            for (scope, t) in &scopes {
                gauge(&mut m, &[("scope", *scope)], v(&t.totals))?;
            }
        }
        for (name, help, v) in COUNTERS {
            let full = format!("polygate_tenants_{name}");
            let mut m = family(
                enc,
                &full,
                &format!("{help} every tenant of the scope (tenants this host forgot included)."),
                None,
                MetricType::Counter,
            )?;
            for (scope, t) in &scopes {
                count(&mut m, &[("scope", *scope)], v(&t.totals))?;
            }
        }
        let top = self.exp.engine.tenant_metrics_top();
        if top == 0 {
            return Ok(());
        }
        let tenants = || {
            scopes.iter().flat_map(|(scope, t)| {
                t.top
                    .iter()
                    .take(top)
                    .map(move |(id, s)| ([("scope", *scope), ("tenant", id.as_str())], s))
            })
        };
        for (name, help, v) in GAUGES {
            let full = format!("polygate_tenant_{name}");
            let mut m = family(
                enc,
                &full,
                &format!("{help} the tenant (top tenant_metrics_top by dollars settled here)."),
                None,
                MetricType::Gauge,
            )?;
            for (labels, s) in tenants() {
                gauge(&mut m, &labels, v(s))?;
            }
        }
        for (name, help, v) in COUNTERS {
            let full = format!("polygate_tenant_{name}");
            let mut m = family(
                enc,
                &full,
                &format!("{help} the tenant (top tenant_metrics_top by dollars settled here)."),
                None,
                MetricType::Counter,
            )?;
            for (labels, s) in tenants() {
                count(&mut m, &labels, v(s))?;
            }
        }
        Ok(())
    }
}

/// One counter sample of `c`.
fn count(m: &mut MetricEncoder<'_>, labels: &impl EncodeLabelSet, c: Count) -> fmt::Result {
    let mut m = m.encode_family(labels)?;
    match c {
        Count::Int(v) => m.encode_counter::<NoLabelSet, u64, u64>(&v, None),
        Count::Usd(v) => m.encode_counter::<NoLabelSet, f64, u64>(&v, None),
    }
}
