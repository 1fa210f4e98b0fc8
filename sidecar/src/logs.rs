//! Log lines a client can trigger at will, summarised (§12: "never one per bad
//! request: repeated client errors are counted and summarised, at most a line per
//! second per kind").
//!
//! Every such line has a [`Kind`]. Before logging it the caller asks [`allow`]: the
//! first [`Kind::burst`] events of a kind in each one-second window are logged in full
//! (with any echoed client string cut by [`crate::limits::echo`]); the rest are only
//! counted, and once the window is over one summary line says how many were left out
//! ("… 5633 more like it in the last 1.0s"). The summary is written by the next event
//! of that kind or, at the latest, by [`flush`], which the daemon runs every second
//! ([`spawn_flusher`]) so a burst's tail is never lost. So a kind writes at most
//! `burst + 1` lines a second however hard a client pushes, and each line is short.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The summarising window.
pub const WINDOW: Duration = Duration::from_secs(1);

/// A family of client-triggerable log lines, summarised together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Kind {
    /// A frame that could not be read (too large, malformed); the connection closes.
    BadFrame,
    /// A handshake broken (no Hello, wrong version, Hello repeated).
    BadHandshake,
    /// A request refused as invalid (unknown scope/call/permit, bad argument, busy).
    BadRequest,
    /// A peer refused by `allowed_uids`/`allowed_gids`, or an admin request by a
    /// non-admin.
    PermissionDenied,
    /// An admission refused because the shared backend is down (`fail_closed`).
    BackendRefused,
    /// A connection refused or closed by a sidecar-wide limit (connections, memory
    /// budget, idle or partial-frame timeouts).
    Overloaded,
    /// A call started waiting (§12 wants one line per wait; a flood is summarised).
    WaitStarted,
    /// A permit never reported within its lease was reclaimed.
    Reclaimed,
    /// Releasing or settling a permit failed at the backend.
    ReleaseFailed,
    /// A request handler failed internally (a bug; still never a flood).
    Internal,
}

impl Kind {
    /// Every kind, in `repr` order.
    pub const ALL: [Kind; 10] = [
        Kind::BadFrame,
        Kind::BadHandshake,
        Kind::BadRequest,
        Kind::PermissionDenied,
        Kind::BackendRefused,
        Kind::Overloaded,
        Kind::WaitStarted,
        Kind::Reclaimed,
        Kind::ReleaseFailed,
        Kind::Internal,
    ];

    /// The name summary lines carry (`kind=bad_request`).
    pub const fn name(self) -> &'static str {
        match self {
            Kind::BadFrame => "bad_frame",
            Kind::BadHandshake => "bad_handshake",
            Kind::BadRequest => "bad_request",
            Kind::PermissionDenied => "permission_denied",
            Kind::BackendRefused => "backend_refused",
            Kind::Overloaded => "overloaded",
            Kind::WaitStarted => "wait_started",
            Kind::Reclaimed => "reclaimed",
            Kind::ReleaseFailed => "release_failed",
            Kind::Internal => "internal",
        }
    }

    /// Lines logged in full per window before the rest are only counted. Waits are
    /// normal operation (§12 logs each), so they get a larger allowance than errors.
    pub const fn burst(self) -> u32 {
        match self {
            Kind::WaitStarted => 10,
            _ => 1,
        }
    }

    /// Summaries of waits are information; of everything else, warnings.
    const fn is_warning(self) -> bool {
        !matches!(self, Kind::WaitStarted)
    }
}

/// One kind's window.
#[derive(Debug, Default, Clone, Copy)]
struct Window {
    /// When the current window began; `None` before the first event.
    start: Option<Instant>,
    /// Events logged in full in the current window.
    logged: u32,
    /// Events counted but not logged in the current window.
    suppressed: u64,
}

/// What to write for one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Log the event's own line.
    pub log: bool,
    /// First write a summary of this many events left out of the window that ended,
    /// and how long that window was.
    pub summary: Option<(u64, Duration)>,
}

/// The counting state of every kind (one global instance, [`allow`]; tests make
/// their own and pass the time).
#[derive(Debug, Default)]
pub struct Summaries {
    /// Per kind, by `Kind as usize`.
    windows: [Mutex<Window>; Kind::ALL.len()],
}

impl Summaries {
    fn window(&self, kind: Kind) -> std::sync::MutexGuard<'_, Window> {
        self.windows[kind as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// An event of `kind` at `now`.
    pub fn note(&self, kind: Kind, now: Instant) -> Decision {
        let mut w = self.window(kind);
        let mut summary = None;
        match w.start {
            Some(start) if now.saturating_duration_since(start) < WINDOW => {}
            start => {
                if w.suppressed > 0 {
                    let len = start.map_or(WINDOW, |s| now.saturating_duration_since(s));
                    summary = Some((w.suppressed, len));
                }
                *w = Window {
                    start: Some(now),
                    ..Window::default()
                };
            }
        }
        let log = w.logged < kind.burst();
        if log {
            w.logged += 1;
        } else {
            w.suppressed += 1;
        }
        Decision { log, summary }
    }

    /// Summaries due at `now`: the kinds whose window ended with events left out.
    pub fn due(&self, now: Instant) -> Vec<(Kind, u64, Duration)> {
        let mut out = Vec::new();
        for kind in Kind::ALL {
            let mut w = self.window(kind);
            if let Some(start) = w.start {
                let len = now.saturating_duration_since(start);
                if len >= WINDOW && w.suppressed > 0 {
                    out.push((kind, w.suppressed, len));
                    // A fresh window, with nothing logged yet: the next event logs.
                    *w = Window::default();
                }
            }
        }
        out
    }
}

static GLOBAL: std::sync::LazyLock<Summaries> = std::sync::LazyLock::new(Summaries::default);

/// Whether to log an event of `kind` now (writing a due summary first). Call it right
/// before the line it guards: `if logs::allow(Kind::BadRequest) { warn!(…) }`.
pub fn allow(kind: Kind) -> bool {
    let d = GLOBAL.note(kind, Instant::now());
    if let Some((n, len)) = d.summary {
        write_summary(kind, n, len);
    }
    d.log
}

/// Write the summaries whose window has ended (the daemon calls this every second).
pub fn flush() {
    for (kind, n, len) in GLOBAL.due(Instant::now()) {
        write_summary(kind, n, len);
    }
}

/// Run [`flush`] every [`WINDOW`] until the task is aborted.
pub fn spawn_flusher() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        let mut tick = tokio::time::interval(WINDOW);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            flush();
        }
    })
}

fn write_summary(kind: Kind, n: u64, len: Duration) {
    let secs = len.as_secs_f64();
    if kind.is_warning() {
        tracing::warn!(
            kind = kind.name(),
            suppressed = n,
            "{n} more {} events like the last one in the last {secs:.1}s (summarised)",
            kind.name()
        );
    } else {
        tracing::info!(
            kind = kind.name(),
            suppressed = n,
            "{n} more {} events in the last {secs:.1}s (summarised)",
            kind.name()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_becomes_one_line_then_one_summary_per_window() {
        let s = Summaries::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut logged = 0;
        for i in 0..5_000u64 {
            let d = s.note(Kind::BadRequest, at(i / 10)); // 10 a millisecond, 500 ms
            assert_eq!(d.summary, None);
            logged += u32::from(d.log);
        }
        assert_eq!(logged, 1, "one full line in the window");
        assert!(s.due(at(900)).is_empty(), "window not over yet");
        // The next window's first event writes the summary of the last one.
        let d = s.note(Kind::BadRequest, at(1_000));
        assert!(d.log);
        assert_eq!(d.summary, Some((4_999, Duration::from_secs(1))));
        // A tail left out is reported by the flusher once its window is over.
        assert!(!s.note(Kind::BadRequest, at(1_100)).log);
        assert_eq!(
            s.due(at(2_500)),
            vec![(Kind::BadRequest, 1, Duration::from_millis(1_500))]
        );
        assert!(s.due(at(2_600)).is_empty(), "reported once");
        let d = s.note(Kind::BadRequest, at(2_700));
        assert_eq!((d.log, d.summary), (true, None));
    }

    #[test]
    fn kinds_are_counted_apart_and_waits_get_a_burst() {
        let s = Summaries::default();
        let t = Instant::now();
        assert!(s.note(Kind::BadFrame, t).log);
        assert!(s.note(Kind::PermissionDenied, t).log);
        assert!(!s.note(Kind::BadFrame, t).log);
        let waits = (0..50).filter(|_| s.note(Kind::WaitStarted, t).log).count();
        assert_eq!(waits, Kind::WaitStarted.burst() as usize);
        let due = s.due(t + WINDOW);
        assert_eq!(due.len(), 2, "{due:?}");
        assert!(due.contains(&(Kind::BadFrame, 1, WINDOW)));
        assert!(due.contains(&(Kind::WaitStarted, 40, WINDOW)));
    }

    #[test]
    fn every_kind_has_its_own_slot() {
        for (i, k) in Kind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
    }
}
