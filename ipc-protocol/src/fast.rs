//! Hand-written codecs for the frames every call sends (DESIGN §16).
//!
//! A full call is a `Start` and a `Finish` (or the v1 `BeginCall`, `Acquire`,
//! `Report`, `EndCall`), answered by `Started` / `Reported` / …; serde's generic walk
//! over them (a visitor per struct, field and enum) was ~500 instructions per frame,
//! a third of what the sidecar's connection spends on a frame outside the engine.
//! These functions read and write the same bincode legacy bytes directly.
//!
//! They are a fast path only, never the definition of the format: the decoder
//! answers `None` for anything it does not handle *or that looks in any way wrong*
//! (an unknown tag, a bad `Option` or `bool` byte, a length past the end, bad UTF-8,
//! trailing bytes), and the caller then runs the generic decoder, which decides and
//! words the error. So the fast path can only ever accept a payload the generic
//! decoder accepts, with the same value — `tests::fast_paths_agree_with_serde`
//! checks exactly that over every single-byte change and truncation of many frames.

use crate::messages::{
    BreakerState, CallSpec, ClientFrame, FailureKind, ObservedLimit, ObservedLimits, Outcome,
    Reply, Request, ServerFrame, Usage,
};

/// A cursor over a payload; every read fails (`None`) past the end.
struct Rd<'a> {
    /// The payload.
    b: &'a [u8],
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn bool(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    /// An `Option`: its tag byte (0 `None`, 1 `Some`), then the value `read` reads.
    fn opt<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        Some(if self.bool()? {
            Some(read(self)?)
        } else {
            None
        })
    }

    fn f64(&mut self) -> Option<f64> {
        self.u64().map(f64::from_bits)
    }

    fn string(&mut self) -> Option<String> {
        let len = usize::try_from(self.u64()?).ok()?;
        std::str::from_utf8(self.take(len)?).ok().map(str::to_owned)
    }

    fn kind(&mut self) -> Option<FailureKind> {
        Some(match self.u32()? {
            0 => FailureKind::Timeout,
            1 => FailureKind::ServerError,
            2 => FailureKind::Connection,
            3 => FailureKind::BadResult,
            4 => FailureKind::Error,
            _ => return None,
        })
    }

    fn usage(&mut self) -> Option<Usage> {
        Some(Usage {
            tokens: self.opt(Self::u64)?,
            input_tokens: self.opt(Self::u64)?,
            output_tokens: self.opt(Self::u64)?,
        })
    }

    fn outcome(&mut self) -> Option<Outcome> {
        Some(match self.u32()? {
            0 => Outcome::Success {
                tokens: self.opt(Self::u64)?,
                count_attempt: self.bool()?,
            },
            1 => Outcome::Failure { kind: self.kind()? },
            2 => Outcome::RateLimited {
                retry_after_s: self.opt(Self::f64)?,
            },
            3 => Outcome::Cancelled,
            4 => Outcome::SuccessUsage {
                usage: self.usage()?,
                count_attempt: self.bool()?,
            },
            5 => Outcome::FailureUsage {
                kind: self.kind()?,
                usage: self.usage()?,
            },
            6 => Outcome::SuccessCached {
                usage: self.usage()?,
                cached_input_tokens: self.u64()?,
                count_attempt: self.bool()?,
            },
            _ => return None,
        })
    }

    fn limit(&mut self) -> Option<ObservedLimit> {
        Some(ObservedLimit {
            limit: self.opt(Self::u64)?,
            remaining: self.opt(Self::u64)?,
            reset_s: self.opt(Self::f64)?,
        })
    }

    fn limits(&mut self) -> Option<ObservedLimits> {
        Some(ObservedLimits {
            requests: self.opt(Self::limit)?,
            tokens: self.opt(Self::limit)?,
            input_tokens: self.opt(Self::limit)?,
            output_tokens: self.opt(Self::limit)?,
            age_s: self.f64()?,
        })
    }

    fn spec(&mut self) -> Option<CallSpec> {
        Some(CallSpec {
            scope: self.string()?,
            est_tokens: self.opt(Self::u64)?,
            priority: self.opt(Self::string)?,
            est_input_tokens: self.opt(Self::u64)?,
            est_output_tokens: self.opt(Self::u64)?,
        })
    }
}

/// The client frame in `payload` if it is one of a call's frames and well formed;
/// `None` sends the caller to the generic decoder (see the module docs).
pub(crate) fn decode_client(payload: &[u8]) -> Option<ClientFrame> {
    let mut r = Rd { b: payload };
    let id = r.u64()?;
    let request = match r.u32()? {
        1 => Request::BeginCall {
            scope: r.string()?,
            est_tokens: r.opt(Rd::u64)?,
        },
        2 => Request::Acquire { call: r.u64()? },
        3 => Request::Report {
            permit: r.u64()?,
            outcome: r.outcome()?,
        },
        4 => Request::EndCall { call: r.u64()? },
        9 => Request::Ping,
        10 => Request::Cancel { target: r.u64()? },
        11 => Request::Start(r.spec()?),
        12 => Request::Retry {
            permit: r.u64()?,
            outcome: r.outcome()?,
        },
        13 => Request::Finish {
            permit: r.u64()?,
            outcome: r.outcome()?,
        },
        14 => Request::Begin(r.spec()?),
        16 => Request::ReportObserved {
            permit: r.u64()?,
            outcome: r.outcome()?,
            limits: r.limits()?,
        },
        17 => Request::RetryObserved {
            permit: r.u64()?,
            outcome: r.outcome()?,
            limits: r.limits()?,
        },
        18 => Request::FinishObserved {
            permit: r.u64()?,
            outcome: r.outcome()?,
            limits: r.limits()?,
        },
        19 => Request::StartTenant {
            spec: r.spec()?,
            tenant: r.string()?,
        },
        20 => Request::BeginTenant {
            spec: r.spec()?,
            tenant: r.string()?,
        },
        _ => return None,
    };
    r.b.is_empty().then_some(ClientFrame { id, request })
}

/// Appends the payload of `frame` to `dst` if its reply is one of a call's replies
/// (`false`, with `dst` untouched, for the rest: the caller encodes those).
pub(crate) fn encode_server(frame: &ServerFrame, dst: &mut bytes::BytesMut) -> bool {
    use bytes::BufMut;
    fn string(dst: &mut bytes::BytesMut, s: &str) {
        dst.put_u64_le(s.len() as u64);
        dst.put_slice(s.as_bytes());
    }
    fn state(s: BreakerState) -> u32 {
        match s {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
    let tag = match &frame.reply {
        Reply::CallBegun { .. } => 1,
        Reply::Granted { .. } => 2,
        Reply::Reported { .. } => 3,
        Reply::Ok => 4,
        Reply::Pong => 6,
        Reply::Started { .. } => 8,
        _ => return false,
    };
    dst.put_u64_le(frame.id);
    dst.put_u32_le(tag);
    match &frame.reply {
        Reply::CallBegun { call } => dst.put_u64_le(*call),
        Reply::Granted {
            permit,
            source,
            is_probe,
            attempt,
            est_tokens,
        } => {
            dst.put_u64_le(*permit);
            string(dst, source);
            dst.put_u8(u8::from(*is_probe));
            dst.put_u32_le(*attempt);
            dst.put_u64_le(*est_tokens);
        }
        Reply::Reported {
            applied,
            state: s,
            retry_after_s,
        } => {
            dst.put_u8(u8::from(*applied));
            dst.put_u32_le(state(*s));
            dst.put_u64_le(retry_after_s.to_bits());
        }
        Reply::Started {
            call,
            permit,
            source,
            is_probe,
            attempt,
            est_tokens,
        } => {
            dst.put_u64_le(*call);
            dst.put_u64_le(*permit);
            string(dst, source);
            dst.put_u8(u8::from(*is_probe));
            dst.put_u32_le(*attempt);
            dst.put_u64_le(*est_tokens);
        }
        _ => {} // Ok, Pong: the tag is all
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;

    /// Values at the edges a hand-written reader can get wrong (NaN and -0.0, the
    /// integer limits, empty and non-ASCII names, every kind with a usage).
    fn edge_outcomes() -> Vec<Outcome> {
        let usage = Usage {
            tokens: Some(0),
            input_tokens: Some(u64::MAX),
            output_tokens: Some(7),
        };
        let mut v: Vec<Outcome> = [f64::NAN, -0.0, 2.5]
            .into_iter()
            .map(|d| Outcome::RateLimited {
                retry_after_s: Some(d),
            })
            .collect();
        for count_attempt in [false, true] {
            for tokens in [Some(0), Some(u64::MAX)] {
                v.push(Outcome::Success {
                    tokens,
                    count_attempt,
                });
            }
            v.push(Outcome::SuccessUsage {
                usage,
                count_attempt,
            });
            v.push(Outcome::SuccessCached {
                usage,
                cached_input_tokens: u64::MAX,
                count_attempt,
            });
        }
        for kind in [
            FailureKind::Timeout,
            FailureKind::ServerError,
            FailureKind::Connection,
            FailureKind::BadResult,
            FailureKind::Error,
        ] {
            v.push(Outcome::FailureUsage { kind, usage });
        }
        v
    }

    /// The codec's corpus (one of every request) and the edge values.
    fn requests() -> Vec<Request> {
        let mut v = codec::tests::all_requests();
        for scope in ["", "sé"] {
            let spec = CallSpec {
                scope: scope.into(),
                est_tokens: Some(u64::MAX),
                priority: Some(scope.into()),
                est_input_tokens: Some(0),
                est_output_tokens: None,
            };
            v.push(Request::Start(spec.clone()));
            v.push(Request::Begin(spec.clone()));
            v.push(Request::StartTenant {
                spec: spec.clone(),
                tenant: scope.into(),
            });
            v.push(Request::BeginTenant {
                spec,
                tenant: "t\u{1F600}".into(),
            });
        }
        for outcome in edge_outcomes() {
            v.push(Request::Report {
                permit: 0,
                outcome: outcome.clone(),
            });
            v.push(Request::Retry {
                permit: 1,
                outcome: outcome.clone(),
            });
            v.push(Request::Finish {
                permit: u64::MAX,
                outcome: outcome.clone(),
            });
            v.push(Request::FinishObserved {
                permit: 3,
                outcome,
                limits: edge_limits(),
            });
        }
        v
    }

    /// Observed limits with every part at an edge (NaN and -0.0 seconds, absent
    /// dimensions and parts, the integer limits).
    fn edge_limits() -> ObservedLimits {
        ObservedLimits {
            requests: Some(ObservedLimit {
                limit: Some(u64::MAX),
                remaining: Some(0),
                reset_s: Some(f64::NAN),
            }),
            tokens: None,
            input_tokens: Some(ObservedLimit::default()),
            output_tokens: Some(ObservedLimit {
                limit: None,
                remaining: Some(7),
                reset_s: Some(-0.0),
            }),
            age_s: 0.25,
        }
    }

    /// The codec's corpus (one of every reply) and the edge values.
    fn replies() -> Vec<Reply> {
        let mut v = codec::tests::all_replies();
        for (is_probe, source) in [(false, ""), (true, "sé")] {
            v.push(Reply::Granted {
                permit: u64::MAX,
                source: source.into(),
                is_probe,
                attempt: u32::MAX,
                est_tokens: 0,
            });
            v.push(Reply::Started {
                call: u64::MAX,
                permit: 0,
                source: source.into(),
                is_probe,
                attempt: u32::MAX,
                est_tokens: u64::MAX,
            });
        }
        for state in [
            BreakerState::Closed,
            BreakerState::Open,
            BreakerState::HalfOpen,
        ] {
            for (applied, retry_after_s) in [(true, 0.0), (false, 1.5e300), (true, f64::NAN)] {
                v.push(Reply::Reported {
                    applied,
                    state,
                    retry_after_s,
                });
            }
        }
        v
    }

    /// A frame's canonical bytes (compares values with NaN inside them).
    fn bytes_of(frame: &ClientFrame) -> Vec<u8> {
        codec::encode_client(frame).expect("encodes")
    }

    #[test]
    fn fast_paths_agree_with_serde() {
        let mut fast_hits = 0;
        for (i, request) in requests().into_iter().enumerate() {
            let frame = ClientFrame {
                id: i as u64 * 0x0101_0101_0101,
                request,
            };
            let good = bytes_of(&frame);
            // The frame itself, every truncation, every single-byte change, and a
            // trailing byte: whatever the fast path accepts, serde accepts with the
            // same value.
            let mut variants = vec![good.clone()];
            variants.extend((0..good.len()).map(|n| good[..n].to_vec()));
            for pos in 0..good.len() {
                for byte in [0u8, 1, 2, 0x7f, 0x80, 0xc3, 0xff] {
                    let mut b = good.clone();
                    b[pos] = byte;
                    variants.push(b);
                }
            }
            let mut extra = good.clone();
            extra.push(0);
            variants.push(extra);
            for payload in variants {
                if let Some(fast) = decode_client(&payload) {
                    fast_hits += 1;
                    let slow = codec::decode_client_generic(&payload).unwrap_or_else(|e| {
                        panic!("fast path accepted {payload:?}, serde refused: {e}")
                    });
                    assert_eq!(bytes_of(&fast), bytes_of(&slow), "{payload:?}");
                    assert_eq!(bytes_of(&fast), payload, "the bytes are canonical");
                }
            }
            // The untouched frame of a call decodes on the fast path.
            let handled = matches!(
                frame.request,
                Request::BeginCall { .. }
                    | Request::Acquire { .. }
                    | Request::Report { .. }
                    | Request::EndCall { .. }
                    | Request::Ping
                    | Request::Cancel { .. }
                    | Request::Start(_)
                    | Request::Retry { .. }
                    | Request::Finish { .. }
                    | Request::Begin(_)
                    | Request::ReportObserved { .. }
                    | Request::RetryObserved { .. }
                    | Request::FinishObserved { .. }
                    | Request::StartTenant { .. }
                    | Request::BeginTenant { .. }
            );
            assert_eq!(decode_client(&good).is_some(), handled, "{frame:?}");
        }
        assert!(
            fast_hits > 1000,
            "only {fast_hits} payloads took the fast path"
        );
    }

    #[test]
    fn fast_encoding_is_serdes() {
        for (i, reply) in replies().into_iter().enumerate() {
            let frame = ServerFrame {
                id: i as u64 * 0x0102_0304_0506,
                reply,
            };
            let mut fast = bytes::BytesMut::from(&b"prefix"[..]);
            let handled = encode_server(&frame, &mut fast);
            let slow = codec::encode_server(&frame).expect("encodes");
            let call_reply = matches!(
                frame.reply,
                Reply::CallBegun { .. }
                    | Reply::Granted { .. }
                    | Reply::Reported { .. }
                    | Reply::Ok
                    | Reply::Pong
                    | Reply::Started { .. }
            );
            assert_eq!(handled, call_reply, "{frame:?}");
            if handled {
                assert_eq!(&fast[6..], &slow[..], "{frame:?}");
            } else {
                assert_eq!(&fast[..], b"prefix", "untouched: {frame:?}");
            }
        }
    }
}
