//! The frames a benchmark client sends, pre-encoded once (DESIGN §11, §11a), and the
//! few reply fields it needs, read at fixed offsets (bindings/PROTOCOL.md pins them).
//!
//! A client that spent microseconds per frame on a generic codec would measure itself,
//! not the sidecar: requests are templates whose id (and permit / call) are patched in
//! place, replies are checked by tag and read by offset. The echo floor uses frames of
//! exactly the same sizes, so both sides of every comparison move the same bytes.

use std::io::{self, Read, Write};

use bytes::{Buf, BytesMut};
use ipc_protocol::{CallSpec, ClientFrame, Outcome, Reply, Request, ServerFrame};

/// Payload offset of the `u64` right after the id and the enum tag.
const FIELD: usize = 12;
/// Payload offset of `Started.permit` (after `call`).
const STARTED_PERMIT: usize = 20;
/// Reply tag of `Error` (bindings/PROTOCOL.md §4).
const TAG_ERROR: u32 = 7;

/// The scope every bench configuration defines.
pub const SCOPE: &str = "bench";

/// One pre-encoded request: the whole frame, length prefix included.
#[derive(Clone)]
pub struct Template {
    /// The frame bytes; the id sits at 4..12, a patched `u64` field at 16..24.
    pub bytes: Vec<u8>,
}

impl Template {
    pub fn new(request: Request) -> Template {
        let payload = ipc_protocol::encode_client(&ClientFrame { id: 0, request })
            .expect("bench requests encode");
        let mut bytes = (payload.len() as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&payload);
        Template { bytes }
    }

    /// Write the frame with `id` (and `field`, the permit or call) into `out`.
    pub fn put(&self, out: &mut Vec<u8>, id: u64, field: Option<u64>) {
        let at = out.len();
        out.extend_from_slice(&self.bytes);
        out[at + 4..at + 12].copy_from_slice(&id.to_le_bytes());
        if let Some(v) = field {
            out[at + 4 + FIELD..at + 4 + FIELD + 8].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Payload length.
    pub fn payload_len(&self) -> usize {
        self.bytes.len() - 4
    }
}

/// The requests of the bench calls.
pub struct Requests {
    pub ping: Template,
    pub start: Template,
    pub finish: Template,
    pub begin: Template,
    pub acquire: Template,
    pub report: Template,
    pub end: Template,
}

fn success() -> Outcome {
    Outcome::Success {
        tokens: Some(10),
        count_attempt: true,
    }
}

impl Requests {
    pub fn new() -> Requests {
        Requests {
            ping: Template::new(Request::Ping),
            start: Template::new(Request::Start(CallSpec {
                scope: SCOPE.into(),
                est_tokens: Some(10),
                priority: None,
                est_input_tokens: None,
                est_output_tokens: None,
            })),
            finish: Template::new(Request::Finish {
                permit: 0,
                outcome: success(),
            }),
            begin: Template::new(Request::BeginCall {
                scope: SCOPE.into(),
                est_tokens: Some(10),
            }),
            acquire: Template::new(Request::Acquire { call: 0 }),
            report: Template::new(Request::Report {
                permit: 0,
                outcome: success(),
            }),
            end: Template::new(Request::EndCall { call: 0 }),
        }
    }
}

/// The sizes of the replies the sidecar sends to the bench's requests (source name
/// `a`, one byte), for the echo floor.
pub fn reply_len(reply: Reply) -> usize {
    ipc_protocol::encode_server(&ServerFrame { id: 0, reply })
        .expect("replies encode")
        .len()
}

/// Payload sizes of `Pong`, `Started`, `Reported`, `CallBegun`, `Granted`, `Ok`.
pub struct ReplySizes {
    pub pong: usize,
    pub started: usize,
    pub reported: usize,
    pub begun: usize,
    pub granted: usize,
    pub ok: usize,
}

impl ReplySizes {
    pub fn new() -> ReplySizes {
        let granted = Reply::Granted {
            permit: 1,
            source: "a".into(),
            is_probe: false,
            attempt: 1,
            est_tokens: 10,
        };
        ReplySizes {
            pong: reply_len(Reply::Pong),
            started: reply_len(Reply::Started {
                call: 1,
                permit: 1,
                source: "a".into(),
                is_probe: false,
                attempt: 1,
                est_tokens: 10,
            }),
            reported: reply_len(Reply::Reported {
                applied: true,
                state: ipc_protocol::BreakerState::Closed,
                retry_after_s: 0.0,
            }),
            begun: reply_len(Reply::CallBegun { call: 1 }),
            granted: reply_len(granted),
            ok: reply_len(Reply::Ok),
        }
    }
}

/// An echo-floor request: `len` payload bytes starting with the id and the payload
/// length of the reply the echo server must send (bench/src/echo.rs).
pub fn echo_request(out: &mut Vec<u8>, id: u64, len: usize, reply_len: usize) {
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&(reply_len as u32).to_le_bytes());
    out.resize(out.len() + len - 12, 0);
}

/// A reply as the bench sees it: its id, and the payload for field reads.
pub struct Frame<'a> {
    pub payload: &'a [u8],
}

impl Frame<'_> {
    pub fn id(&self) -> u64 {
        u64_at(self.payload, 0)
    }

    fn tag(&self) -> u32 {
        u32::from_le_bytes(self.payload[8..12].try_into().expect("4 bytes"))
    }

    /// The `u64` after the tag (`CallBegun.call`, `Granted.permit`).
    pub fn field(&self) -> Result<u64, String> {
        self.check()?;
        Ok(u64_at(self.payload, FIELD))
    }

    /// `Started.permit`.
    pub fn started_permit(&self) -> Result<u64, String> {
        self.check()?;
        Ok(u64_at(self.payload, STARTED_PERMIT))
    }

    /// An `Error` reply, decoded for its message.
    pub fn check(&self) -> Result<(), String> {
        if self.payload.len() < FIELD {
            return Err(format!("short reply of {} bytes", self.payload.len()));
        }
        if self.tag() != TAG_ERROR {
            return Ok(());
        }
        match ipc_protocol::decode_server(self.payload) {
            Ok(ServerFrame {
                reply: Reply::Error(e),
                ..
            }) => Err(format!("{:?}: {}", e.kind, e.message)),
            other => Err(format!("undecodable error reply: {other:?}")),
        }
    }
}

fn u64_at(p: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"))
}

/// Splits complete frames off a read buffer.
#[derive(Default)]
pub struct Reader {
    buf: BytesMut,
    /// Bytes of the frame handed out last, consumed on the next call.
    consumed: usize,
}

impl Reader {
    /// The next complete frame, if the buffer holds one.
    pub fn next(&mut self) -> Option<Frame<'_>> {
        self.buf.advance(std::mem::take(&mut self.consumed));
        let len = u32::from_be_bytes(self.buf.get(..4)?.try_into().expect("4 bytes")) as usize;
        if self.buf.len() < 4 + len {
            self.buf.reserve(4 + len);
            return None;
        }
        self.consumed = 4 + len;
        Some(Frame {
            payload: &self.buf[4..4 + len],
        })
    }

    /// Room to read into.
    pub fn spare(&mut self) -> &mut BytesMut {
        self.buf.advance(std::mem::take(&mut self.consumed));
        if self.buf.capacity() - self.buf.len() < 4096 {
            self.buf.reserve(16 * 1024);
        }
        &mut self.buf
    }
}

/// A blocking connection (latency runs: the least client overhead per round trip).
pub struct BlockingConn {
    stream: std::os::unix::net::UnixStream,
    reader: Reader,
    out: Vec<u8>,
    /// What one read(2) fills (copied into `reader`: no zeroing per read).
    scratch: Box<[u8; 16384]>,
    next_id: u64,
}

impl BlockingConn {
    /// Connect; `hello` says protocol version 2 (None: an echo server, no handshake).
    pub fn connect(path: &std::path::Path, hello: bool) -> io::Result<BlockingConn> {
        let stream = std::os::unix::net::UnixStream::connect(path)?;
        let mut c = BlockingConn {
            stream,
            reader: Reader::default(),
            out: Vec::with_capacity(256),
            scratch: Box::new([0; 16384]),
            next_id: 1,
        };
        if hello {
            let t = Template::new(Request::Hello {
                protocol_version: 2,
                client_name: "polygate-bench".into(),
                pid: std::process::id(),
            });
            c.out.clear();
            t.put(&mut c.out, 0, None);
            c.stream.write_all(&c.out)?;
            c.recv(|f| f.check().map_err(io::Error::other))?;
        }
        Ok(c)
    }

    /// The next request id.
    pub fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Send the bytes `fill` writes, then read one reply and hand it to `read`.
    pub fn round_trip<T>(
        &mut self,
        fill: impl FnOnce(&mut Vec<u8>),
        read: impl FnOnce(&Frame<'_>) -> io::Result<T>,
    ) -> io::Result<T> {
        self.out.clear();
        fill(&mut self.out);
        self.stream.write_all(&self.out)?;
        self.recv(read)
    }

    /// Send the bytes `fill` writes (`n` requests), then read `n` replies, handing
    /// each to `read` (a pipelined burst).
    pub fn burst(
        &mut self,
        n: usize,
        fill: impl FnOnce(&mut Vec<u8>),
        mut read: impl FnMut(&Frame<'_>) -> io::Result<()>,
    ) -> io::Result<()> {
        self.out.clear();
        fill(&mut self.out);
        self.stream.write_all(&self.out)?;
        for _ in 0..n {
            self.recv(&mut read)?;
        }
        Ok(())
    }

    fn recv<T>(&mut self, read: impl FnOnce(&Frame<'_>) -> io::Result<T>) -> io::Result<T> {
        loop {
            if let Some(f) = self.reader.next() {
                return read(&f);
            }
            let n = self.stream.read(&mut self.scratch[..])?;
            self.reader.spare().extend_from_slice(&self.scratch[..n]);
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed"));
            }
        }
    }
}

/// `Reply::Status` decoded.
pub fn status_of(payload: &[u8]) -> Result<ipc_protocol::StatusReport, String> {
    match ipc_protocol::decode_server(payload)
        .map_err(|e| e.to_string())?
        .reply
    {
        Reply::Status(s) => Ok(s),
        other => Err(format!("expected Status, got {other:?}")),
    }
}
