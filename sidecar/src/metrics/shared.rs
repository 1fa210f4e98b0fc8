//! The shared backend's view of every source (breaker, quota) as `/metrics` shows
//! it on a remote backend (§12: a scrape costs Redis nothing): read in the
//! background every `metrics_refresh` by [`spawn_refresh`], one snapshot per source
//! per refresh, all at once, whatever the scrape rate.
//!
//! Staleness: a gauge is at most one refresh period plus one refresh's duration old
//! (each snapshot is bounded by `redis_timeout`); durations (`retry_after`,
//! `quota_blocked`) count down from the refresh to the scrape, and
//! `polygate_shared_state_age_seconds` says how old the view is. A source whose
//! snapshot failed has no breaker/quota samples until the next refresh succeeds.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Backend, SourceSnapshot};
use crate::engine::{Engine, ScopeStatus};

/// One refresh's result.
#[derive(Debug)]
struct Refreshed {
    /// When the refresh finished.
    at: Instant,
    /// Source name → its snapshot (`None`: the snapshot failed).
    by_source: HashMap<String, Option<SourceSnapshot>>,
}

/// The last refresh, shared by the refresher and the renderer.
#[derive(Debug, Default)]
pub struct SharedView {
    /// `None` until the first refresh finished.
    last: RwLock<Option<Refreshed>>,
}

impl SharedView {
    /// Keep `by_source` as the view, refreshed now.
    fn store(&self, by_source: HashMap<String, Option<SourceSnapshot>>) {
        let r = Refreshed {
            at: Instant::now(),
            by_source,
        };
        *self.last.write().unwrap_or_else(|p| p.into_inner()) = Some(r);
    }

    /// Fill `shared` of every source of `status` from the view (counting durations
    /// down by the view's age); for each source, whether it is known.
    pub fn overlay(&self, status: &mut [ScopeStatus]) -> Vec<Vec<bool>> {
        let last = self.last.read().unwrap_or_else(|p| p.into_inner());
        status
            .iter_mut()
            .map(|sc| {
                sc.sources
                    .iter_mut()
                    .map(|s| {
                        let Some(r) = last.as_ref() else {
                            return false;
                        };
                        let Some(Some(snap)) = r.by_source.get(&s.name) else {
                            return false;
                        };
                        let age = r.at.elapsed();
                        s.shared = SourceSnapshot {
                            retry_after: snap.retry_after.saturating_sub(age),
                            quota_blocked: snap.quota_blocked.saturating_sub(age),
                            ..*snap
                        };
                        true
                    })
                    .collect()
            })
            .collect()
    }

    /// Seconds since the last refresh finished (`None` before the first).
    pub fn age(&self) -> Option<f64> {
        let last = self.last.read().unwrap_or_else(|p| p.into_inner());
        last.as_ref().map(|r| r.at.elapsed().as_secs_f64())
    }
}

/// Read every source's shared state once (each distinct source once, with the
/// parameters of the first scope naming it, all concurrently).
async fn refresh_once<B: Backend>(engine: &Engine<B>, view: &SharedView) {
    let mut seen = vec![false; engine.sources.len()];
    let mut reads = Vec::new();
    for sc in &engine.scopes {
        let bp = sc.policy().bp;
        for &idx in &sc.sources {
            if std::mem::replace(&mut seen[idx], true) {
                continue;
            }
            let src = &engine.sources[idx];
            let qp = src.params().qp;
            reads.push(async move {
                let r = engine.backend().snapshot(&src.name, &bp, &qp).await;
                if let Err(e) = &r {
                    tracing::debug!(source = %src.name, error = %e, "metrics: backend snapshot failed");
                }
                (src.name.to_string(), r.ok())
            });
        }
    }
    let by_source = futures_util::future::join_all(reads)
        .await
        .into_iter()
        .collect();
    view.store(by_source);
}

/// Refresh `view` from `engine`'s backend now and then every `every`, until the task
/// is aborted. A slow refresh delays the next one (never two at once).
pub fn spawn_refresh<B: Backend>(
    engine: Arc<Engine<B>>,
    view: Arc<SharedView>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            refresh_once(&engine, &view).await;
        }
    })
}
