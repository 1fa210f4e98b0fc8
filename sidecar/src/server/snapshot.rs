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
//! - **exact while building is cheap**: every request other than a status request
//!   or `Ping` counts a change when it is answered (and a connection's end counts
//!   one: it releases what it held). A report that cost less than [`SHARED_COST`]
//!   to build is served again only while no change was counted since its build
//!   began, so whoever saw a reply — on any connection — and then asks for status
//!   sees that request's effect: a script or test that acts on one connection and
//!   looks on another reads exactly what it did, which is what small and medium
//!   configs (the common case) get.
//! - **shared while building is expensive**: a report that cost [`SHARED_COST`] or
//!   more (thousands of sources) is shared, changes or not, while it is young
//!   enough: under calls going on all the time, this is what keeps a flood from
//!   rebuilding it for every request. **Read your writes** still holds: it is served
//!   only to a connection whose own last answered change (or whose accept) came
//!   before its build began; any other gets a fresh build (which refreshes the
//!   snapshot for everyone).
//! - What changes with no request (refill over time, a cooldown running out,
//!   another host's writes in Redis) is at most the age above behind.
//!
//! One build at a time per kind: concurrent requests wait for the build under way
//! and take its result when it may be served to them (always when that build
//! began after they arrived: it holds everything answered before they asked),
//! instead of building their own.
//!
//! A report is kept **encoded**: the whole frame (length prefix, id 0, reply), built
//! once, shared by every request it answers (a reference count, no copy) and copied
//! into the connection's write buffer with the request's id set. Serving it still
//! costs its bytes (the copy, the write: ~2 MB for 3,000 sources), and a client can
//! ask as fast as it reads. So status replies are also **paced by bytes**,
//! sidecar-wide: [`STATUS_BYTES_PER_S`] refill a bucket of [`STATUS_BURST`] bytes, and
//! a reply the bucket cannot pay for is sent when it could (the request waits on a
//! timer). Small configs never notice (a 10-source report is a few KiB: thousands
//! per second); on 3,000 sources a flood gets ~30 replies a second and the other
//! clients keep their core (docs/benchmarks.md, `--scenario status-flood`).
//!
//! What a status request holds while it is built, paced and buffered is charged to
//! its connection's byte budget from the moment its frame is read
//! (`budget::Reserved`, sized by [`StatusCache::estimate`] until the reply exists):
//! a client that asks and does not read gets no more status replies in flight than
//! its unsent-bytes bound holds (issue 29 item 2: before, every paced request held
//! its own copy of the reply outside any budget).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ipc_protocol::{ErrorKind, Reply, ServerCodec, ServerFrame};
use tokio_util::codec::Encoder;
use tracing::warn;

use super::budget::Reserved;
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

/// A report that took at least this long to build is shared with stale reads
/// allowed (see the module docs); a cheaper one is served again only while
/// nothing changed. A config of a few hundred sources builds well under it; the
/// 3,000-source report of issue 21 item 6 took ~70 ms.
pub const SHARED_COST: Duration = Duration::from_millis(10);

/// What a status request reserves of its connection's byte budget before any
/// report of its kind was built (then the last build's size is the estimate).
pub const FIRST_ESTIMATE: usize = 64 * 1024;

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
    /// When its build began: a request that arrived before then may take it
    /// whatever changed since (it holds all that was answered before the request).
    began: Instant,
    /// The change count when its build began: it may be served to later requests
    /// only while the count is still this.
    changes: u64,
    /// When its build finished.
    built: Instant,
    /// It took [`SHARED_COST`] or more to build: served even after changes, while
    /// young enough, to connections whose own last change it includes.
    shared: bool,
    /// How long it may be served: `min(metrics_refresh, COST_FACTOR × build time)`.
    valid_for: Duration,
    /// The reply's whole frame (id 0), shared by every request it answers; its
    /// length is what the pacing charges and the byte budgets count.
    frame: Bytes,
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
    /// Requests answered (other than status and `Ping`) and connections ended: a
    /// snapshot built before the last of them is not served again.
    changes: AtomicU64,
    /// The frame size of the last build of each [`Report`] (0: none yet): what a
    /// status request reserves when its frame is read ([`StatusCache::estimate`]).
    sizes: [AtomicUsize; 2],
    /// `sidecar.max_frame`, the limit the frames are encoded with (status replies
    /// may be larger: up to `ipc_protocol::MAX_STATUS_FRAME`).
    max_frame: usize,
}

impl StatusCache {
    /// Snapshots kept for at most `refresh`, encoded within `max_frame`.
    pub fn new(refresh: Duration, max_frame: usize) -> StatusCache {
        StatusCache {
            refresh,
            snaps: [Mutex::new(None), Mutex::new(None)],
            building: [tokio::sync::Mutex::new(()), tokio::sync::Mutex::new(())],
            pace: Mutex::new(Pace {
                level: STATUS_BURST,
                at: Instant::now(),
            }),
            changes: AtomicU64::new(0),
            sizes: [AtomicUsize::new(0), AtomicUsize::new(0)],
            max_frame,
        }
    }

    /// The bytes a request for `kind` is expected to take: the last build's size
    /// ([`FIRST_ESTIMATE`] before any).
    pub fn estimate(&self, kind: Report) -> usize {
        match self.sizes[kind as usize].load(Ordering::Relaxed) {
            0 => FIRST_ESTIMATE,
            n => n,
        }
    }

    /// Count a change: a request that may have changed state was answered, or a
    /// connection ended. Called before the reply is written, so a client that saw
    /// the reply and asks for status gets a build that includes it.
    pub fn changed(&self) -> u64 {
        self.changes.fetch_add(1, Ordering::Release) + 1
    }

    /// The change count now (a new connection's `seen`: it reads everything
    /// answered before it connected).
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
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

    /// The report of `kind` as a whole frame with id 0 (see [`StatusCache::report`]),
    /// once the byte pacing allows; `held` (the request's reservation) is set to its
    /// size as soon as it exists.
    pub(super) async fn get<B: Backend>(
        &self,
        kind: Report,
        engine: &Engine<B>,
        seen: u64,
        held: &mut Reserved,
    ) -> Bytes {
        let frame = self.report(kind, engine, seen).await;
        held.resize(frame.len());
        let wait = self.charge(frame.len());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        frame
    }

    /// The snapshot of `kind` if it may still be served to a request that arrived
    /// at `asked` from a connection that has seen the change count `seen` (its own
    /// last change, or its accept), with its size: one whose build began after
    /// `asked`; else one young enough, if nothing was answered since its build began,
    /// or if it is a shared (expensive) one built after `seen`.
    fn cached(&self, kind: Report, asked: Instant, seen: u64) -> Option<Bytes> {
        let snap = self.snaps[kind as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let changes = self.changes.load(Ordering::Acquire);
        snap.as_ref()
            .filter(|s| {
                s.began >= asked
                    || (s.built.elapsed() < s.valid_for
                        && (s.changes == changes || (s.shared && s.changes >= seen)))
            })
            .map(|s| s.frame.clone())
    }

    /// The report of `kind`, encoded: a snapshot that may be served (see the module
    /// docs), else a new build, kept for the requests that follow.
    async fn report<B: Backend>(&self, kind: Report, engine: &Engine<B>, seen: u64) -> Bytes {
        let asked = Instant::now();
        if let Some(r) = self.cached(kind, asked, seen) {
            return r;
        }
        let _building = self.building[kind as usize].lock().await;
        // Built by the request this one waited behind, if it may be served.
        if let Some(r) = self.cached(kind, asked, seen) {
            return r;
        }
        let changes = self.changes.load(Ordering::Acquire);
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
        let frame = self.encode(reply);
        let cost = started.elapsed();
        self.sizes[kind as usize].store(frame.len(), Ordering::Relaxed);
        let snap = Snap {
            began: started,
            changes,
            built: Instant::now(),
            shared: cost >= SHARED_COST,
            valid_for: match cost >= MIN_CACHED_COST {
                true => cost.saturating_mul(COST_FACTOR).min(self.refresh),
                false => Duration::ZERO,
            },
            frame: frame.clone(),
        };
        *self.snaps[kind as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(snap);
        frame
    }

    /// `reply` as a whole frame with id 0 (the connection sets each request's id). A
    /// report that cannot be framed (larger than `MAX_STATUS_FRAME`) becomes an
    /// `Internal` error, so whoever asked still gets an answer.
    fn encode(&self, reply: Reply) -> Bytes {
        let mut codec = ServerCodec::new(self.max_frame);
        let mut buf = BytesMut::new();
        if let Err(e) = codec.encode(ServerFrame { id: 0, reply }, &mut buf) {
            warn!(error = %e, "status reply could not be sent");
            buf.clear();
            let reply = Reply::Error(convert::error(
                ErrorKind::Internal,
                format!("the reply could not be sent: {e}"),
            ));
            codec
                .encode(ServerFrame { id: 0, reply }, &mut buf)
                .expect("a short error fits any frame limit");
        }
        buf.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache holding one `Json` snapshot built at `began` (now − `ago`), costing
    /// `cost`, at the change count of that moment.
    fn cache_with(cost: Duration, ago: Duration) -> StatusCache {
        let c = StatusCache::new(Duration::from_secs(5), 65536);
        let began = Instant::now() - ago;
        *c.snaps[Report::Json as usize].lock().unwrap() = Some(Snap {
            began,
            changes: c.changes.load(Ordering::Acquire),
            built: began + cost,
            shared: cost >= SHARED_COST,
            valid_for: match cost >= MIN_CACHED_COST {
                true => cost.saturating_mul(COST_FACTOR).min(c.refresh),
                false => Duration::ZERO,
            },
            frame: c.encode(Reply::StatusJson("{}".into())),
        });
        c
    }

    /// Served to a connection that has seen the change count `seen`?
    fn served(c: &StatusCache, seen: u64) -> bool {
        c.cached(Report::Json, Instant::now(), seen).is_some()
    }

    #[test]
    fn a_report_too_large_to_frame_is_kept_as_an_internal_error() {
        let c = StatusCache::new(Duration::from_secs(5), 65536);
        let doc = "x".repeat(ipc_protocol::MAX_STATUS_FRAME + 1);
        let frame = c.encode(Reply::StatusJson(doc));
        let payload = &frame[ipc_protocol::framing::HEADER_LEN..];
        let decoded = ipc_protocol::decode_server(payload).unwrap();
        match decoded.reply {
            Reply::Error(e) => {
                assert_eq!(e.kind, ErrorKind::Internal);
                assert!(e.message.contains("could not be sent"), "{}", e.message);
            }
            r => panic!("{r:?}"),
        }
        assert!(frame.len() < 1024, "{}", frame.len());
    }

    #[test]
    fn a_cheap_report_is_served_again_only_while_nothing_changed() {
        let c = cache_with(Duration::from_millis(3), Duration::from_millis(5));
        assert!(served(&c, 0), "young, nothing changed");
        c.changed();
        assert!(
            !served(&c, 0),
            "a change was answered since its build began"
        );
    }

    #[test]
    fn an_expensive_report_is_shared_despite_changes_but_not_with_its_actor() {
        let c = cache_with(Duration::from_millis(40), Duration::from_millis(50));
        let other = c.changed(); // another connection's change, answered
        assert!(served(&c, 0), "shared: another's change may be read late");
        assert!(
            !served(&c, other),
            "read your writes: built before this one's change"
        );
        let old = cache_with(Duration::from_millis(40), Duration::from_secs(2));
        assert!(!served(&old, 0), "older than 32 x its cost");
    }

    #[test]
    fn a_build_begun_after_a_request_arrived_serves_it_whatever_changed() {
        let c = cache_with(Duration::from_micros(100), Duration::ZERO);
        let asked = Instant::now() - Duration::from_millis(1);
        let mine = c.changed();
        assert!(c.cached(Report::Json, asked, mine).is_some());
        assert!(!served(&c, 0), "too cheap to keep for later requests");
    }
}
