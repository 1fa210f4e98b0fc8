//! §20 `sidecar.idle_exit`: stop the daemon once no worker connection has been open
//! for that long, as SIGTERM would (the socket, and an autostarted sidecar's lock
//! file, are removed on the way out).
//!
//! It looks at the server's connection counters a few times per bound: "no
//! connection" means none open *and* none accepted since the last look, so a client
//! that connects and leaves between two looks still restarts the clock. The clock
//! starts at the first look that finds nothing, so the exit comes `idle_exit` to
//! `idle_exit` + two looks after the last connection closed, never earlier.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::info;

use super::signals::Lifecycle;
use super::systemd::{self, sd_notify};
use crate::server::ServerStats;

/// The longest gap between two looks at the counters: the exit comes at most this
/// late (plus the drain, which has no connection to wait for).
const MAX_TICK: Duration = Duration::from_millis(250);

/// Watch `stats` and begin the shutdown once no connection was open for `after`.
pub(super) fn spawn(
    stats: Arc<ServerStats>,
    after: Duration,
    lifecycle: Lifecycle,
) -> tokio::task::JoinHandle<()> {
    let tick = (after / 4).clamp(Duration::from_millis(10), MAX_TICK);
    tokio::spawn(async move {
        // The first look that found nothing open (never earlier than the last close).
        let mut idle_since = Some(Instant::now());
        let mut seen = stats.connections().1;
        loop {
            tokio::time::sleep(tick).await;
            let (open, accepted) = stats.connections();
            let now = Instant::now();
            if open > 0 || accepted != seen {
                seen = accepted;
                idle_since = None;
                continue;
            }
            if now.duration_since(*idle_since.get_or_insert(now)) < after {
                continue;
            }
            let _order = lifecycle.notify_lock();
            if !lifecycle.stop.is_cancelled() {
                info!(
                    idle_exit = %humantime::format_duration(after),
                    "no connection for sidecar.idle_exit: shutting down"
                );
                sd_notify("STOPPING", systemd::stopping());
                lifecycle.stop.cancel();
            }
            return;
        }
    })
}
