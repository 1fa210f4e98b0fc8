//! The socket server: wire frames ↔ engine calls (§11, §11a, §12, §16).
//!
//! [`run`] accepts connections on a Unix listener until `shutdown` resolves. Each
//! connection checks the peer's credentials, requires a `Hello` first, then serves
//! many concurrent requests multiplexed by id. It is one task (`conn`): it reads
//! what the socket has, answers every request that needs no waiting right there
//! (`dispatch`: one poll of the engine, the reply encoded straight into the write
//! buffer) and writes the batch's replies at once; only requests still pending after
//! that poll — Acquires that really wait, remote-backend round trips — run as tasks.
//! `Cancel` aborts a pending `Acquire` or `Start` (or `Status`), and ends a `Retry`'s
//! wait, answered `Cancelled`; other requests are short and change engine state in
//! steps, so they are left to finish and answer normally. When a connection ends
//! (EOF, error, protocol violation, shutdown) its waits are aborted, its other
//! requests finish, and [`Engine::release_owner`] releases everything it held.
//!
//! Backpressure (`budget`): a connection has at most
//! [`ServerOptions::max_in_flight`] requests in flight (read, reply not yet written to
//! the socket); at the cap it stops reading, so a client that pipelines without
//! reading fills its own socket buffer instead of the daemon's memory. An Acquire
//! that waits for a source gives its slot back while it waits (it is bounded by the
//! calls it belongs to), so waiting calls never keep a connection's `Report`s from
//! being read; its answer takes a slot again before it is buffered.
//!
//! Shutdown: stop accepting, [`Engine::shutdown`] (waits end with `ShuttingDown`),
//! let connections drain for up to [`ServerOptions::shutdown_grace`] (a connection
//! closes as soon as it has no pending request and no unreported permit), then drop
//! whatever is left and release it.

mod budget;
mod conn;
pub mod convert;
mod dispatch;
mod guard;
mod snapshot;
mod transport;

use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::backend::Backend;
use crate::config::SidecarConfig;
use crate::engine::Engine;
use crate::peer::AccessPolicy;

/// Default for [`ServerOptions::max_in_flight`] (bindings/PROTOCOL.md §7, limits).
pub const MAX_IN_FLIGHT: usize = 1024;

/// How the server behaves; everything but `access` has a sensible default.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest accepted frame payload, in bytes (announced in `Welcome`).
    pub max_frame: u32,
    /// Who may connect and who may send admin requests.
    pub access: AccessPolicy,
    /// How long shutdown lets connections drain before dropping them.
    pub shutdown_grace: Duration,
    /// How long a new connection has to send its `Hello`.
    pub handshake_timeout: Duration,
    /// Period of [`Engine::reclaim_expired`].
    pub reclaim_interval: Duration,
    /// Requests one connection may have in flight (read, reply not yet written)
    /// before the server stops reading its frames (an Acquire waiting for a source
    /// does not count while it waits). At least 1.
    pub max_in_flight: usize,
    /// Worker connections served at once (`sidecar.max_connections`). Up to
    /// [`RESERVED_CONNECTIONS`] more are served to `admin_uids` peers only (decided
    /// from the peer's credentials at accept); any other peer past the cap, and
    /// everyone past the reserve, is refused `Overloaded`.
    pub max_connections: usize,
    /// A connection that holds no call, no permit and no request for this long is
    /// closed; so is one whose partial frame does not complete within it.
    pub idle_timeout: Duration,
    /// Sidecar-wide bytes of unsent replies (`sidecar.max_buffered`): past it no
    /// connection's frames are read until replies drain.
    pub max_buffered: u64,
    /// `sidecar.metrics_refresh`: the oldest a `Status`/`StatusJson` snapshot served
    /// to a client may be (§12; `snapshot`).
    pub status_refresh: Duration,
    /// Counters the server keeps (tests, debugging); shared by clones of the options.
    #[doc(hidden)]
    pub stats: Arc<ServerStats>,
    /// Per-request-type latency histograms for `/metrics`; shared by clones.
    pub metrics: Arc<crate::metrics::ServerMetrics>,
}

/// Live counters of a running server (tests, debugging).
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct ServerStats {
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
}

impl ServerStats {
    /// Requests in flight (holding an in-flight slot) over all connections; each
    /// connection brings it up to date every time it has run.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The most requests any one connection has had in progress at once.
    pub fn peak_in_flight(&self) -> usize {
        self.peak_in_flight.load(Ordering::Relaxed)
    }
}

impl ServerOptions {
    /// Defaults (1 s reclaim, 10 s handshake) with the given frame limit and policy.
    pub fn new(max_frame: u32, access: AccessPolicy) -> Self {
        ServerOptions {
            max_frame,
            access,
            shutdown_grace: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            reclaim_interval: Duration::from_secs(1),
            max_in_flight: MAX_IN_FLIGHT,
            max_connections: crate::limits::DEFAULT_MAX_CONNECTIONS as usize,
            idle_timeout: crate::config::DEFAULT_IDLE_TIMEOUT,
            max_buffered: crate::config::DEFAULT_MAX_BUFFERED,
            status_refresh: Duration::from_secs(5),
            stats: Arc::default(),
            metrics: Arc::default(),
        }
    }

    /// Options from the `[sidecar]` section.
    pub fn from_config(c: &SidecarConfig) -> Self {
        ServerOptions {
            shutdown_grace: c.shutdown_grace,
            max_connections: c
                .max_connections
                .map_or(crate::limits::DEFAULT_MAX_CONNECTIONS, |n| n)
                as usize,
            idle_timeout: c.idle_timeout,
            max_buffered: c.max_buffered,
            status_refresh: c.metrics_refresh,
            ..Self::new(c.max_frame, AccessPolicy::from_config(c))
        }
    }
}

/// State every connection shares with the accept loop.
pub(crate) struct Shared {
    pub opts: ServerOptions,
    /// Shutdown began: connections close once they hold nothing.
    pub draining: CancellationToken,
    /// The grace is over: connections close now.
    pub hard_stop: CancellationToken,
    /// The same two as flags: 1 draining, 2 hard stop. Connections read this on every
    /// run (`CancellationToken::is_cancelled` takes a lock every connection shares);
    /// the tokens are only there to wake them.
    phase: AtomicU8,
    /// Worker connections open (counted from accept until the connection is gone).
    pub connections: AtomicUsize,
    /// Bytes of unsent replies over every connection (each connection brings its
    /// share up to date every time it has run): the global budget `max_buffered`.
    pub buffered: AtomicU64,
    /// §12: the `Status`/`StatusJson` snapshots every connection is served from.
    pub status: snapshot::StatusCache,
}

/// One accepted connection in [`Shared::connections`]; counts down when dropped.
pub(crate) struct ConnSlot(pub Arc<Shared>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Connections accepted beyond `max_connections` for `admin_uids` peers only.
pub use crate::limits::RESERVED_CONNECTIONS;

impl Shared {
    pub fn new(opts: ServerOptions) -> Shared {
        Shared {
            status: snapshot::StatusCache::new(opts.status_refresh),
            opts,
            draining: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            phase: AtomicU8::new(0),
            connections: AtomicUsize::new(0),
            buffered: AtomicU64::new(0),
        }
    }

    /// Begin the drain.
    pub fn drain(&self) {
        self.phase.fetch_max(1, Ordering::Release);
        self.draining.cancel();
    }

    /// End the grace: connections close now.
    pub fn stop_now(&self) {
        self.phase.store(2, Ordering::Release);
        self.hard_stop.cancel();
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.phase.load(Ordering::Acquire) >= 1
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.phase.load(Ordering::Acquire) >= 2
    }
}

/// Why [`run`] stopped other than by its shutdown signal.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// `accept` failed with an error that retrying cannot fix.
    #[error("accepting connections failed: {0}")]
    Accept(#[source] io::Error),
}

/// Serve `listener` until `shutdown` resolves (or accepting fails for good), then shut
/// down gracefully: see the module docs. Returns once every connection is gone.
pub async fn run<B, F>(
    listener: UnixListener,
    engine: Arc<Engine<B>>,
    opts: ServerOptions,
    shutdown: F,
) -> Result<(), ServerError>
where
    B: Backend,
    F: Future<Output = ()>,
{
    let shared = Arc::new(Shared::new(opts));
    let tracker = TaskTracker::new();
    tracker.spawn(reclaim_loop(
        engine.clone(),
        shared.opts.reclaim_interval,
        shared.draining.clone(),
    ));
    let next_id = AtomicU64::new(1);

    tokio::pin!(shutdown);
    let result = loop {
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                    let open = shared.connections.fetch_add(1, Ordering::AcqRel) + 1;
                    let slot = ConnSlot(shared.clone());
                    let max = shared.opts.max_connections.max(1);
                    if open > max + RESERVED_CONNECTIONS as usize {
                        tracker.spawn(guard::refuse(stream, id, slot));
                    } else {
                        let reserved = open > max;
                        tracker.spawn(conn::serve(stream, id, engine.clone(), slot, reserved));
                    }
                }
                Err(e) if is_transient(&e) => {
                    warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => break Err(ServerError::Accept(e)),
            },
        }
    };
    drop(listener);

    info!(
        connections = tracker.len().saturating_sub(1),
        grace = ?shared.opts.shutdown_grace,
        "shutting down: no longer accepting"
    );
    engine.shutdown();
    shared.drain();
    tracker.close();
    if tokio::time::timeout(shared.opts.shutdown_grace, tracker.wait())
        .await
        .is_err()
    {
        warn!(
            connections = tracker.len(),
            "shutdown grace elapsed; dropping remaining connections"
        );
        shared.stop_now();
        tracker.wait().await;
    }
    debug!("server stopped");
    result
}

/// Accept errors that come and go (resource exhaustion, aborted handshakes).
fn is_transient(e: &io::Error) -> bool {
    use nix::errno::Errno;
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
            | io::ErrorKind::OutOfMemory
    ) || e.raw_os_error().is_some_and(|n| {
        [Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM]
            .iter()
            .any(|x| *x as i32 == n)
    })
}

/// Reclaim permits whose lease expired, every `every`, until `stop`.
async fn reclaim_loop<B: Backend>(
    engine: Arc<Engine<B>>,
    every: Duration,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                let n = engine.reclaim_expired().await;
                if n > 0 {
                    warn!(permits = n, "reclaimed permits whose lease expired unreported");
                }
            }
        }
    }
}
