//! Golden vectors: `bindings/vectors/frames.json`.
//!
//! Every binding must encode each vector's `value` to exactly its `frame_hex` and
//! decode `frame_hex` back to `value`. This test builds the samples in Rust and
//! checks the file against them; `POLYGATE_REGEN_VECTORS=1 cargo test -p
//! ipc-protocol --test vectors` rewrites the file from the samples instead.

use std::collections::BTreeSet;
use std::path::PathBuf;

use bytes::BytesMut;
use ipc_protocol::*;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio_util::codec::Decoder;

#[derive(Serialize, Deserialize)]
struct File {
    protocol_version: u32,
    encoding: String,
    vectors: Vec<Vector>,
}

#[derive(Serialize, Deserialize)]
struct Vector {
    name: String,
    direction: String,
    description: String,
    /// Kept raw so the file shows fields in wire order (serde_json's `Value` sorts).
    value: Box<RawValue>,
    frame_hex: String,
}

enum Frame {
    Client(ClientFrame),
    Server(ServerFrame),
}

struct Sample {
    name: &'static str,
    description: &'static str,
    frame: Frame,
}

impl Frame {
    fn direction(&self) -> &'static str {
        match self {
            Frame::Client(_) => "client",
            Frame::Server(_) => "server",
        }
    }

    fn json(&self) -> String {
        match self {
            Frame::Client(f) => serde_json::to_string(f),
            Frame::Server(f) => serde_json::to_string(f),
        }
        .unwrap()
    }

    fn frame_bytes(&self) -> Vec<u8> {
        let payload = match self {
            Frame::Client(f) => encode_client(f),
            Frame::Server(f) => encode_server(f),
        }
        .unwrap();
        let mut out = (payload.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&payload);
        out
    }

    /// Decodes `bytes` (prefix + payload) as this sample's direction and compares.
    fn check_decodes(&self, bytes: &[u8]) -> bool {
        let mut buf = BytesMut::from(bytes);
        let ok = match self {
            Frame::Client(f) => {
                let mut c = ServerCodec::default();
                c.decode(&mut buf).unwrap().as_ref() == Some(f)
                    && decode_client(&bytes[4..]).unwrap() == *f
            }
            Frame::Server(f) => {
                let mut c = ClientCodec::default();
                c.decode(&mut buf).unwrap().as_ref() == Some(f)
                    && decode_server(&bytes[4..]).unwrap() == *f
            }
        };
        ok && buf.is_empty()
    }

    fn check_json(&self, json: &str) -> bool {
        match self {
            Frame::Client(f) => serde_json::from_str::<ClientFrame>(json).unwrap() == *f,
            Frame::Server(f) => serde_json::from_str::<ServerFrame>(json).unwrap() == *f,
        }
    }
}

fn c(name: &'static str, description: &'static str, id: u64, request: Request) -> Sample {
    Sample {
        name,
        description,
        frame: Frame::Client(ClientFrame { id, request }),
    }
}

fn s(name: &'static str, description: &'static str, id: u64, reply: Reply) -> Sample {
    Sample {
        name,
        description,
        frame: Frame::Server(ServerFrame { id, reply }),
    }
}

fn err(kind: ErrorKind, message: &str) -> ErrorReply {
    ErrorReply {
        kind,
        message: message.into(),
        retry_after_s: 0.0,
        per_source_reasons: vec![],
        exhausted: None,
        scope: None,
    }
}

fn report(permit: u64, outcome: Outcome) -> Request {
    Request::Report { permit, outcome }
}

fn failure(kind: FailureKind) -> Request {
    report(11, Outcome::Failure { kind })
}

fn samples() -> Vec<Sample> {
    use ErrorKind as K;
    let status_full = StatusReport {
        sidecar_version: "0.1.0".into(),
        backend: "redis".into(),
        scopes: vec![
            ScopeStatus {
                name: "chat".into(),
                circuit_open: "wait".into(),
                quota_full: "fail_fast".into(),
                waiters: 2,
                calls: 5,
                sources: vec![
                    SourceStatus {
                        name: "openai-gpt4o-eu".into(),
                        state: BreakerState::Closed,
                        epoch: 4,
                        retry_after_s: 0.0,
                        cooldown_level: 0,
                        window_successes: 120,
                        window_failures: 3,
                        streak: 1,
                        memo_remaining_s: 0.0,
                        pacer_ceiling: 8.125,
                        in_flight: 3,
                        tokens_available: Some(-350.5),
                        requests_available: Some(499.75),
                        quota_blocked_s: 0.0,
                        degraded: false,
                    },
                    SourceStatus {
                        name: "azure-gpt4o-us".into(),
                        state: BreakerState::Open,
                        epoch: 17,
                        retry_after_s: 42.5,
                        cooldown_level: 2,
                        window_successes: 0,
                        window_failures: 20,
                        streak: 9,
                        memo_remaining_s: 42.5,
                        pacer_ceiling: 1.0,
                        in_flight: 0,
                        tokens_available: None,
                        requests_available: None,
                        quota_blocked_s: 12.25,
                        degraded: true,
                    },
                    SourceStatus {
                        name: "local-llama".into(),
                        state: BreakerState::HalfOpen,
                        epoch: u64::MAX,
                        retry_after_s: 0.0,
                        cooldown_level: 1,
                        window_successes: 1,
                        window_failures: 1,
                        streak: 0,
                        memo_remaining_s: 0.0,
                        pacer_ceiling: 64.0,
                        in_flight: 1,
                        tokens_available: Some(0.0),
                        requests_available: None,
                        quota_blocked_s: 0.0,
                        degraded: false,
                    },
                ],
            },
            ScopeStatus {
                name: "ocr".into(),
                circuit_open: "fail_fast".into(),
                quota_full: "wait".into(),
                waiters: 0,
                calls: 0,
                sources: vec![],
            },
        ],
    };

    vec![
        // ---- client → sidecar -------------------------------------------------
        c(
            "hello",
            "Hello: first frame of a connection",
            0,
            Request::Hello {
                protocol_version: 1,
                client_name: "polygate-python/0.1".into(),
                pid: 4242,
            },
        ),
        c(
            "begin_call_no_estimate",
            "BeginCall in scope chat without a token estimate (Option None)",
            1,
            Request::BeginCall {
                scope: "chat".into(),
                est_tokens: None,
            },
        ),
        c(
            "begin_call_with_estimate",
            "BeginCall in scope embedding with est_tokens 1200 (Option Some)",
            2,
            Request::BeginCall {
                scope: "embedding".into(),
                est_tokens: Some(1200),
            },
        ),
        c(
            "acquire",
            "Acquire a permit for call 7",
            3,
            Request::Acquire { call: 7 },
        ),
        c(
            "report_success_tokens",
            "Report Success with 1534 actual tokens, counted in the breaker window",
            4,
            report(
                11,
                Outcome::Success {
                    tokens: Some(1534),
                    count_attempt: true,
                },
            ),
        ),
        c(
            "report_success_uncounted",
            "Report Success without a token count, kept out of the breaker window",
            5,
            report(
                11,
                Outcome::Success {
                    tokens: None,
                    count_attempt: false,
                },
            ),
        ),
        c(
            "report_failure_timeout",
            "Report Failure kind Timeout",
            6,
            failure(FailureKind::Timeout),
        ),
        c(
            "report_failure_server_error",
            "Report Failure kind ServerError",
            7,
            failure(FailureKind::ServerError),
        ),
        c(
            "report_failure_connection",
            "Report Failure kind Connection",
            8,
            failure(FailureKind::Connection),
        ),
        c(
            "report_failure_bad_result",
            "Report Failure kind BadResult",
            9,
            failure(FailureKind::BadResult),
        ),
        c(
            "report_failure_error",
            "Report Failure kind Error",
            10,
            failure(FailureKind::Error),
        ),
        c(
            "report_rate_limited_with_retry_after",
            "Report RateLimited with the upstream's Retry-After of 2.5 s",
            11,
            report(
                11,
                Outcome::RateLimited {
                    retry_after_s: Some(2.5),
                },
            ),
        ),
        c(
            "report_rate_limited_without_retry_after",
            "Report RateLimited without a Retry-After",
            12,
            report(
                11,
                Outcome::RateLimited {
                    retry_after_s: None,
                },
            ),
        ),
        c(
            "report_cancelled",
            "Report Cancelled (the worker gave up)",
            13,
            report(11, Outcome::Cancelled),
        ),
        c("end_call", "EndCall for call 7", 14, Request::EndCall { call: 7 }),
        c("status", "Status request (unit variant)", 15, Request::Status),
        c(
            "force_open_fractional",
            "Admin ForceOpen of a source for 0.1 s (inexact binary fraction)",
            16,
            Request::ForceOpen {
                source: "openai-gpt4o-eu".into(),
                seconds: 0.1,
            },
        ),
        c(
            "force_close",
            "Admin ForceClose of a source",
            17,
            Request::ForceClose {
                source: "openai-gpt4o-eu".into(),
            },
        ),
        c(
            "reset_non_ascii",
            "Admin Reset of a source whose name is non-ASCII UTF-8 (length counts bytes)",
            18,
            Request::Reset {
                source: "quelle-äöü-東京-🚀".into(),
            },
        ),
        c(
            "ping_max_id",
            "Ping with the largest id, 2^64-1",
            u64::MAX,
            Request::Ping,
        ),
        c(
            "cancel",
            "Cancel the pending request with id 3",
            19,
            Request::Cancel { target: 3 },
        ),
        // ---- sidecar → client -------------------------------------------------
        s(
            "welcome",
            "Welcome: answer to Hello",
            0,
            Reply::Welcome {
                protocol_version: 1,
                sidecar_version: "0.1.0".into(),
                max_frame: 65536,
            },
        ),
        s(
            "call_begun",
            "CallBegun with call id 7",
            1,
            Reply::CallBegun { call: 7 },
        ),
        s(
            "granted",
            "Granted: permit 11 on a closed source, first attempt",
            3,
            Reply::Granted {
                permit: 11,
                source: "openai-gpt4o-eu".into(),
                is_probe: false,
                attempt: 1,
                est_tokens: 1200,
            },
        ),
        s(
            "granted_probe_large_ids",
            "Granted: half-open probe, third attempt, large ids",
            0x0123_4567_89ab_cdef,
            Reply::Granted {
                permit: u64::MAX - 1,
                source: "azure-gpt4o-us".into(),
                is_probe: true,
                attempt: 3,
                est_tokens: 1 << 40,
            },
        ),
        s(
            "reported_closed",
            "Reported: applied, breaker Closed, retry_after_s 0",
            4,
            Reply::Reported {
                applied: true,
                state: BreakerState::Closed,
                retry_after_s: 0.0,
            },
        ),
        s(
            "reported_open_fenced",
            "Reported: fenced out (applied false), breaker Open, retry in 41.5 s",
            6,
            Reply::Reported {
                applied: false,
                state: BreakerState::Open,
                retry_after_s: 41.5,
            },
        ),
        s(
            "reported_half_open",
            "Reported: applied, breaker HalfOpen",
            9,
            Reply::Reported {
                applied: true,
                state: BreakerState::HalfOpen,
                retry_after_s: 0.0,
            },
        ),
        s("ok", "Ok (unit variant)", 14, Reply::Ok),
        s("pong", "Pong (unit variant) for the largest id", u64::MAX, Reply::Pong),
        s(
            "status_empty",
            "Status newtype variant with no scopes (empty Vec)",
            15,
            Reply::Status(StatusReport {
                sidecar_version: "0.1.0".into(),
                backend: "memory".into(),
                scopes: vec![],
            }),
        ),
        s(
            "status_full",
            "Status with two scopes, every breaker state, Some/None quotas, negative and fractional f64",
            15,
            Reply::Status(status_full),
        ),
        s(
            "error_circuit_open",
            "Error CircuitOpen with per-source reasons, retry_after_s 12.75 and scope",
            3,
            Reply::Error(ErrorReply {
                kind: K::CircuitOpen,
                message: "every source of scope chat has an open circuit".into(),
                retry_after_s: 12.75,
                per_source_reasons: vec![
                    ("openai-gpt4o-eu".into(), SkipReason::CircuitOpen),
                    ("azure-gpt4o-us".into(), SkipReason::CircuitOpen),
                ],
                exhausted: None,
                scope: Some("chat".into()),
            }),
        ),
        s(
            "error_exhausted_stalled",
            "Error AllSourcesExhausted, reason Stalled, mixed skip reasons",
            3,
            Reply::Error(ErrorReply {
                kind: K::AllSourcesExhausted,
                message: "call stalled for more than 300s".into(),
                retry_after_s: 0.0,
                per_source_reasons: vec![
                    ("openai-gpt4o-eu".into(), SkipReason::RateLimited),
                    ("azure-gpt4o-us".into(), SkipReason::CircuitOpen),
                    ("local-llama".into(), SkipReason::Paced),
                ],
                exhausted: Some(ExhaustionReason::Stalled),
                scope: Some("chat".into()),
            }),
        ),
        s(
            "error_exhausted_quota",
            "Error AllSourcesExhausted, reason QuotaExhausted, backend-unavailable skip",
            3,
            Reply::Error(ErrorReply {
                kind: K::AllSourcesExhausted,
                message: "quota full and quota_full = fail_fast".into(),
                retry_after_s: 0.0,
                per_source_reasons: vec![("eu-ocr".into(), SkipReason::BackendUnavailable)],
                exhausted: Some(ExhaustionReason::QuotaExhausted),
                scope: Some("ocr".into()),
            }),
        ),
        s(
            "error_exhausted_retry",
            "Error AllSourcesExhausted, reason RetryExhausted, no skip reasons",
            3,
            Reply::Error(ErrorReply {
                kind: K::AllSourcesExhausted,
                message: "3 of max_attempts 3 used".into(),
                retry_after_s: 0.0,
                per_source_reasons: vec![],
                exhausted: Some(ExhaustionReason::RetryExhausted),
                scope: Some("chat".into()),
            }),
        ),
        s(
            "error_unknown_scope",
            "Error UnknownScope with a non-ASCII message",
            2,
            Reply::Error(ErrorReply {
                scope: Some("größe".into()),
                ..err(K::UnknownScope, "unknown scope \"größe\"")
            }),
        ),
        s(
            "error_unknown_call",
            "Error UnknownCall",
            3,
            Reply::Error(err(K::UnknownCall, "no call 7 on this connection")),
        ),
        s(
            "error_unknown_permit",
            "Error UnknownPermit",
            4,
            Reply::Error(err(K::UnknownPermit, "no permit 11 on this connection")),
        ),
        s(
            "error_invalid_argument",
            "Error InvalidArgument",
            16,
            Reply::Error(err(K::InvalidArgument, "seconds must be > 0")),
        ),
        s(
            "error_malformed_unknown_id",
            "Error Malformed with id 0 (the request id could not be read)",
            0,
            Reply::Error(err(K::Malformed, "cannot decode message")),
        ),
        s(
            "error_frame_too_large",
            "Error FrameTooLarge",
            0,
            Reply::Error(err(
                K::FrameTooLarge,
                "frame of 70000 bytes exceeds the maximum of 65536 bytes",
            )),
        ),
        s(
            "error_protocol_violation",
            "Error ProtocolViolation (version mismatch)",
            0,
            Reply::Error(err(
                K::ProtocolViolation,
                "protocol version 2 not supported; this sidecar speaks 1",
            )),
        ),
        s(
            "error_permission_denied",
            "Error PermissionDenied for an admin request",
            17,
            Reply::Error(err(K::PermissionDenied, "uid 1000 is not in admin_uids")),
        ),
        s(
            "error_shutting_down",
            "Error ShuttingDown",
            3,
            Reply::Error(err(K::ShuttingDown, "the sidecar is shutting down")),
        ),
        s(
            "error_backend_unavailable",
            "Error BackendUnavailable",
            3,
            Reply::Error(err(K::BackendUnavailable, "redis unreachable")),
        ),
        s(
            "error_cancelled",
            "Error Cancelled (answer to the Acquire a Cancel targeted)",
            3,
            Reply::Error(err(K::Cancelled, "cancelled by request 19")),
        ),
        s(
            "error_busy",
            "Error Busy (second Acquire while the call waits or holds a permit)",
            20,
            Reply::Error(err(K::Busy, "call 7 already has a pending Acquire")),
        ),
        s(
            "error_internal",
            "Error Internal with a negative retry_after_s (decoders must not reject it)",
            21,
            Reply::Error(ErrorReply {
                retry_after_s: -1.5,
                ..err(K::Internal, "bug")
            }),
        ),
        // ---- version 2 (DESIGN §11a): appended variants only --------------------
        c(
            "hello_v2",
            "Hello from a version-2 client",
            0,
            Request::Hello {
                protocol_version: 2,
                client_name: "polygate-node/0.2.0".into(),
                pid: 31337,
            },
        ),
        c(
            "start_minimal",
            "Start (tag 11) in scope chat with every optional field absent",
            1,
            Request::Start(CallSpec {
                scope: "chat".into(),
                est_tokens: None,
                priority: None,
                est_input_tokens: None,
                est_output_tokens: None,
            }),
        ),
        c(
            "start_full",
            "Start with an estimate, a priority class and the input/output split",
            2,
            Request::Start(CallSpec {
                scope: "chat".into(),
                est_tokens: Some(1200),
                priority: Some("interactive".into()),
                est_input_tokens: Some(900),
                est_output_tokens: Some(300),
            }),
        ),
        c(
            "begin_full",
            "Begin (tag 14): BeginCall with the version-2 fields, non-ASCII priority",
            3,
            Request::Begin(CallSpec {
                scope: "embedding".into(),
                est_tokens: None,
                priority: Some("batch-夜".into()),
                est_input_tokens: Some(512),
                est_output_tokens: None,
            }),
        ),
        c(
            "retry_failure_timeout",
            "Retry (tag 12): report a timeout on permit 11 and acquire the next permit",
            4,
            Request::Retry {
                permit: 11,
                outcome: Outcome::Failure {
                    kind: FailureKind::Timeout,
                },
            },
        ),
        c(
            "retry_rate_limited",
            "Retry after a 429 with Retry-After 2.5 s",
            5,
            Request::Retry {
                permit: 12,
                outcome: Outcome::RateLimited {
                    retry_after_s: Some(2.5),
                },
            },
        ),
        c(
            "retry_failure_usage",
            "Retry after a bad_result that still consumed tokens (FailureUsage, tag 5)",
            6,
            Request::Retry {
                permit: 13,
                outcome: Outcome::FailureUsage {
                    kind: FailureKind::BadResult,
                    usage: Usage {
                        tokens: Some(740),
                        input_tokens: None,
                        output_tokens: None,
                    },
                },
            },
        ),
        c(
            "finish_success",
            "Finish (tag 13): report a v1 Success with 1534 tokens and end the call",
            7,
            Request::Finish {
                permit: 11,
                outcome: Outcome::Success {
                    tokens: Some(1534),
                    count_attempt: true,
                },
            },
        ),
        c(
            "finish_success_usage",
            "Finish with SuccessUsage (tag 4): input/output split, no total",
            8,
            Request::Finish {
                permit: u64::MAX,
                outcome: Outcome::SuccessUsage {
                    usage: Usage {
                        tokens: None,
                        input_tokens: Some(1200),
                        output_tokens: Some(334),
                    },
                    count_attempt: true,
                },
            },
        ),
        c(
            "finish_cancelled",
            "Finish with Cancelled: nothing was sent, end the call",
            9,
            Request::Finish {
                permit: 14,
                outcome: Outcome::Cancelled,
            },
        ),
        c(
            "report_success_usage",
            "Report (v1 request) carrying a SuccessUsage outcome, uncounted",
            10,
            report(
                15,
                Outcome::SuccessUsage {
                    usage: Usage {
                        tokens: Some(2000),
                        input_tokens: Some(1500),
                        output_tokens: Some(500),
                    },
                    count_attempt: false,
                },
            ),
        ),
        c(
            "report_failure_usage_empty",
            "Report carrying FailureUsage with kind Error and no counts",
            11,
            report(
                16,
                Outcome::FailureUsage {
                    kind: FailureKind::Error,
                    usage: Usage::default(),
                },
            ),
        ),
        c(
            "status_json_request",
            "StatusJson request (tag 15, unit variant)",
            12,
            Request::StatusJson,
        ),
        // ---- DESIGN §18: observed limits (tags 16-18), appended variants only ----
        c(
            "finish_observed_openai",
            "FinishObserved (tag 18): a Success with OpenAI's headers (limit, remaining, reset of requests and tokens)",
            13,
            Request::FinishObserved {
                permit: 21,
                outcome: Outcome::Success {
                    tokens: Some(1534),
                    count_attempt: true,
                },
                limits: ObservedLimits {
                    requests: Some(ObservedLimit {
                        limit: Some(500),
                        remaining: Some(499),
                        reset_s: Some(0.12),
                    }),
                    tokens: Some(ObservedLimit {
                        limit: Some(30000),
                        remaining: Some(28466),
                        reset_s: Some(3.068),
                    }),
                    input_tokens: None,
                    output_tokens: None,
                    age_s: 0.0,
                },
            },
        ),
        c(
            "finish_observed_anthropic",
            "FinishObserved with a SuccessUsage and Anthropic's four dimensions, 1.5 s after the response (a stream)",
            14,
            Request::FinishObserved {
                permit: 22,
                outcome: Outcome::SuccessUsage {
                    usage: Usage {
                        tokens: None,
                        input_tokens: Some(1200),
                        output_tokens: Some(334),
                    },
                    count_attempt: true,
                },
                limits: ObservedLimits {
                    requests: Some(ObservedLimit {
                        limit: Some(50),
                        remaining: Some(49),
                        reset_s: Some(1.0),
                    }),
                    tokens: Some(ObservedLimit {
                        limit: Some(90000),
                        remaining: Some(88000),
                        reset_s: Some(2.0),
                    }),
                    input_tokens: Some(ObservedLimit {
                        limit: Some(50000),
                        remaining: Some(49000),
                        reset_s: Some(2.0),
                    }),
                    output_tokens: Some(ObservedLimit {
                        limit: Some(10000),
                        remaining: Some(10000),
                        reset_s: Some(0.5),
                    }),
                    age_s: 1.5,
                },
            },
        ),
        c(
            "retry_observed_rate_limited",
            "RetryObserved (tag 17): a 429 with Retry-After 2 s and no token left (remaining 0, reset 20 s)",
            15,
            Request::RetryObserved {
                permit: 23,
                outcome: Outcome::RateLimited {
                    retry_after_s: Some(2.0),
                },
                limits: ObservedLimits {
                    requests: None,
                    tokens: Some(ObservedLimit {
                        limit: Some(30000),
                        remaining: Some(0),
                        reset_s: Some(20.0),
                    }),
                    input_tokens: None,
                    output_tokens: None,
                    age_s: 0.0,
                },
            },
        ),
        c(
            "report_observed_azure",
            "ReportObserved (tag 16): a v1 Success with Azure's remaining-only headers",
            16,
            Request::ReportObserved {
                permit: 24,
                outcome: Outcome::Success {
                    tokens: None,
                    count_attempt: true,
                },
                limits: ObservedLimits {
                    requests: Some(ObservedLimit {
                        limit: None,
                        remaining: Some(99),
                        reset_s: None,
                    }),
                    tokens: Some(ObservedLimit {
                        limit: None,
                        remaining: Some(119000),
                        reset_s: None,
                    }),
                    input_tokens: None,
                    output_tokens: None,
                    age_s: 0.0,
                },
            },
        ),
        // ---- DESIGN §19: tenants (protocol 3), appended variants only ----
        c(
            "hello_v3",
            "Hello from a version-3 client (tenants)",
            0,
            Request::Hello {
                protocol_version: 3,
                client_name: "polygate-python/0.3.0".into(),
                pid: 4242,
            },
        ),
        c(
            "start_tenant",
            "StartTenant (tag 19): a Start charged to tenant \"acme\"",
            30,
            Request::StartTenant {
                spec: CallSpec {
                    scope: "chat".into(),
                    est_tokens: None,
                    priority: None,
                    est_input_tokens: Some(800),
                    est_output_tokens: Some(200),
                },
                tenant: "acme".into(),
            },
        ),
        c(
            "begin_tenant_unicode",
            "BeginTenant (tag 20) with a priority and a non-ASCII tenant id",
            31,
            Request::BeginTenant {
                spec: CallSpec {
                    scope: "chat".into(),
                    est_tokens: Some(1200),
                    priority: Some("interactive".into()),
                    est_input_tokens: None,
                    est_output_tokens: None,
                },
                tenant: "équipe-東京".into(),
            },
        ),
        c(
            "tenant_status_all_scopes",
            "TenantStatus (tag 21): one tenant in every scope with tenants",
            32,
            Request::TenantStatus {
                scope: None,
                tenant: "acme".into(),
            },
        ),
        c(
            "tenant_status_one_scope",
            "TenantStatus for the anonymous tenant (empty id) of scope chat",
            33,
            Request::TenantStatus {
                scope: Some("chat".into()),
                tenant: String::new(),
            },
        ),
        c(
            "finish_success_cached",
            "Finish with SuccessCached (outcome tag 6): usage plus 2,048 cached input reads",
            34,
            Request::Finish {
                permit: 40,
                outcome: Outcome::SuccessCached {
                    usage: Usage {
                        tokens: None,
                        input_tokens: Some(512),
                        output_tokens: Some(300),
                    },
                    cached_input_tokens: 2048,
                    count_attempt: true,
                },
            },
        ),
        s(
            "welcome_v3",
            "Welcome for a version-3 connection",
            0,
            Reply::Welcome {
                protocol_version: 3,
                sidecar_version: "0.3.0".into(),
                max_frame: 65536,
            },
        ),
        s(
            "tenant_limited_usd",
            "TenantLimited (reply tag 10, error kind 16): acme spent its usd_per_day; retry at the day's end",
            30,
            Reply::TenantLimited(TenantRefusal {
                error: ErrorReply {
                    kind: K::TenantLimited,
                    message: "tenant \"acme\" of scope \"chat\" is over its usd_per_day budget".into(),
                    retry_after_s: 5400.0,
                    per_source_reasons: vec![
                        ("openai-gpt4o-eu".into(), SkipReason::TenantLimited),
                        ("local-llama".into(), SkipReason::CircuitOpen),
                    ],
                    exhausted: None,
                    scope: Some("chat".into()),
                },
                tenant: "acme".into(),
                limit: "usd_per_day".into(),
            }),
        ),
        s(
            "welcome_v2",
            "Welcome for a version-2 connection",
            0,
            Reply::Welcome {
                protocol_version: 2,
                sidecar_version: "0.2.0".into(),
                max_frame: 65536,
            },
        ),
        s(
            "started",
            "Started (tag 8): the call and its first permit",
            2,
            Reply::Started {
                call: 7,
                permit: 11,
                source: "openai-gpt4o-eu".into(),
                is_probe: false,
                attempt: 1,
                est_tokens: 1200,
            },
        ),
        s(
            "started_probe_max_ids",
            "Started for a probe with the largest call and permit ids",
            3,
            Reply::Started {
                call: u64::MAX,
                permit: u64::MAX - 1,
                source: "東京".into(),
                is_probe: true,
                attempt: 2,
                est_tokens: 0,
            },
        ),
        s(
            "status_json",
            "StatusJson (tag 9): one UTF-8 JSON document",
            12,
            Reply::StatusJson(
                r#"{"sidecar_version":"0.2.0","backend":"memory","protocol_version":2,"scopes":[]}"#
                    .into(),
            ),
        ),
        s(
            "error_overloaded",
            "Error Overloaded (tag 15) at connect: too many connections (id 0, then closed)",
            0,
            Reply::Error(err(
                K::Overloaded,
                "too many connections (max_connections = 1024); retry later",
            )),
        ),
    ]
}

fn file_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bindings/vectors/frames.json")
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn build_file() -> File {
    File {
        protocol_version: PROTOCOL_VERSION,
        encoding: "bincode-legacy".into(),
        vectors: samples()
            .into_iter()
            .map(|s| Vector {
                name: s.name.into(),
                direction: s.frame.direction().into(),
                description: s.description.into(),
                value: RawValue::from_string(s.frame.json()).unwrap(),
                frame_hex: to_hex(&s.frame.frame_bytes()),
            })
            .collect(),
    }
}

#[test]
fn golden_vectors() {
    let path = file_path();
    if std::env::var_os("POLYGATE_REGEN_VECTORS").is_some_and(|v| v == "1") {
        let mut text = serde_json::to_string_pretty(&build_file()).unwrap();
        text.push('\n');
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        eprintln!("wrote {}", path.display());
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate with POLYGATE_REGEN_VECTORS=1)",
            path.display()
        )
    });
    let file: File = serde_json::from_str(&text).unwrap();
    assert_eq!(file.protocol_version, PROTOCOL_VERSION);
    assert_eq!(file.encoding, "bincode-legacy");

    let samples = samples();
    let sample_names: BTreeSet<_> = samples.iter().map(|s| s.name).collect();
    assert_eq!(sample_names.len(), samples.len(), "duplicate sample names");
    let file_names: BTreeSet<_> = file.vectors.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(
        file_names.len(),
        file.vectors.len(),
        "duplicate vector names"
    );
    assert_eq!(sample_names, file_names, "samples and file differ");

    for v in &file.vectors {
        let sample = samples.iter().find(|s| s.name == v.name).unwrap();
        let f = &sample.frame;
        assert_eq!(v.direction, f.direction(), "{}", v.name);
        assert!(!v.description.is_empty(), "{}", v.name);
        let bytes = from_hex(&v.frame_hex);
        assert_eq!(v.frame_hex, to_hex(&bytes), "{}: lowercase hex", v.name);
        // encode(value) == frame_hex
        assert_eq!(f.frame_bytes(), bytes, "{}: encoding", v.name);
        // the prefix is the payload length, big-endian
        let len = u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(len, bytes.len() - 4, "{}: length prefix", v.name);
        // decode(frame_hex) == value
        assert!(f.check_decodes(&bytes), "{}: decoding", v.name);
        // serde_json(value) == the file's value (as JSON values, not text)
        let ours: serde_json::Value = serde_json::from_str(&f.json()).unwrap();
        let theirs: serde_json::Value = serde_json::from_str(v.value.get()).unwrap();
        assert_eq!(ours, theirs, "{}: json value", v.name);
        assert!(f.check_json(v.value.get()), "{}: json decodes", v.name);
    }
}

/// The samples cover every variant of every enum on the wire.
#[test]
fn samples_cover_every_variant() {
    let mut seen = BTreeSet::new();
    let mut note = |s: String| {
        seen.insert(s);
    };
    for sample in samples() {
        match sample.frame {
            Frame::Client(f) => {
                let r = &f.request;
                note(format!("Request::{}", variant(r)));
                if let Request::Report { outcome, .. }
                | Request::Retry { outcome, .. }
                | Request::Finish { outcome, .. }
                | Request::ReportObserved { outcome, .. }
                | Request::RetryObserved { outcome, .. }
                | Request::FinishObserved { outcome, .. } = r
                {
                    note(format!("Outcome::{}", variant(outcome)));
                    if let Outcome::Failure { kind } = outcome {
                        note(format!("FailureKind::{kind:?}"));
                    }
                }
            }
            Frame::Server(f) => {
                note(format!("Reply::{}", variant(&f.reply)));
                match &f.reply {
                    Reply::Reported { state, .. } => note(format!("BreakerState::{state:?}")),
                    Reply::Status(st) => {
                        for sc in &st.scopes {
                            for so in &sc.sources {
                                note(format!("BreakerState::{:?}", so.state));
                            }
                        }
                    }
                    Reply::Error(e) | Reply::TenantLimited(TenantRefusal { error: e, .. }) => {
                        note(format!("ErrorKind::{:?}", e.kind));
                        for (_, r) in &e.per_source_reasons {
                            note(format!("SkipReason::{r:?}"));
                        }
                        if let Some(x) = e.exhausted {
                            note(format!("ExhaustionReason::{x:?}"));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    let expected = [
        "Request::Hello",
        "Request::BeginCall",
        "Request::Acquire",
        "Request::Report",
        "Request::EndCall",
        "Request::Status",
        "Request::ForceOpen",
        "Request::ForceClose",
        "Request::Reset",
        "Request::Ping",
        "Request::Cancel",
        "Request::Start",
        "Request::Retry",
        "Request::Finish",
        "Request::Begin",
        "Request::StatusJson",
        "Request::ReportObserved",
        "Request::RetryObserved",
        "Request::FinishObserved",
        "Request::StartTenant",
        "Request::BeginTenant",
        "Request::TenantStatus",
        "Outcome::SuccessCached",
        "Reply::TenantLimited",
        "ErrorKind::TenantLimited",
        "SkipReason::TenantLimited",
        "Outcome::SuccessUsage",
        "Outcome::FailureUsage",
        "Reply::Started",
        "Reply::StatusJson",
        "ErrorKind::Overloaded",
        "Outcome::Success",
        "Outcome::Failure",
        "Outcome::RateLimited",
        "Outcome::Cancelled",
        "FailureKind::Timeout",
        "FailureKind::ServerError",
        "FailureKind::Connection",
        "FailureKind::BadResult",
        "FailureKind::Error",
        "Reply::Welcome",
        "Reply::CallBegun",
        "Reply::Granted",
        "Reply::Reported",
        "Reply::Ok",
        "Reply::Status",
        "Reply::Pong",
        "Reply::Error",
        "BreakerState::Closed",
        "BreakerState::Open",
        "BreakerState::HalfOpen",
        "ErrorKind::CircuitOpen",
        "ErrorKind::AllSourcesExhausted",
        "ErrorKind::UnknownScope",
        "ErrorKind::UnknownCall",
        "ErrorKind::UnknownPermit",
        "ErrorKind::InvalidArgument",
        "ErrorKind::Malformed",
        "ErrorKind::FrameTooLarge",
        "ErrorKind::ProtocolViolation",
        "ErrorKind::PermissionDenied",
        "ErrorKind::ShuttingDown",
        "ErrorKind::BackendUnavailable",
        "ErrorKind::Cancelled",
        "ErrorKind::Busy",
        "ErrorKind::Internal",
        "SkipReason::CircuitOpen",
        "SkipReason::Paced",
        "SkipReason::RateLimited",
        "SkipReason::BackendUnavailable",
        "ExhaustionReason::Stalled",
        "ExhaustionReason::QuotaExhausted",
        "ExhaustionReason::RetryExhausted",
    ];
    let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    let missing: Vec<_> = expected.difference(&seen).collect();
    assert!(missing.is_empty(), "no vector for {missing:?}");
}

/// The variant name of an enum value, from its `Debug` form.
fn variant<T: std::fmt::Debug>(v: &T) -> String {
    let d = format!("{v:?}");
    d.split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap()
        .to_string()
}
