//! A connection's socket: frames read in batches ([`Inbox`]), replies written in
//! batches ([`Outbox`]) — one `read` and one `write` per batch (§16).
//!
//! The socket sits in a [`tokio::io::unix::AsyncFd`] rather than a
//! `tokio::net::UnixStream` for one reason: after a *short* read (fewer bytes than
//! there was room for, so the socket was empty at that instant) the read readiness
//! can be cleared at once — safely: the readiness guard only clears the readiness
//! event it saw, so data that arrived meanwhile wakes the task again — instead of
//! paying a second `read` that only answers `EAGAIN`. That is a third of the
//! syscalls of a request-reply connection.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use ipc_protocol::{ClientFrame, ErrorKind, FrameError, Reply, ServerCodec, ServerFrame};
use tokio::io::unix::AsyncFd;
use tokio_util::codec::Encoder;
use tracing::warn;

use super::convert;

/// The socket of a connection.
pub(super) type Socket = AsyncFd<UnixStream>;

/// Make a tokio stream a [`Socket`] (registered with the runtime's epoll).
pub(super) fn socket(s: tokio::net::UnixStream) -> io::Result<Socket> {
    let s = s.into_std()?;
    // SAFETY (epoll registration of a file descriptor): `UnixStream` owns its fd, and
    // `as_raw_fd` returns that same open fd for as long as the `AsyncFd` owns it.
    unsafe { AsyncFd::register(s) }.map_err(io::Error::from)
}

/// Bytes read from the socket and not decoded yet.
pub(super) struct Inbox {
    /// Always fully initialised (reads go straight into its tail, no zeroing per read).
    buf: Vec<u8>,
    /// Start of the undecoded bytes.
    start: usize,
    /// End of the bytes read.
    end: usize,
    /// Largest payload accepted.
    max_frame: usize,
    /// The peer closed its side.
    pub eof: bool,
}

/// What one read of the socket gave.
pub(super) enum Filled {
    /// New bytes (or the end of the stream: see [`Inbox::eof`]).
    Some,
    /// Nothing now; the task is woken when there is.
    Pending,
}

impl Inbox {
    pub fn new(max_frame: usize) -> Inbox {
        Inbox {
            buf: vec![0; 8192],
            start: 0,
            end: 0,
            max_frame,
            eof: false,
        }
    }

    /// Bytes read and not decoded yet (a partial frame, between batches).
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The next complete frame, decoded, if the buffer holds one. After the end of
    /// the stream, a partial frame is an error.
    pub fn next_frame(&mut self) -> Result<Option<ClientFrame>, FrameError> {
        let have = &self.buf[self.start..self.end];
        match ipc_protocol::frame_size(have, self.max_frame)? {
            Some(size) => {
                let payload = &have[ipc_protocol::framing::HEADER_LEN..size];
                self.start += size;
                ipc_protocol::decode_client_payload(payload).map(Some)
            }
            None if self.eof && !have.is_empty() => Err(FrameError::Io(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "connection reset by peer mid-frame",
            ))),
            None => Ok(None),
        }
    }

    /// Read what the socket has into the buffer (one `read`).
    pub fn poll_fill(&mut self, cx: &mut Context<'_>, s: &Socket) -> Poll<io::Result<Filled>> {
        self.make_room();
        loop {
            let mut guard = match s.poll_read_ready(cx) {
                Poll::Pending => return Poll::Ready(Ok(Filled::Pending)),
                Poll::Ready(r) => r?,
            };
            let room = self.buf.len() - self.end;
            match guard.try_io(|fd| fd.get_ref().read(&mut self.buf[self.end..])) {
                Ok(Ok(0)) => {
                    self.eof = true;
                    return Poll::Ready(Ok(Filled::Some));
                }
                Ok(Ok(n)) => {
                    self.end += n;
                    if n < room {
                        // The socket is empty now: do not ask it again only to hear
                        // EAGAIN. (Clears only the readiness event this guard saw.)
                        guard.clear_ready();
                    }
                    return Poll::Ready(Ok(Filled::Some));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // WouldBlock: readiness cleared by `try_io`; poll again.
                Err(_would_block) => {}
            }
        }
    }

    /// Keep room to read into: move the undecoded tail to the front, grow for a large
    /// frame.
    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        // A partial frame longer than what is left: room for all of it (bounded by
        // max_frame, checked from its prefix before any of this happens).
        let have = &self.buf[self.start..self.end];
        let want = match ipc_protocol::frame_size(have, self.max_frame) {
            Ok(None) if have.len() >= 4 => {
                4 + u32::from_be_bytes(have[..4].try_into().expect("4 bytes")) as usize
            }
            _ => 0,
        };
        if self.start > 0
            && (self.buf.len() - self.end < 4096 || self.start + want > self.buf.len())
        {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let need = (self.start + want).max(self.end + 4096);
        if need > self.buf.len() {
            self.buf.resize(need.next_power_of_two(), 0);
        }
    }
}

/// Replies encoded and not yet written, with where each one ends (a reply's slot is
/// free once its last byte is written).
pub(super) struct Outbox {
    /// Encoded frames, the written part already advanced past.
    buf: BytesMut,
    /// Encodes replies with the connection's frame limit.
    codec: ServerCodec,
    /// For each buffered reply, the total number of bytes pushed once it is in.
    ends: VecDeque<u64>,
    /// Bytes pushed since the connection opened.
    pushed: u64,
    /// Bytes written since the connection opened.
    written: u64,
}

impl Outbox {
    pub fn new(max_frame: usize) -> Outbox {
        Outbox {
            buf: BytesMut::with_capacity(4096),
            codec: ServerCodec::new(max_frame),
            ends: VecDeque::new(),
            pushed: 0,
            written: 0,
        }
    }

    /// Replies buffered (each holds an in-flight slot).
    pub fn replies(&self) -> usize {
        self.ends.len()
    }

    /// Bytes written since the connection opened (progress of a slow reader).
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Bytes buffered.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    /// Encode `reply` for request `id` at the end of the buffer. A reply that cannot
    /// be framed (a status larger than `max_frame`) is answered with an `Internal`
    /// error for the same id, so the client still gets an answer.
    pub fn push(&mut self, conn: u64, id: u64, reply: Reply) {
        let before = self.buf.len();
        if let Err(e) = self.codec.encode(ServerFrame { id, reply }, &mut self.buf) {
            self.buf.truncate(before);
            warn!(conn, request = id, error = %e, "reply could not be sent");
            let reply = Reply::Error(convert::error(
                ErrorKind::Internal,
                format!("the reply could not be sent: {e}"),
            ));
            if let Err(e) = self.codec.encode(ServerFrame { id, reply }, &mut self.buf) {
                self.buf.truncate(before);
                warn!(conn, request = id, error = %e, "error reply could not be sent");
                return;
            }
        }
        self.pushed += (self.buf.len() - before) as u64;
        self.ends.push_back(self.pushed);
    }

    /// Copy `frame` — a whole frame encoded with id 0 (a status snapshot) — to the
    /// end of the buffer as the reply to request `id`.
    pub fn push_frame(&mut self, id: u64, frame: &[u8]) {
        let at = self.buf.len() + ipc_protocol::framing::HEADER_LEN;
        self.buf.extend_from_slice(frame);
        // Every server payload starts with its id, a little-endian u64.
        self.buf[at..at + 8].copy_from_slice(&id.to_le_bytes());
        self.pushed += frame.len() as u64;
        self.ends.push_back(self.pushed);
    }

    /// Write as much as the socket takes. `Ready(Ok)` once everything is written;
    /// `Pending` (with a wake-up registered) while the socket is full.
    pub fn poll_flush(&mut self, cx: &mut Context<'_>, s: &Socket) -> Poll<io::Result<()>> {
        while !self.buf.is_empty() {
            let mut guard = match s.poll_write_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r?,
            };
            match guard.try_io(|fd| fd.get_ref().write(&self.buf)) {
                Ok(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(Ok(n)) => {
                    self.buf.advance(n);
                    self.written += n as u64;
                    while self.ends.front().is_some_and(|&end| end <= self.written) {
                        self.ends.pop_front();
                    }
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => {}
            }
        }
        // Empty: the space before the cursor is reused by the next push; a buffer a
        // client that did not read blew up is given back (off the hot path).
        self.buf.clear();
        if self.buf.capacity() > 1 << 16 {
            self.buf = BytesMut::with_capacity(4096);
        }
        Poll::Ready(Ok(()))
    }

    /// Write everything (teardown, refusals).
    pub async fn flush(&mut self, s: &Socket) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_flush(cx, s)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_encoded_with_id_0_is_pushed_as_the_reply_to_each_request() {
        let reply = Reply::StatusJson("{\"scopes\":{}}".into());
        let mut frame = BytesMut::new();
        ServerCodec::new(65536)
            .encode(
                ServerFrame {
                    id: 0,
                    reply: reply.clone(),
                },
                &mut frame,
            )
            .unwrap();
        let (mut by_frame, mut by_reply) = (Outbox::new(65536), Outbox::new(65536));
        for id in [7, 1 << 40, u64::MAX] {
            by_frame.push_frame(id, &frame);
            by_reply.push(1, id, reply.clone());
        }
        assert_eq!(by_frame.buf, by_reply.buf);
        assert_eq!(
            by_frame.ends, by_reply.ends,
            "each reply's end, for its slot"
        );
        assert_eq!(by_frame.replies(), 3);
    }
}
