//! `Status` / `StatusJson` from a snapshot (DESIGN §12 "Bounded under abuse",
//! issue 21 item 6): a client flooding them must not slow other clients' calls.
//!
//! Building a report walks every scope and source (and on Redis asks the backend for
//! each): on a 3,000-source config a flood of `StatusJson` raised a healthy
//! client's call p50 from 0.22 ms to 112 ms. So a report, once built, is kept and
//! served again to every status request that arrives while it is young enough:
//!
//! - **at most `sidecar.metrics_refresh` old** (the bound §12 and §11b set), and
//! - **no older than [`COST_FACTOR`] × what building it took**, and kept at all only
//!   when building it took at least [`MIN_CACHED_COST`]: a report that costs next to
//!   nothing (a small config) is built for every request, so what a client reads is
//!   current, as before; one that costs milliseconds is kept for up to
//!   `COST_FACTOR` times that, so status costs at most ~1/`COST_FACTOR` of a thread
//!   however fast clients ask.
//! - **Read your writes**: a connection that sent any request other than a status
//!   request or `Ping` since its last status gets a fresh build (which refreshes the
//!   snapshot for everyone), so a client that acts and then looks sees its act.
//!
//! One build at a time per kind: concurrent requests wait for the build under way
//! and take its result instead of building their own.
//!
//! Serving a snapshot still costs its bytes (a clone, the encoding, the write: ~2 MB
//! for 3,000 sources), and a client can ask as fast as it reads. So status replies
//! are also **paced by bytes**, sidecar-wide: [`STATUS_BYTES_PER_S`] refill a bucket
//! of [`STATUS_BURST`] bytes, and a reply the bucket cannot pay for is sent when it
//! could (the request waits on a timer, costing nothing meanwhile). Small configs
//! never notice (a 10-source report is a few KiB: thousands per second); on 3,000
//! sources a flood gets ~30 replies a second and the other clients keep their core
//! (docs/benchmarks.md, `--scenario status-flood`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use ipc_protocol::Reply;

use super::convert;
use crate::backend::Backend;
use crate::engine::Engine;

/// A snapshot is served for up to this many times what building it took (and never
/// past `metrics_refresh`): status building takes at most ~1/32 of a thread.
pub const COST_FACTOR: u32 = 32;

/// Sidecar-wide rate of status reply bytes (see the module docs).
pub const STATUS_BYTES_PER_S: f64 = 64.0 * 1024.0 * 1024.0;

/// Bytes of status replies that may go out at once before the pacing applies: the
/// largest reply (16 MiB), so any one report is served at once when none preceded it.
pub const STATUS_BURST: f64 = 16.0 * 1024.0 * 1024.0;

/// A report built faster than this is not kept: it costs about what serving any
/// request does, and rebuilding it keeps status exact for small configs.
pub const MIN_CACHED_COST: Duration = Duration::from_millis(1);

/// Which report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Report {
    /// `Status`: the fixed-layout report.
    Status = 0,
    /// `StatusJson`: the JSON document.
    Json = 1,
}

/// One built report.
struct Snap {
    /// When its build finished.
    built: Instant,
    /// How long it may be served: `min(metrics_refresh, COST_FACTOR × build time)`.
    valid_for: Duration,
    /// The reply, cloned for each request it answers.
    reply: Reply,
    /// Its encoded size, what the pacing charges per reply.
    bytes: usize,
}

/// The byte bucket of the pacing.
struct Pace {
    /// Bytes that may go out now (negative: owed by replies already scheduled).
    level: f64,
    /// When `level` was last brought up to date.
    at: Instant,
}

/// The status snapshots of one server.
pub(crate) struct StatusCache {
    /// `sidecar.metrics_refresh`: the oldest a served snapshot may be.
    refresh: Duration,
    /// The last report of each [`Report`].
    snaps: [Mutex<Option<Snap>>; 2],
    /// Held while a report of that kind is built (one build at a time).
    building: [tokio::sync::Mutex<()>; 2],
    /// The sidecar-wide byte pacing of status replies.
    pace: Mutex<Pace>,
}

impl StatusCache {
    /// Snapshots kept for at most `refresh`.
    pub fn new(refresh: Duration) -> StatusCache {
        StatusCache {
            refresh,
            snaps: [Mutex::new(None), Mutex::new(None)],
            building: [tokio::sync::Mutex::new(()), tokio::sync::Mutex::new(())],
            pace: Mutex::new(Pace {
                level: STATUS_BURST,
                at: Instant::now(),
            }),
        }
    }

    /// Charge `bytes` to the pacing: how long the reply must wait before it goes out.
    fn charge(&self, bytes: usize) -> Duration {
        let mut p = self.pace.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let dt = now.saturating_duration_since(p.at).as_secs_f64();
        p.level = (p.level + dt * STATUS_BYTES_PER_S).min(STATUS_BURST);
        p.at = now;
        p.level -= bytes as f64;
        if p.level >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-p.level / STATUS_BYTES_PER_S)
        }
    }

    /// The report of `kind` (see [`StatusCache::report`]), sent when the byte pacing
    /// allows.
    pub async fn get<B: Backend>(&self, kind: Report, engine: &Engine<B>, fresh: bool) -> Reply {
        let (reply, bytes) = self.report(kind, engine, fresh).await;
        let wait = self.charge(bytes);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        reply
    }

    /// The snapshot of `kind` if it may still be served, with its size.
    fn cached(&self, kind: Report) -> Option<(Reply, usize)> {
        let snap = self.snaps[kind as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        snap.as_ref()
            .filter(|s| s.built.elapsed() < s.valid_for)
            .map(|s| (s.reply.clone(), s.bytes))
    }

    /// The report of `kind` and its encoded size: the snapshot while it is young
    /// enough (see the module docs), else a new build, kept for the requests that
    /// follow. `fresh`: the asking connection changed something since its last
    /// status (read your writes).
    async fn report<B: Backend>(
        &self,
        kind: Report,
        engine: &Engine<B>,
        fresh: bool,
    ) -> (Reply, usize) {
        if !fresh {
            if let Some(r) = self.cached(kind) {
                return r;
            }
        }
        let _building = self.building[kind as usize].lock().await;
        if !fresh {
            // Built by the request this one waited behind.
            if let Some(r) = self.cached(kind) {
                return r;
            }
        }
        let started = Instant::now();
        let scopes = engine.status().await;
        let reply = match kind {
            Report::Status => Reply::Status(convert::status_report(engine.backend_name(), scopes)),
            Report::Json => Reply::StatusJson(convert::status_json(
                engine.backend_name(),
                engine.degraded_share(),
                &scopes,
            )),
        };
        let cost = started.elapsed();
        let bytes = match &reply {
            Reply::StatusJson(doc) => doc.len(),
            r => ipc_protocol::encode_server(&ipc_protocol::ServerFrame {
                id: 0,
                reply: r.clone(),
            })
            .map_or(0, |v| v.len()),
        };
        let snap = Snap {
            built: Instant::now(),
            valid_for: match cost >= MIN_CACHED_COST {
                true => cost.saturating_mul(COST_FACTOR).min(self.refresh),
                false => Duration::ZERO,
            },
            reply: reply.clone(),
            bytes,
        };
        *self.snaps[kind as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(snap);
        (reply, bytes)
    }
}
