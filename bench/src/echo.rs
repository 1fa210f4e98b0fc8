//! The floor: plain echo servers on the same kind of Unix socket, answering frames of
//! the same sizes as the sidecar (DESIGN §16 "measured side by side in one run").
//!
//! A request payload starts with its `u64` id and the `u32` payload length of the
//! reply to send ([`crate::frames::echo_request`]); the reply is that many bytes,
//! starting with the id. That is all an echo server does per frame: it is what
//! "nothing but the socket" costs on this machine.
//!
//! Two servers, each in its own process (like the sidecar), so the client's CPU and
//! the server's never mix:
//! - `tokio`: a multi-threaded tokio runtime with one task per connection, reading
//!   everything available and answering in one write — the shape the sidecar has;
//! - `epoll`: one thread on mio (epoll), no runtime at all — usually the faster one.
//!
//! The bench reports the faster of the two as the floor.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::Path;

use bytes::{Buf, BytesMut};

/// Which echo server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tokio,
    Epoll,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Epoll, Kind::Tokio];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Tokio => "tokio",
            Kind::Epoll => "epoll",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// Answer every complete frame in `rbuf` into `out`.
fn answer(rbuf: &mut BytesMut, out: &mut Vec<u8>) -> io::Result<()> {
    loop {
        let Some(head) = rbuf.get(..4) else {
            return Ok(());
        };
        let len = u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize;
        if rbuf.len() < 4 + len {
            rbuf.reserve(4 + len - rbuf.len());
            return Ok(());
        }
        if len < 12 {
            return Err(io::Error::other("echo request shorter than 12 bytes"));
        }
        let reply = u32::from_le_bytes(rbuf[12..16].try_into().expect("4 bytes")) as usize;
        out.extend_from_slice(&(reply as u32).to_be_bytes());
        out.extend_from_slice(&rbuf[4..12]);
        out.resize(out.len() + reply.saturating_sub(8), 0);
        rbuf.advance(4 + len);
    }
}

/// Serve `path` until killed.
pub fn serve(kind: Kind, path: &Path) -> io::Result<()> {
    let _ = std::fs::remove_file(path);
    match kind {
        Kind::Tokio => serve_tokio(path),
        Kind::Epoll => serve_epoll(path),
    }
}

fn serve_tokio(path: &Path) -> io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::UnixListener::bind(path)?;
        loop {
            let (mut s, _) = listener.accept().await?;
            tokio::spawn(async move {
                let mut rbuf = BytesMut::with_capacity(16 * 1024);
                let mut out = Vec::with_capacity(16 * 1024);
                loop {
                    match s.read_buf(&mut rbuf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                    if answer(&mut rbuf, &mut out).is_err() {
                        return;
                    }
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                    out.clear();
                }
            });
        }
    })
}

/// One epoll connection.
struct EConn {
    stream: mio::net::UnixStream,
    rbuf: BytesMut,
    out: Vec<u8>,
    /// Bytes of `out` already written.
    sent: usize,
}

fn serve_epoll(path: &Path) -> io::Result<()> {
    use mio::{Events, Interest, Poll, Token};
    const LISTENER: Token = Token(usize::MAX);
    let mut poll = Poll::new()?;
    let mut listener = mio::net::UnixListener::bind(path)?;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)?;
    let mut conns: HashMap<usize, EConn> = HashMap::new();
    let mut next = 0usize;
    let mut events = Events::with_capacity(1024);
    let mut scratch = vec![0u8; 64 * 1024];
    loop {
        poll.poll(&mut events, None)?;
        for ev in events.iter() {
            if ev.token() == LISTENER {
                while let Ok((mut stream, _)) = listener.accept() {
                    next += 1;
                    poll.registry().register(
                        &mut stream,
                        Token(next),
                        Interest::READABLE | Interest::WRITABLE,
                    )?;
                    conns.insert(
                        next,
                        EConn {
                            stream,
                            rbuf: BytesMut::with_capacity(16 * 1024),
                            out: Vec::with_capacity(16 * 1024),
                            sent: 0,
                        },
                    );
                }
                continue;
            }
            let t = ev.token().0;
            let Some(c) = conns.get_mut(&t) else { continue };
            let mut dead = false;
            loop {
                match c.stream.read(&mut scratch) {
                    Ok(0) => {
                        dead = true;
                        break;
                    }
                    Ok(n) => {
                        c.rbuf.extend_from_slice(&scratch[..n]);
                        // A short read emptied the socket: skip the read that would
                        // only say EAGAIN (new data raises a new edge). Tokio's own
                        // reads do the same.
                        if n < scratch.len() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        dead = true;
                        break;
                    }
                }
            }
            if answer(&mut c.rbuf, &mut c.out).is_err() {
                dead = true;
            }
            while !dead && c.sent < c.out.len() {
                match c.stream.write(&c.out[c.sent..]) {
                    Ok(n) => c.sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => dead = true,
                }
            }
            if c.sent == c.out.len() {
                c.out.clear();
                c.sent = 0;
            }
            if dead {
                if let Some(mut c) = conns.remove(&t) {
                    let _ = poll.registry().deregister(&mut c.stream);
                }
            }
        }
    }
}
