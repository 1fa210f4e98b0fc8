//! Payload encoding: the one place that knows how a message becomes bytes.
//!
//! The layout is bincode's *legacy* layout (byte-compatible with bincode 1.x):
//! fixed-width little-endian integers, `u64` length prefixes for strings and
//! sequences, `u32` enum variant tags (= variant index), `Option` as a `0`/`1` byte
//! followed by the value, `bool` as one byte, `f64` as 8 bytes little-endian,
//! structs and tuples as their fields in order, no padding. `bindings/PROTOCOL.md`
//! pins it byte by byte.
//!
//! Upstream bincode stopped development in 2025; it is pinned (`=2.0.1`) and used only
//! in this module, so a compatible encoder (e.g. `wincode`, or a hand-written one) can
//! replace it without touching anything else. No bincode type appears in this
//! module's public API.
//!
//! Decoding is strict: the whole payload must be one value (trailing bytes are an
//! error), and the decoder has a byte limit ([`DECODE_LIMIT`]), so a hostile length
//! prefix inside a payload (a string "of 2^63 bytes") is refused before anything is
//! allocated for it.

use bincode::config::{self, Config};
use serde::{de::DeserializeOwned, Serialize};

use crate::messages::{ClientFrame, ServerFrame};

/// The most bytes a single payload may claim while it is decoded (16 MiB).
///
/// A well-formed payload never claims more bytes than it has, so this is also the
/// hard upper bound for any `max_frame`: a payload longer than this is refused by
/// [`decode_client`] / [`decode_server`] with [`CodecError::TooLarge`].
pub const DECODE_LIMIT: usize = 16 * 1024 * 1024;

/// Why a payload could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The value could not be serialized (never expected for the protocol's types).
    #[error("cannot encode message: {reason}")]
    Encode {
        /// What the encoder reported.
        reason: String,
    },
    /// The payload is not a valid encoding of the expected message: truncated,
    /// unknown enum tag, invalid bool/Option byte, invalid UTF-8, or a length
    /// prefix larger than the data or than [`DECODE_LIMIT`].
    #[error("cannot decode message: {reason}")]
    Decode {
        /// What the decoder reported.
        reason: String,
    },
    /// A complete message was decoded but bytes were left over.
    #[error("{extra} trailing byte(s) after a complete message of {used} byte(s)")]
    TrailingBytes {
        /// Bytes the message used.
        used: usize,
        /// Bytes left over after it.
        extra: usize,
    },
    /// The payload is longer than [`DECODE_LIMIT`].
    #[error("payload of {len} bytes exceeds the decoder limit of {max} bytes")]
    TooLarge {
        /// Payload length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// bincode legacy layout, with a decode limit (no effect on encoding).
fn wire_config() -> impl Config {
    config::legacy().with_limit::<DECODE_LIMIT>()
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    bincode::serde::encode_to_vec(value, wire_config()).map_err(|e| CodecError::Encode {
        reason: e.to_string(),
    })
}

/// Appends a value's encoding to `dst` (no intermediate buffer: the hot path's
/// replies go straight into the connection's write buffer, §16).
fn encode_onto<T: Serialize>(value: &T, dst: &mut bytes::BytesMut) -> Result<(), CodecError> {
    /// bincode's writer over the caller's buffer.
    struct Onto<'a>(&'a mut bytes::BytesMut);
    impl bincode::enc::write::Writer for Onto<'_> {
        fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
            self.0.extend_from_slice(bytes);
            Ok(())
        }
    }
    bincode::serde::encode_into_writer(value, Onto(dst), wire_config()).map_err(|e| {
        CodecError::Encode {
            reason: e.to_string(),
        }
    })
}

fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, CodecError> {
    if payload.len() > DECODE_LIMIT {
        return Err(CodecError::TooLarge {
            len: payload.len(),
            max: DECODE_LIMIT,
        });
    }
    let (value, used) =
        bincode::serde::decode_from_slice::<T, _>(payload, wire_config()).map_err(|e| {
            CodecError::Decode {
                reason: e.to_string(),
            }
        })?;
    if used != payload.len() {
        return Err(CodecError::TrailingBytes {
            used,
            extra: payload.len() - used,
        });
    }
    Ok(value)
}

/// Encodes a client frame into its payload (no length prefix).
pub fn encode_client(frame: &ClientFrame) -> Result<Vec<u8>, CodecError> {
    encode(frame)
}

/// Decodes a whole payload (no length prefix) into a client frame.
///
/// A call's frames take a hand-written path (`fast.rs`); anything it does not
/// accept goes through serde, which decides and words the error.
pub fn decode_client(payload: &[u8]) -> Result<ClientFrame, CodecError> {
    if payload.len() <= DECODE_LIMIT {
        if let Some(frame) = crate::fast::decode_client(payload) {
            return Ok(frame);
        }
    }
    decode(payload)
}

/// [`decode_client`] without the fast path (its tests compare the two).
#[cfg(test)]
pub(crate) fn decode_client_generic(payload: &[u8]) -> Result<ClientFrame, CodecError> {
    decode(payload)
}

/// Encodes a server frame into its payload (no length prefix).
pub fn encode_server(frame: &ServerFrame) -> Result<Vec<u8>, CodecError> {
    encode(frame)
}

/// Appends a server frame's payload (no length prefix) to `dst`; on an error `dst`
/// may hold part of it (the caller truncates).
pub fn encode_server_onto(
    frame: &ServerFrame,
    dst: &mut bytes::BytesMut,
) -> Result<(), CodecError> {
    if crate::fast::encode_server(frame, dst) {
        return Ok(());
    }
    encode_onto(frame, dst)
}

/// Decodes a whole payload (no length prefix) into a server frame.
pub fn decode_server(payload: &[u8]) -> Result<ServerFrame, CodecError> {
    decode(payload)
}

/// The request id of a payload that may not decode: its first 8 bytes, little-endian
/// (both frame types start with their `u64` id). `None` if it is shorter than 8 bytes.
///
/// Lets a server answer a malformed frame with the id the client used.
pub fn peek_id(payload: &[u8]) -> Option<u64> {
    let head: [u8; 8] = payload.get(..8)?.try_into().ok()?;
    Some(u64::from_le_bytes(head))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::messages::*;

    fn client(id: u64, request: Request) -> ClientFrame {
        ClientFrame { id, request }
    }

    fn server(id: u64, reply: Reply) -> ServerFrame {
        ServerFrame { id, reply }
    }

    fn error(kind: ErrorKind) -> ErrorReply {
        ErrorReply {
            kind,
            message: "m".into(),
            retry_after_s: 0.0,
            per_source_reasons: vec![],
            exhausted: None,
            scope: None,
        }
    }

    /// One of every request (and of every outcome inside them): the corpus of the
    /// codec's round-trip tests and of `fast`'s.
    pub(crate) fn all_requests() -> Vec<Request> {
        let mut v = vec![
            Request::Hello {
                protocol_version: crate::PROTOCOL_VERSION,
                client_name: "test".into(),
                pid: 1,
            },
            Request::BeginCall {
                scope: "chat".into(),
                est_tokens: None,
            },
            Request::BeginCall {
                scope: "chat".into(),
                est_tokens: Some(u64::MAX),
            },
            Request::Acquire { call: 9 },
            Request::EndCall { call: 9 },
            Request::Status,
            Request::ForceOpen {
                source: "s".into(),
                seconds: 0.5,
            },
            Request::ForceClose { source: "s".into() },
            Request::Reset {
                source: "ü東".into(),
            },
            Request::Ping,
            Request::Cancel { target: 4 },
        ];
        let outcomes = [
            Outcome::Success {
                tokens: Some(3),
                count_attempt: true,
            },
            Outcome::Success {
                tokens: None,
                count_attempt: false,
            },
            Outcome::RateLimited {
                retry_after_s: Some(-1.25),
            },
            Outcome::RateLimited {
                retry_after_s: None,
            },
            Outcome::Cancelled,
        ]
        .into_iter()
        .chain(
            [
                FailureKind::Timeout,
                FailureKind::ServerError,
                FailureKind::Connection,
                FailureKind::BadResult,
                FailureKind::Error,
            ]
            .into_iter()
            .map(|kind| Outcome::Failure { kind }),
        );
        let outcomes: Vec<Outcome> = outcomes
            .chain([
                Outcome::SuccessUsage {
                    usage: Usage {
                        tokens: None,
                        input_tokens: Some(1),
                        output_tokens: Some(u64::MAX),
                    },
                    count_attempt: false,
                },
                Outcome::FailureUsage {
                    kind: FailureKind::BadResult,
                    usage: Usage::default(),
                },
                Outcome::SuccessCached {
                    usage: Usage {
                        tokens: Some(10),
                        input_tokens: Some(4),
                        output_tokens: Some(6),
                    },
                    cached_input_tokens: 1000,
                    count_attempt: true,
                },
            ])
            .collect();
        for outcome in &outcomes {
            v.push(Request::Retry {
                permit: 6,
                outcome: outcome.clone(),
            });
            v.push(Request::Finish {
                permit: 7,
                outcome: outcome.clone(),
            });
        }
        v.extend(
            outcomes
                .iter()
                .cloned()
                .map(|outcome| Request::Report { permit: 5, outcome }),
        );
        let spec = CallSpec {
            scope: "chat".into(),
            est_tokens: Some(3),
            priority: Some("interactive".into()),
            est_input_tokens: None,
            est_output_tokens: Some(4),
        };
        v.push(Request::Start(spec.clone()));
        v.push(Request::Begin(spec.clone()));
        v.push(Request::StatusJson);
        v.push(Request::StartTenant {
            spec: spec.clone(),
            tenant: "acme".into(),
        });
        v.push(Request::BeginTenant {
            spec,
            tenant: "équipe-7".into(),
        });
        v.push(Request::TenantStatus {
            scope: None,
            tenant: "acme".into(),
        });
        v.push(Request::TenantStatus {
            scope: Some("chat".into()),
            tenant: String::new(),
        });
        let limits = ObservedLimits {
            requests: Some(ObservedLimit {
                limit: Some(500),
                remaining: Some(499),
                reset_s: Some(0.12),
            }),
            tokens: Some(ObservedLimit {
                limit: None,
                remaining: Some(30_000),
                reset_s: None,
            }),
            input_tokens: None,
            output_tokens: None,
            age_s: 0.0,
        };
        for outcome in outcomes {
            v.push(Request::ReportObserved {
                permit: 5,
                outcome: outcome.clone(),
                limits,
            });
            v.push(Request::RetryObserved {
                permit: 6,
                outcome: outcome.clone(),
                limits,
            });
            v.push(Request::FinishObserved {
                permit: 7,
                outcome,
                limits,
            });
        }
        v
    }

    /// One of every reply, likewise.
    pub(crate) fn all_replies() -> Vec<Reply> {
        let mut v = vec![
            Reply::Welcome {
                protocol_version: 1,
                sidecar_version: "0.1.0".into(),
                max_frame: 65536,
            },
            Reply::CallBegun { call: 1 },
            Reply::Granted {
                permit: 2,
                source: "a".into(),
                is_probe: true,
                attempt: 1,
                est_tokens: 10,
            },
            Reply::Ok,
            Reply::Pong,
            Reply::Status(StatusReport {
                sidecar_version: "0.1.0".into(),
                backend: "memory".into(),
                scopes: vec![ScopeStatus {
                    name: "chat".into(),
                    circuit_open: "wait".into(),
                    quota_full: "fail_fast".into(),
                    waiters: 1,
                    calls: 2,
                    sources: vec![SourceStatus {
                        name: "a".into(),
                        state: BreakerState::HalfOpen,
                        epoch: 3,
                        retry_after_s: 0.0,
                        cooldown_level: 1,
                        window_successes: 4,
                        window_failures: 5,
                        streak: 6,
                        memo_remaining_s: 0.0,
                        pacer_ceiling: 7.5,
                        in_flight: 8,
                        tokens_available: Some(-1.0),
                        requests_available: None,
                        quota_blocked_s: 0.0,
                        degraded: true,
                    }],
                }],
            }),
        ];
        for state in [
            BreakerState::Closed,
            BreakerState::Open,
            BreakerState::HalfOpen,
        ] {
            v.push(Reply::Reported {
                applied: false,
                state,
                retry_after_s: 1.5,
            });
        }
        let mut e = error(ErrorKind::AllSourcesExhausted);
        e.per_source_reasons = vec![
            ("a".into(), SkipReason::CircuitOpen),
            ("b".into(), SkipReason::Paced),
            ("c".into(), SkipReason::RateLimited),
            ("d".into(), SkipReason::BackendUnavailable),
            ("e".into(), SkipReason::TenantLimited),
        ];
        e.exhausted = Some(ExhaustionReason::Stalled);
        e.scope = Some("chat".into());
        v.push(Reply::Error(e));
        v.extend(
            [
                ErrorKind::CircuitOpen,
                ErrorKind::UnknownScope,
                ErrorKind::UnknownCall,
                ErrorKind::UnknownPermit,
                ErrorKind::InvalidArgument,
                ErrorKind::Malformed,
                ErrorKind::FrameTooLarge,
                ErrorKind::ProtocolViolation,
                ErrorKind::PermissionDenied,
                ErrorKind::ShuttingDown,
                ErrorKind::BackendUnavailable,
                ErrorKind::Cancelled,
                ErrorKind::Busy,
                ErrorKind::Internal,
                ErrorKind::Overloaded,
                ErrorKind::TenantLimited,
            ]
            .map(|k| Reply::Error(error(k))),
        );
        let mut e = error(ErrorKind::TenantLimited);
        e.retry_after_s = 3600.0;
        e.per_source_reasons = vec![("a".into(), SkipReason::TenantLimited)];
        e.scope = Some("chat".into());
        v.push(Reply::TenantLimited(TenantRefusal {
            error: e,
            tenant: "acme".into(),
            limit: "usd_per_day".into(),
        }));
        v.push(Reply::Started {
            call: u64::MAX,
            permit: 1,
            source: "ü".into(),
            is_probe: false,
            attempt: 3,
            est_tokens: 0,
        });
        v.push(Reply::StatusJson("{\"scopes\":[]}".into()));
        v
    }

    #[test]
    fn every_request_round_trips() {
        for (i, request) in all_requests().into_iter().enumerate() {
            let frame = client(i as u64 * 1_000_003, request);
            let bytes = encode_client(&frame).unwrap();
            assert_eq!(decode_client(&bytes).unwrap(), frame);
            assert_eq!(peek_id(&bytes), Some(frame.id));
        }
    }

    #[test]
    fn every_reply_round_trips() {
        for (i, reply) in all_replies().into_iter().enumerate() {
            let frame = server(u64::MAX - i as u64, reply);
            let bytes = encode_server(&frame).unwrap();
            assert_eq!(decode_server(&bytes).unwrap(), frame);
            assert_eq!(peek_id(&bytes), Some(frame.id));
        }
    }

    #[test]
    fn layout_is_bincode_legacy() {
        // id 1, tag 1 (BeginCall), "chat" with u64 length, Option::None.
        let bytes = encode_client(&client(
            1,
            Request::BeginCall {
                scope: "chat".into(),
                est_tokens: None,
            },
        ))
        .unwrap();
        let mut want = vec![1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b"chat");
        want.push(0);
        assert_eq!(bytes, want);
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = encode_client(&client(7, Request::Ping)).unwrap();
        bytes.push(0);
        assert_eq!(
            decode_client(&bytes),
            Err(CodecError::TrailingBytes { used: 12, extra: 1 })
        );
        let mut bytes = encode_server(&server(7, Reply::Pong)).unwrap();
        bytes.extend_from_slice(&[1, 2, 3]);
        assert!(matches!(
            decode_server(&bytes),
            Err(CodecError::TrailingBytes { extra: 3, .. })
        ));
    }

    #[test]
    fn truncated_payload_is_rejected() {
        let bytes = encode_client(&client(
            3,
            Request::Hello {
                protocol_version: 1,
                client_name: "abc".into(),
                pid: 2,
            },
        ))
        .unwrap();
        for cut in 0..bytes.len() {
            assert!(
                matches!(decode_client(&bytes[..cut]), Err(CodecError::Decode { .. })),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn unknown_enum_tags_are_rejected() {
        // Request tag 16 does not exist.
        let mut bytes = 5u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&16u32.to_le_bytes());
        assert!(matches!(
            decode_client(&bytes),
            Err(CodecError::Decode { .. })
        ));
        // Reply tag 10 does not exist.
        let mut bytes = 5u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&10u32.to_le_bytes());
        assert!(matches!(
            decode_server(&bytes),
            Err(CodecError::Decode { .. })
        ));
        // Report with FailureKind tag 5.
        let mut bytes = encode_client(&client(
            1,
            Request::Report {
                permit: 2,
                outcome: Outcome::Failure {
                    kind: FailureKind::Error,
                },
            },
        ))
        .unwrap();
        let n = bytes.len();
        assert_eq!(&bytes[n - 4..], &4u32.to_le_bytes());
        bytes[n - 4] = 5;
        assert!(decode_client(&bytes).is_err());
    }

    #[test]
    fn invalid_bool_option_and_utf8_are_rejected() {
        // Success { tokens: Option tag 2 }
        let mut bytes = 1u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes()); // Report
        bytes.extend_from_slice(&2u64.to_le_bytes()); // permit
        bytes.extend_from_slice(&0u32.to_le_bytes()); // Success
        let mut bad_option = bytes.clone();
        bad_option.extend_from_slice(&[2, 1]);
        assert!(decode_client(&bad_option).is_err());
        let mut bad_bool = bytes.clone();
        bad_bool.extend_from_slice(&[0, 2]);
        assert!(decode_client(&bad_bool).is_err());
        let mut good = bytes;
        good.extend_from_slice(&[0, 1]);
        assert!(decode_client(&good).is_ok());

        let mut bad_utf8 = 1u64.to_le_bytes().to_vec();
        bad_utf8.extend_from_slice(&7u32.to_le_bytes()); // ForceClose
        bad_utf8.extend_from_slice(&2u64.to_le_bytes());
        bad_utf8.extend_from_slice(&[0xc3, 0x28]);
        assert!(decode_client(&bad_utf8).is_err());

        // The hot-path names (`Start`'s scope, decoded from a borrowed `&str`): a
        // bad one is refused, a good one decodes to the same string, a length
        // past the payload is an error, not an allocation.
        let start = |name: &[u8], len: u64| {
            let mut b = 1u64.to_le_bytes().to_vec();
            b.extend_from_slice(&11u32.to_le_bytes()); // Start
            b.extend_from_slice(&len.to_le_bytes());
            b.extend_from_slice(name);
            b.extend_from_slice(&[0, 0, 0, 0]); // four `None`s
            b
        };
        assert!(decode_client(&start(&[0xc3, 0x28], 2)).is_err());
        assert!(decode_client(&start(b"ab", 1 << 62)).is_err());
        match decode_client(&start("sé".as_bytes(), 3)).unwrap().request {
            Request::Start(spec) => assert_eq!(spec.scope, "sé"),
            other => panic!("decoded {other:?}"),
        }
    }

    #[test]
    fn hostile_length_prefix_does_not_allocate() {
        // ForceClose { source: <string claiming 2^63 bytes> }: must fail fast instead
        // of trying to allocate (which would abort the process).
        for len in [1u64 << 63, u64::MAX, (DECODE_LIMIT as u64) + 1, 1 << 40] {
            let mut bytes = 9u64.to_le_bytes().to_vec();
            bytes.extend_from_slice(&7u32.to_le_bytes());
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(b"abc");
            assert!(
                matches!(decode_client(&bytes), Err(CodecError::Decode { .. })),
                "len {len}"
            );
            assert_eq!(peek_id(&bytes), Some(9));
        }
        // A Vec length of 2^63 inside an error reply (client side decoding).
        let mut bytes = 9u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&7u32.to_le_bytes()); // Error
        bytes.extend_from_slice(&0u32.to_le_bytes()); // CircuitOpen
        bytes.extend_from_slice(&0u64.to_le_bytes()); // message ""
        bytes.extend_from_slice(&0f64.to_le_bytes());
        bytes.extend_from_slice(&(1u64 << 63).to_le_bytes()); // per_source_reasons
        assert!(matches!(
            decode_server(&bytes),
            Err(CodecError::Decode { .. })
        ));
    }

    #[test]
    fn oversize_payload_is_rejected() {
        let bytes = vec![0u8; DECODE_LIMIT + 1];
        assert_eq!(
            decode_client(&bytes),
            Err(CodecError::TooLarge {
                len: DECODE_LIMIT + 1,
                max: DECODE_LIMIT
            })
        );
    }

    #[test]
    fn peek_id_needs_eight_bytes() {
        assert_eq!(peek_id(&[1, 2, 3, 4, 5, 6, 7]), None);
        assert_eq!(peek_id(&[]), None);
        assert_eq!(peek_id(&[1, 0, 0, 0, 0, 0, 0, 0]), Some(1));
        assert_eq!(peek_id(&[0xff; 9]), Some(u64::MAX));
    }
}
