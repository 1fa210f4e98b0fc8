//! The bounds one connection is held to under abuse (DESIGN §12 "Bounded under
//! abuse"; README's limits table; bindings/PROTOCOL.md "Refusals").
//!
//! - the connection cap: past `max_connections` a connection is refused `Overloaded`
//!   before `Hello` ([`refuse`]), except that up to `RESERVED_CONNECTIONS` more are
//!   served to `admin_uids` peers, decided from the peer's credentials at accept
//!   ([`refuse_reserve`] for anyone else); a refused peer reads its refusal (its
//!   `Hello` is read and dropped, so the close is no reset: [`write_refusal`]);
//! - `idle_timeout`: a connection that holds nothing, or whose partial frame does not
//!   complete, is closed ([`IdleWatch`], checked periodically, no timer per frame);
//! - unsent bytes: past [`MAX_UNSENT`] of its own — buffered replies, and status
//!   replies read and not yet buffered (`budget::Reserved`) — or past the
//!   sidecar-wide `max_buffered` (which counts both too) a connection reads no more
//!   frames, and one that writes nothing for [`STALL_TIMEOUT`] with its buffered
//!   replies above its own bound is closed ([`Unsent`]).
//!
//! The connection task (`conn`) asks these; they own only the bookkeeping.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::Context;
use std::time::Duration;

use ipc_protocol::{ErrorKind, Reply};
use tokio::net::UnixStream;
use tracing::warn;

use super::transport::{self, Outbox};
use super::{convert, ConnSlot, Shared, RESERVED_CONNECTIONS};
use crate::engine::OwnerId;
use crate::logs::{self, Kind};

/// Unsent reply bytes past which a connection reads no more frames (its client is
/// not reading); held above it for [`STALL_TIMEOUT`] with no write progress, the
/// connection is closed.
pub(super) const MAX_UNSENT: usize = 1 << 20;
/// How long a connection may sit above [`MAX_UNSENT`] writing nothing.
const STALL_TIMEOUT: Duration = Duration::from_secs(2);
/// While the sidecar-wide budget (`max_buffered`) is spent, how often a connection
/// that stopped reading looks again.
const BUDGET_RETRY: Duration = Duration::from_millis(20);
/// How long a refusal waits to be written (and its peer's bytes read): a peer that
/// does not read or does not close cannot hold the connection open.
const REFUSAL_FLUSH: Duration = Duration::from_secs(1);
/// Refusals that may wait for their peer at once (each holds an fd for up to
/// [`REFUSAL_FLUSH`], outside the connection count); past it a refusal is written
/// and closed without reading the peer's bytes (it may then see a reset).
const MAX_REFUSING: usize = 32;
/// Refusals waiting for their peer now, process-wide.
static REFUSING: AtomicUsize = AtomicUsize::new(0);

/// Refuse a connection past `max_connections` and its reserve: one `Overloaded`
/// error (id 0: the connection is closed), written without waiting for `Hello`.
pub(super) async fn refuse(stream: UnixStream, id: OwnerId, slot: ConnSlot) {
    let shared = slot.0.clone();
    // A refusal does not hold a connection's place while it is written and its
    // peer's Hello read: it is bounded by [`MAX_REFUSING`] instead.
    drop(slot);
    let max = shared.opts.max_connections;
    if logs::allow(Kind::Overloaded) {
        warn!(
            conn = id,
            max_connections = max,
            "connection refused: the sidecar is at max_connections"
        );
    }
    let message = format!(
        "the sidecar serves at most {max} connections (sidecar.max_connections) plus \
         {RESERVED_CONNECTIONS} reserved for admin_uids; retry later"
    );
    let max_frame = shared.opts.max_frame as usize;
    write_refusal(stream, id, max_frame, ErrorKind::Overloaded, message).await;
}

/// Refuse a non-admin peer (`uid`) past `max_connections`: the reserve beyond it
/// serves `admin_uids` only, so an operator's `status` works however many worker
/// connections a local client opens.
pub(super) async fn refuse_reserve(stream: UnixStream, id: OwnerId, shared: &Shared, uid: u32) {
    let max = shared.opts.max_connections;
    if logs::allow(Kind::Overloaded) {
        warn!(
            conn = id,
            uid,
            max_connections = max,
            "connection refused: the sidecar is at max_connections and the reserve is for admin_uids"
        );
    }
    let message = format!(
        "the sidecar serves at most {max} connections (sidecar.max_connections); the \
         {RESERVED_CONNECTIONS} beyond them are reserved for admin_uids, and uid {uid} is not \
         one; retry later"
    );
    let max_frame = shared.opts.max_frame as usize;
    write_refusal(stream, id, max_frame, ErrorKind::Overloaded, message).await;
}

/// Write one error with id 0 before any `Hello`, then read and drop what the peer
/// sends (its `Hello`) until it closes, all within [`REFUSAL_FLUSH`]; the caller
/// then drops the connection. Closing a Unix socket with unread bytes makes the
/// peer's next read fail with "connection reset" — the refusal would be lost to
/// a client that reads past it — so the peer's bytes are read first.
pub(super) async fn write_refusal(
    stream: UnixStream,
    id: OwnerId,
    max_frame: usize,
    kind: ErrorKind,
    message: String,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = Outbox::new(max_frame);
    out.push(id, 0, Reply::Error(convert::error(kind, message)));
    let Ok(s) = transport::socket(stream) else {
        return;
    };
    let drain = REFUSING.fetch_add(1, Ordering::Relaxed) < MAX_REFUSING;
    let _ = tokio::time::timeout(REFUSAL_FLUSH, async {
        if out.flush(&s).await.is_err() || !drain {
            return;
        }
        let Ok(mut stream) = UnixStream::from_std(s.into_inner()) else {
            return;
        };
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 1024];
        // Until EOF (the peer read the refusal and closed) or an error.
        while let Ok(n) = stream.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
    REFUSING.fetch_sub(1, Ordering::Relaxed);
}

/// The reply that closes a connection for a sidecar-wide limit: `Overloaded` (id 0),
/// `Busy` on a version-1 connection (which has no `Overloaded`).
pub(super) fn overloaded_reply(version: Option<u32>, message: String) -> Reply {
    let kind = if version.unwrap_or(2) >= 2 {
        ErrorKind::Overloaded
    } else {
        ErrorKind::Busy
    };
    Reply::Error(convert::error(kind, message))
}

/// What one periodic idle check found.
pub(super) enum Idle {
    /// A partial frame sat in the inbox at this check and the previous one, with no
    /// frame decoded in between: close it.
    Stuck,
    /// No frame since the previous check and nothing buffered: close it if it also
    /// holds nothing.
    Quiet,
    /// Frames arrived (or a partial one just began): keep it.
    Active,
}

/// The idle check's memory between two runs (`sidecar.idle_timeout`).
#[derive(Default)]
pub(super) struct IdleWatch {
    /// Frames decoded since the connection opened: the sign of life.
    frames: u64,
    /// `frames` at the last check.
    frames_at_check: u64,
    /// A partial frame sat in the inbox at the last check.
    partial_at_check: bool,
}

impl IdleWatch {
    /// One frame decoded.
    pub fn frame(&mut self) {
        self.frames += 1;
    }

    /// The periodic check; `partial`: the inbox holds part of a frame now.
    pub fn check(&mut self, partial: bool) -> Idle {
        let quiet = self.frames == self.frames_at_check;
        let stuck = quiet && partial && self.partial_at_check;
        self.frames_at_check = self.frames;
        self.partial_at_check = partial;
        if stuck {
            Idle::Stuck
        } else if quiet && !partial {
            Idle::Quiet
        } else {
            Idle::Active
        }
    }
}

/// A connection's unsent reply bytes against its own bound and the sidecar's.
#[derive(Default)]
pub(super) struct Unsent {
    /// Unsent reply bytes last added to [`Shared::buffered`].
    published: u64,
    /// Above [`MAX_UNSENT`] or over the global budget: when to look again (and, if
    /// this connection is the one not reading, when it is closed), with the write
    /// count then. Only set off the hot path.
    stalled: Option<(Pin<Box<tokio::time::Sleep>>, u64)>,
}

impl Unsent {
    /// Bring the sidecar-wide count of unsent bytes up to date (no atomic operation
    /// while nothing is left unsent between batches, the normal case).
    pub fn publish(&mut self, total: &AtomicU64, now: u64) {
        if now > self.published {
            total.fetch_add(now - self.published, Ordering::Relaxed);
        } else if now < self.published {
            total.fetch_sub(self.published - now, Ordering::Relaxed);
        }
        self.published = now;
    }

    /// Reading is held back by bytes: this connection's [`MAX_UNSENT`] (its buffered
    /// replies and the `reserved` bytes of its status replies still on their way:
    /// `budget::Reserved`) or the global `max_buffered`.
    pub fn over(out: &Outbox, reserved: usize, shared: &Shared) -> bool {
        out.bytes() + reserved >= MAX_UNSENT
            || shared.buffered.load(Ordering::Relaxed) > shared.opts.max_buffered
    }

    /// Held back by bytes: wake again soon (the global budget frees without waking
    /// anyone). `true`: the connection is above [`MAX_UNSENT`] and wrote nothing for
    /// [`STALL_TIMEOUT`] — its client does not read; close it and its memory goes.
    pub fn poll_stall(
        &mut self,
        cx: &mut Context<'_>,
        id: OwnerId,
        out: &Outbox,
        reserved: usize,
        shared: &Shared,
    ) -> bool {
        if !Self::over(out, reserved, shared) {
            self.stalled = None;
            return false;
        }
        let written = out.written();
        let mine = out.bytes() >= MAX_UNSENT;
        let wait = if mine { STALL_TIMEOUT } else { BUDGET_RETRY };
        let progressed = self.stalled.as_ref().is_some_and(|(_, w)| *w != written);
        if self.stalled.is_none() || progressed {
            self.stalled = Some((Box::pin(tokio::time::sleep(wait)), written));
        }
        let (sleep, _) = self.stalled.as_mut().expect("set");
        if sleep.as_mut().poll(cx).is_ready() {
            if mine {
                if logs::allow(Kind::Overloaded) {
                    warn!(
                        conn = id,
                        unsent = out.bytes(),
                        "the client reads no replies; closing the connection"
                    );
                }
                return true;
            }
            self.stalled = None;
            cx.waker().wake_by_ref();
        }
        false
    }
}
