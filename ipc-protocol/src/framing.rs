//! Framing: a 4-byte big-endian length of the payload, then the payload.
//!
//! This is tokio-util's [`LengthDelimitedCodec`] default layout. [`length_codec`]
//! builds that codec with an explicit maximum (never rely on tokio-util's 8 MiB
//! default). [`ServerCodec`] and [`ClientCodec`] add the payload encoding
//! ([`crate::codec`]) on top and classify failures ([`FrameError`]) so a server can
//! answer them with the right [`crate::ErrorKind`] before it closes the connection.
//!
//! A clean end of stream between frames ends the stream (`None`); an end of stream in
//! the middle of a frame is an error.
//!
//! After any decode error a `Framed` stream yields `None`: the connection is done.

use std::io;

use bytes::{Buf, BufMut, BytesMut};
use tokio_util::codec::{Decoder, Encoder, LengthDelimitedCodec};

use crate::codec::{self, CodecError};
use crate::messages::{ClientFrame, ServerFrame};

/// Bytes of the length prefix.
pub const HEADER_LEN: usize = 4;

/// tokio-util's length-delimited codec in the protocol's layout: 4-byte big-endian
/// length of the payload only (the prefix does not count itself), at most
/// `max_frame` payload bytes in either direction. An oversize length is refused
/// before anything is allocated for it.
pub fn length_codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_offset(0)
        .length_field_type::<u32>()
        .big_endian()
        .length_adjustment(0)
        .num_skip(HEADER_LEN)
        .max_frame_length(max_frame)
        .new_codec()
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// Transport trouble, including an end of stream in the middle of a frame
    /// (`ConnectionReset`, "connection reset by peer mid-frame").
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// The frame's length prefix (or, when encoding, the payload) exceeds the
    /// maximum. Raised from the prefix alone, before the payload is read. A server
    /// replies `ErrorKind::FrameTooLarge` (id 0) and closes the connection.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Payload length claimed by the prefix (or produced by the encoder).
        len: usize,
        /// The maximum in force.
        max: usize,
    },
    /// The frame boundary was fine but the payload does not decode. A server replies
    /// `ErrorKind::Malformed` with `id` (or 0 when `None`) and closes the connection.
    #[error("malformed frame (id {id:?}): {reason}")]
    Malformed {
        /// The request id from the payload's first 8 bytes, when it has them.
        id: Option<u64>,
        /// What the decoder reported.
        reason: String,
    },
}

/// The shared length-prefix logic of both typed codecs.
#[derive(Debug, Clone)]
struct Frames {
    max_frame: usize,
}

/// The size (prefix included) of the frame at the start of `buf`: `Ok(Some(n))` when
/// `buf` holds all of it, `Ok(None)` when more bytes are needed. An oversize length is
/// refused from the prefix alone, before the payload arrives (`FrameTooLarge`).
///
/// For a reader that keeps its own buffer (the sidecar reads many frames per
/// `read`); [`ServerCodec`] / [`ClientCodec`] use the same rule.
pub fn frame_size(buf: &[u8], max_frame: usize) -> Result<Option<usize>, FrameError> {
    let Some(head) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize;
    let max = clamp_max(max_frame);
    if len > max {
        return Err(FrameError::FrameTooLarge { len, max });
    }
    let total = HEADER_LEN + len;
    Ok((buf.len() >= total).then_some(total))
}

/// Decodes a client payload (no prefix), failing as [`ServerCodec`] does
/// (`Malformed` with the id when the payload has one).
pub fn decode_client_payload(payload: &[u8]) -> Result<ClientFrame, FrameError> {
    codec::decode_client(payload).map_err(|e| malformed(payload, e))
}

impl Frames {
    /// Splits one complete payload off `src`, if it holds one.
    fn decode(&self, src: &mut BytesMut) -> Result<Option<BytesMut>, FrameError> {
        match frame_size(src, self.max_frame)? {
            Some(total) => {
                src.advance(HEADER_LEN);
                Ok(Some(src.split_to(total - HEADER_LEN)))
            }
            None => {
                if let Some(head) = src.get(..HEADER_LEN) {
                    let len = u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize;
                    src.reserve(HEADER_LEN + len - src.len());
                }
                Ok(None)
            }
        }
    }

    fn decode_eof(&self, src: &mut BytesMut) -> Result<Option<BytesMut>, FrameError> {
        match self.decode(src)? {
            Some(payload) => Ok(Some(payload)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Io(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "connection reset by peer mid-frame",
            ))),
        }
    }

    fn encode(
        &self,
        payload: Result<Vec<u8>, CodecError>,
        dst: &mut BytesMut,
    ) -> Result<(), FrameError> {
        self.encode_within(payload, self.max_frame, dst)
    }

    /// [`Frames::encode`] with an explicit limit (status replies have their own).
    fn encode_within(
        &self,
        payload: Result<Vec<u8>, CodecError>,
        max: usize,
        dst: &mut BytesMut,
    ) -> Result<(), FrameError> {
        let payload = payload.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if payload.len() > max {
            return Err(FrameError::FrameTooLarge {
                len: payload.len(),
                max,
            });
        }
        dst.reserve(HEADER_LEN + payload.len());
        dst.put_u32(payload.len() as u32);
        dst.put_slice(&payload);
        Ok(())
    }
}

fn malformed(payload: &[u8], e: CodecError) -> FrameError {
    FrameError::Malformed {
        id: codec::peek_id(payload),
        reason: e.to_string(),
    }
}

/// Clamps a configured maximum to what both the 4-byte prefix and the decoder allow.
fn clamp_max(max_frame: usize) -> usize {
    max_frame.min(codec::DECODE_LIMIT).min(u32::MAX as usize)
}

/// Bytes of an error reply's `message` kept when the reply must shrink to fit.
const SHRUNK_MESSAGE: usize = 1024;

/// `s` cut to at most `max` bytes on a character boundary, marked with `…`.
fn cut(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
}

/// The sidecar's encoder: `Status` / `StatusJson` replies may be up to
/// [`crate::MAX_STATUS_FRAME`]; every other reply fits `max_frame`. An `Error`
/// reply too large (a scope of many long-named sources lists them all in
/// `per_source_reasons`) is shrunk until it fits — its message and scope cut, its
/// reasons list shortened, the message saying how many were left out — so the
/// client always gets its error and never a frame over its limit.
fn encode_server_frame(
    frames: &Frames,
    frame: ServerFrame,
    dst: &mut BytesMut,
) -> Result<(), FrameError> {
    use crate::messages::Reply;
    if matches!(frame.reply, Reply::Status(_) | Reply::StatusJson(_)) {
        let max = frames.max_frame.max(crate::MAX_STATUS_FRAME);
        return frames.encode_within(codec::encode_server(&frame), max, dst);
    }
    // The common case: encoded in place behind its length prefix, no copy.
    let start = dst.len();
    dst.put_u32(0);
    match codec::encode_server_onto(&frame, dst) {
        Ok(()) if dst.len() - start - HEADER_LEN <= frames.max_frame => {
            let len = (dst.len() - start - HEADER_LEN) as u32;
            dst[start..start + HEADER_LEN].copy_from_slice(&len.to_be_bytes());
            return Ok(());
        }
        _ => dst.truncate(start),
    }
    let payload = codec::encode_server(&frame);
    let fits = matches!(&payload, Ok(p) if p.len() <= frames.max_frame);
    let ServerFrame { id, reply } = frame;
    let (false, Reply::Error(mut e)) = (fits, reply) else {
        return frames.encode(payload, dst);
    };
    let keep_bytes = SHRUNK_MESSAGE.min(frames.max_frame / 4);
    cut(&mut e.message, keep_bytes);
    if let Some(scope) = e.scope.as_mut() {
        cut(scope, keep_bytes);
    }
    let all = e.per_source_reasons.len();
    loop {
        let attempt = ServerFrame {
            id,
            reply: Reply::Error(e.clone()),
        };
        let payload = codec::encode_server(&attempt);
        match &payload {
            Ok(p) if p.len() > frames.max_frame && !e.per_source_reasons.is_empty() => {
                let keep = e.per_source_reasons.len() / 2;
                e.per_source_reasons.truncate(keep);
                cut(&mut e.message, keep_bytes);
                let note = format!(" ({} of {all} per-source reasons sent)", keep);
                e.message.push_str(&note);
            }
            _ => return frames.encode(payload, dst),
        }
    }
}

macro_rules! typed_codec {
    ($(#[$doc:meta])* $name:ident, decodes $in:ty, via $dec:path, encodes $out:ty, via $enc:path) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name {
            frames: Frames,
        }

        impl $name {
            /// A codec accepting and producing payloads of at most `max_frame` bytes
            /// (clamped to [`codec::DECODE_LIMIT`]).
            pub fn new(max_frame: usize) -> Self {
                Self {
                    frames: Frames {
                        max_frame: clamp_max(max_frame),
                    },
                }
            }

            /// The maximum payload size in force.
            pub fn max_frame(&self) -> usize {
                self.frames.max_frame
            }

            /// Changes the maximum (e.g. to the `max_frame` of `Welcome`).
            pub fn set_max_frame(&mut self, max_frame: usize) {
                self.frames.max_frame = clamp_max(max_frame);
            }
        }

        impl Default for $name {
            /// Uses [`crate::DEFAULT_MAX_FRAME`].
            fn default() -> Self {
                Self::new(crate::DEFAULT_MAX_FRAME as usize)
            }
        }

        impl Decoder for $name {
            type Item = $in;
            type Error = FrameError;

            fn decode(&mut self, src: &mut BytesMut) -> Result<Option<$in>, FrameError> {
                match self.frames.decode(src)? {
                    Some(payload) => $dec(&payload).map(Some).map_err(|e| malformed(&payload, e)),
                    None => Ok(None),
                }
            }

            fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<$in>, FrameError> {
                match self.frames.decode_eof(src)? {
                    Some(payload) => $dec(&payload).map(Some).map_err(|e| malformed(&payload, e)),
                    None => Ok(None),
                }
            }
        }

        impl Encoder<$out> for $name {
            type Error = FrameError;

            fn encode(&mut self, item: $out, dst: &mut BytesMut) -> Result<(), FrameError> {
                $enc(&self.frames, item, dst)
            }
        }
    };
}

typed_codec!(
    /// The sidecar's side: decodes [`ClientFrame`]s, encodes [`ServerFrame`]s.
    ServerCodec, decodes ClientFrame, via codec::decode_client, encodes ServerFrame, via encode_server_frame
);

/// The client's encoder: every request fits `max_frame`.
fn encode_client_frame(
    frames: &Frames,
    frame: ClientFrame,
    dst: &mut BytesMut,
) -> Result<(), FrameError> {
    frames.encode(codec::encode_client(&frame), dst)
}

typed_codec!(
    /// A client's side: encodes [`ClientFrame`]s, decodes [`ServerFrame`]s.
    ClientCodec, decodes ServerFrame, via codec::decode_server, encodes ClientFrame, via encode_client_frame
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::*;
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::AsyncWriteExt;
    use tokio_util::codec::{Framed, FramedRead};

    fn ping(id: u64) -> ClientFrame {
        ClientFrame {
            id,
            request: Request::Ping,
        }
    }

    fn framed_bytes(payload: &[u8]) -> Vec<u8> {
        let mut v = (payload.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[tokio::test]
    async fn round_trip_over_duplex() {
        let (a, b) = tokio::io::duplex(1024);
        let mut client = Framed::new(a, ClientCodec::default());
        let mut server = Framed::new(b, ServerCodec::default());

        let hello = ClientFrame {
            id: 0,
            request: Request::Hello {
                protocol_version: crate::PROTOCOL_VERSION,
                client_name: "t".into(),
                pid: 1,
            },
        };
        client.send(hello.clone()).await.unwrap();
        client.send(ping(u64::MAX)).await.unwrap();
        assert_eq!(server.next().await.unwrap().unwrap(), hello);
        assert_eq!(server.next().await.unwrap().unwrap(), ping(u64::MAX));

        let welcome = ServerFrame {
            id: 0,
            reply: Reply::Welcome {
                protocol_version: 1,
                sidecar_version: "0.1.0".into(),
                max_frame: 65536,
            },
        };
        server.send(welcome.clone()).await.unwrap();
        assert_eq!(client.next().await.unwrap().unwrap(), welcome);

        // Clean close between frames: the stream just ends.
        drop(client);
        assert!(server.next().await.is_none());
    }

    #[test]
    fn layout_matches_length_delimited_codec() {
        let mut ours = BytesMut::new();
        ServerCodec::default()
            .encode(
                ServerFrame {
                    id: 3,
                    reply: Reply::Pong,
                },
                &mut ours,
            )
            .unwrap();
        let payload = codec::encode_server(&ServerFrame {
            id: 3,
            reply: Reply::Pong,
        })
        .unwrap();
        let mut theirs = BytesMut::new();
        length_codec(65536)
            .encode(bytes::Bytes::from(payload.clone()), &mut theirs)
            .unwrap();
        assert_eq!(ours, theirs);
        assert_eq!(&ours[..], &framed_bytes(&payload)[..]);
        // And the plain codec reads our frames back.
        let got = length_codec(65536).decode(&mut ours).unwrap().unwrap();
        assert_eq!(&got[..], &payload[..]);
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let bytes = framed_bytes(&codec::encode_client(&ping(42)).unwrap());
        let mut codec = ServerCodec::default();
        let mut buf = BytesMut::new();
        for (i, b) in bytes.iter().enumerate() {
            buf.put_u8(*b);
            let got = codec.decode(&mut buf).unwrap();
            if i + 1 < bytes.len() {
                assert!(got.is_none(), "byte {i}");
            } else {
                assert_eq!(got, Some(ping(42)));
            }
        }
        assert!(buf.is_empty());
    }

    #[tokio::test]
    async fn eof_mid_frame_is_an_error() {
        let bytes = framed_bytes(&codec::encode_client(&ping(42)).unwrap());
        for cut in [1, 3, 4, 5, bytes.len() - 1] {
            let (mut a, b) = tokio::io::duplex(1024);
            let mut server = FramedRead::new(b, ServerCodec::default());
            a.write_all(&framed_bytes(&codec::encode_client(&ping(1)).unwrap()))
                .await
                .unwrap();
            a.write_all(&bytes[..cut]).await.unwrap();
            drop(a);
            assert_eq!(server.next().await.unwrap().unwrap(), ping(1));
            match server.next().await {
                Some(Err(FrameError::Io(e))) => {
                    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "cut {cut}");
                    assert!(e.to_string().contains("mid-frame"));
                }
                other => panic!("cut {cut}: {other:?}"),
            }
            assert!(server.next().await.is_none());
        }
    }

    #[tokio::test]
    async fn oversize_length_prefix_is_rejected_before_the_payload() {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut server = FramedRead::new(b, ServerCodec::new(100));
        // Only the prefix is sent: the error must not wait for the payload.
        a.write_all(&101u32.to_be_bytes()).await.unwrap();
        match server.next().await {
            Some(Err(FrameError::FrameTooLarge { len: 101, max: 100 })) => {}
            other => panic!("{other:?}"),
        }
        assert!(server.next().await.is_none());

        let mut codec = ServerCodec::default();
        let mut buf = BytesMut::from(&u32::MAX.to_be_bytes()[..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::FrameTooLarge {
                len: 0xffff_ffff,
                max: 65536
            })
        ));
        assert!(buf.capacity() < 1024);
    }

    #[test]
    fn frame_of_exactly_max_is_accepted() {
        let payload = codec::encode_client(&ClientFrame {
            id: 1,
            request: Request::ForceClose {
                source: "x".repeat(10),
            },
        })
        .unwrap();
        let mut codec = ServerCodec::new(payload.len());
        let mut buf = BytesMut::from(&framed_bytes(&payload)[..]);
        assert!(codec.decode(&mut buf).unwrap().is_some());
        let mut codec = ClientCodec::new(payload.len() - 1);
        let mut out = BytesMut::new();
        let frame = decode_ok(&payload);
        assert!(matches!(
            codec.encode(frame.clone(), &mut out),
            Err(FrameError::FrameTooLarge { .. })
        ));
        codec.set_max_frame(payload.len());
        codec.encode(frame.clone(), &mut out).unwrap();
        assert_eq!(&out[..], &framed_bytes(&payload)[..]);
    }

    fn decode_ok(payload: &[u8]) -> ClientFrame {
        codec::decode_client(payload).unwrap()
    }

    #[test]
    fn encoding_an_oversize_frame_is_an_error() {
        // (An `Error` reply is shrunk to fit instead: see below.)
        let mut codec = ServerCodec::new(64);
        let mut out = BytesMut::new();
        let err = codec
            .encode(
                ServerFrame {
                    id: 1,
                    reply: Reply::Started {
                        call: 1,
                        permit: 2,
                        source: "x".repeat(100),
                        is_probe: false,
                        attempt: 1,
                        est_tokens: 0,
                    },
                },
                &mut out,
            )
            .unwrap_err();
        assert!(matches!(err, FrameError::FrameTooLarge { max: 64, .. }));
        assert!(out.is_empty());
        let err = ClientCodec::new(64)
            .encode(
                ClientFrame {
                    id: 1,
                    request: Request::Reset {
                        source: "x".repeat(100),
                    },
                },
                &mut out,
            )
            .unwrap_err();
        assert!(matches!(err, FrameError::FrameTooLarge { max: 64, .. }));
        assert!(out.is_empty());
    }

    #[tokio::test]
    async fn malformed_payload_reports_its_id() {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut server = FramedRead::new(b, ServerCodec::default());
        // id 77, Request tag 99.
        let mut payload = 77u64.to_le_bytes().to_vec();
        payload.extend_from_slice(&99u32.to_le_bytes());
        a.write_all(&framed_bytes(&payload)).await.unwrap();
        match server.next().await {
            Some(Err(FrameError::Malformed { id: Some(77), .. })) => {}
            other => panic!("{other:?}"),
        }
        assert!(server.next().await.is_none());
    }

    #[test]
    fn malformed_payload_without_id_and_with_trailing_bytes() {
        let mut codec = ServerCodec::default();
        let mut buf = BytesMut::from(&framed_bytes(&[1, 2, 3])[..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::Malformed { id: None, .. })
        ));

        let mut payload = codec::encode_client(&ping(5)).unwrap();
        payload.push(0);
        let mut buf = BytesMut::from(&framed_bytes(&payload)[..]);
        match codec.decode(&mut buf) {
            Err(FrameError::Malformed {
                id: Some(5),
                reason,
            }) => {
                assert!(reason.contains("trailing"), "{reason}")
            }
            other => panic!("{other:?}"),
        }

        // Empty payload: boundary fine, nothing to decode.
        let mut buf = BytesMut::from(&[0u8, 0, 0, 0][..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FrameError::Malformed { id: None, .. })
        ));
    }

    fn error_reply(message: String, reasons: usize, scope: String) -> ServerFrame {
        ServerFrame {
            id: 9,
            reply: Reply::Error(ErrorReply {
                kind: ErrorKind::CircuitOpen,
                message,
                retry_after_s: 1.0,
                per_source_reasons: (0..reasons)
                    .map(|i| (format!("{i}-{}", "s".repeat(200)), SkipReason::CircuitOpen))
                    .collect(),
                exhausted: None,
                scope: Some(scope),
            }),
        }
    }

    #[test]
    fn status_replies_may_exceed_max_frame_up_to_16_mib() {
        let source = SourceStatus {
            name: "x".repeat(100),
            state: BreakerState::Closed,
            epoch: 0,
            retry_after_s: 0.0,
            cooldown_level: 0,
            window_successes: 0,
            window_failures: 0,
            streak: 0,
            memo_remaining_s: 0.0,
            pacer_ceiling: 8.0,
            in_flight: 0,
            tokens_available: None,
            requests_available: None,
            quota_blocked_s: 0.0,
            degraded: false,
        };
        let report = StatusReport {
            sidecar_version: "t".into(),
            backend: "memory".into(),
            scopes: vec![ScopeStatus {
                name: "chat".into(),
                circuit_open: "wait".into(),
                quota_full: "wait".into(),
                waiters: 0,
                calls: 0,
                sources: vec![source; 2_000],
            }],
        };
        let mut server = ServerCodec::new(65536);
        let mut out = BytesMut::new();
        let status = ServerFrame {
            id: 1,
            reply: Reply::Status(report),
        };
        server.encode(status.clone(), &mut out).unwrap();
        assert!(out.len() > 65536, "{}", out.len());
        let mut client = ClientCodec::new(crate::MAX_STATUS_FRAME);
        assert_eq!(client.decode(&mut out).unwrap(), Some(status));
        let json = ServerFrame {
            id: 2,
            reply: Reply::StatusJson("x".repeat(200_000)),
        };
        server.encode(json, &mut out).unwrap();
        let too_big = ServerFrame {
            id: 3,
            reply: Reply::StatusJson("x".repeat(crate::MAX_STATUS_FRAME)),
        };
        assert!(matches!(
            server.encode(too_big, &mut BytesMut::new()),
            Err(FrameError::FrameTooLarge { .. })
        ));
        // Any other reply still fits max_frame.
        let granted = ServerFrame {
            id: 4,
            reply: Reply::Granted {
                permit: 1,
                source: "x".repeat(70_000),
                is_probe: false,
                attempt: 1,
                est_tokens: 0,
            },
        };
        assert!(matches!(
            server.encode(granted, &mut BytesMut::new()),
            Err(FrameError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn an_error_too_large_for_max_frame_is_shrunk_to_fit() {
        for max in [1024, 4096, 65536] {
            let mut server = ServerCodec::new(max);
            let mut out = BytesMut::new();
            let big = error_reply("m".repeat(100_000), 2_000, "é".repeat(50_000));
            server.encode(big, &mut out).unwrap();
            assert!(out.len() <= max + HEADER_LEN, "{max}: {}", out.len());
            let got = ClientCodec::new(max).decode(&mut out).unwrap().unwrap();
            assert_eq!(got.id, 9);
            let Reply::Error(e) = got.reply else {
                panic!("{got:?}")
            };
            assert_eq!(e.kind, ErrorKind::CircuitOpen);
            assert!(
                e.message.contains("of 2000 per-source reasons sent"),
                "{}",
                e.message
            );
            assert!(e.per_source_reasons.len() < 2_000);
        }
        // One that fits is sent untouched.
        let small = error_reply("fine".into(), 3, "chat".into());
        let mut out = BytesMut::new();
        ServerCodec::new(65536)
            .encode(small.clone(), &mut out)
            .unwrap();
        assert_eq!(
            ClientCodec::new(65536).decode(&mut out).unwrap(),
            Some(small)
        );
    }

    #[test]
    fn server_frames_encoded_in_place_match_the_payload_encoding() {
        // Replies are encoded straight into the write buffer behind a patched length
        // prefix, after whatever the buffer already holds: the bytes must be exactly
        // the prefix + `codec::encode_server` of each frame, in order.
        let frames = [
            ServerFrame {
                id: 1,
                reply: Reply::Pong,
            },
            ServerFrame {
                id: u64::MAX,
                reply: Reply::CallBegun { call: 7 },
            },
            error_reply("no source".into(), 3, "scope".into()),
            ServerFrame {
                id: 2,
                reply: Reply::Pong,
            },
        ];
        let mut codec = ServerCodec::new(4096);
        let mut dst = BytesMut::from(&b"earlier bytes"[..]);
        let mut want = b"earlier bytes".to_vec();
        for f in frames {
            want.extend(framed_bytes(&crate::codec::encode_server(&f).unwrap()));
            codec.encode(f, &mut dst).unwrap();
        }
        assert_eq!(&dst[..], &want[..]);
    }

    #[test]
    fn max_is_clamped_to_the_decoder_limit() {
        assert_eq!(
            ServerCodec::new(usize::MAX).max_frame(),
            codec::DECODE_LIMIT
        );
        assert_eq!(
            ClientCodec::default().max_frame(),
            crate::DEFAULT_MAX_FRAME as usize
        );
    }
}
