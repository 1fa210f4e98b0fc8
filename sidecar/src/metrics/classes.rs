//! Per-priority-class families (§15), labelled {scope, class}: what each class holds,
//! waits for and is granted. Scopes without classes add no series.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::{family, gauge, Scrape};
use crate::backend::Backend;
use crate::engine::ClassStatus;

impl<B: Backend> Scrape<B> {
    /// §15: per priority class, labelled {scope, class}; scopes without classes add
    /// no series.
    pub(super) fn encode_classes(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        self.class_gauge(
            enc,
            "polygate_class_waiters",
            "Acquires of the priority class currently waiting.",
            |c| c.waiters,
        )?;
        self.class_gauge(
            enc,
            "polygate_class_grant_share",
            "The class's share of the scope's grants on this host.",
            |c| c.grant_share,
        )?;
        self.class_gauge(
            enc,
            "polygate_class_in_flight",
            "Pacer slots the class holds on this host.",
            |c| c.in_flight,
        )?;
        let mut m = family(
            enc,
            "polygate_class_grants",
            "Permits granted to calls of the class.",
            None,
            MetricType::Counter,
        )?;
        for (scope, c) in self.classes() {
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
        for (scope, c) in self.classes() {
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

    /// Every class of every scope, with its scope's name, status order.
    fn classes(&self) -> impl Iterator<Item = (&str, &ClassStatus)> {
        self.status
            .iter()
            .flat_map(|sc| sc.classes.iter().map(move |c| (sc.name.as_str(), c)))
    }

    /// One gauge family labelled {scope, class}, a sample per class. `value` keeps
    /// its type, so an integer field is exposed without a decimal point and a float
    /// with one.
    fn class_gauge<V: EncodeGaugeValue>(
        &self,
        enc: &mut DescriptorEncoder<'_>,
        name: &str,
        help: &str,
        value: impl Fn(&ClassStatus) -> V,
    ) -> fmt::Result {
        let mut m = family(enc, name, help, None, MetricType::Gauge)?;
        for (scope, c) in self.classes() {
            gauge(
                &mut m,
                &[("scope", scope), ("class", c.name.as_str())],
                value(c),
            )?;
        }
        Ok(())
    }
}
