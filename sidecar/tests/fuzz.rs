//! The fuzz pass (DESIGN §12 "Bounded under abuse", issue 10): structure-aware
//! mutations of the golden vectors (`bindings/vectors/frames.json`) sent to the real
//! `polygate-sidecar` binary from many connections at once, while a well-behaved
//! client keeps making calls on a scope the fuzzers cannot name.
//!
//! Mutations, from a seeded PRNG (stable toolchain, no `cargo fuzz` needed):
//! - *semantic*: a vector's request decoded and its fields replaced — ids and counts
//!   by 0 / `u64::MAX` / 2^63 / ids the sidecar handed out earlier on the connection,
//!   seconds by NaN / ±∞ / −0 / 1e308 / just below 2^64 / the caps ± a little,
//!   strings by empty / 60 KB / multibyte-at-the-echo-bound / control characters,
//!   options toggled, whole requests swapped — then encoded correctly;
//! - *bytes*: flips, random bytes, truncation, extension, splices of two vectors'
//!   payloads, changed enum tags, absurd string/list lengths, NaN/∞ bit patterns,
//!   invalid UTF-8, bad `bool`/`Option` bytes;
//! - *framing*: length prefixes of 0, `u32::MAX`, over `max_frame`, a few bytes short
//!   or long (a partial frame), and connections that end mid-frame, never send
//!   `Hello`, send a bad one, or stop reading their replies.
//!
//! Asserted: the daemon never panics and never exits, every fuzz connection ends
//! within a generous bound (no hang), every frame the sidecar sends decodes (it never
//! sends what a client may reject), its RSS stays within a generous margin of its
//! baseline, its fds come back once the connections are gone, the well-behaved client
//! never sees an error or a stall, and SIGTERM still ends it cleanly.
//!
//! Length: `POLYGATE_FUZZ_SECS` (default 20); seed: `POLYGATE_FUZZ_SEED` (default
//! from the clock, printed). A long run: `POLYGATE_FUZZ_SECS=1800 cargo test --release
//! -p polygate-sidecar --test fuzz -- --nocapture`.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use ipc_protocol::{
    codec, CallSpec, ClientCodec, ClientFrame, FailureKind, FrameError, Outcome, Reply, Request,
    Usage,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::daemon::{Client, Daemon};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio_util::codec::FramedRead;

/// Default length of the pass, in seconds.
const DEFAULT_SECS: u64 = 20;
/// Concurrent fuzzing connections (each one connection at a time, back to back).
const WORKERS: usize = 12;
/// The daemon's `max_frame`.
const MAX_FRAME: usize = 65536;
/// Longest any one fuzz connection may take before it counts as a hang.
const CONN_BOUND: Duration = Duration::from_secs(30);
/// Longest one call of the well-behaved client may take before it counts as a stall.
const CALL_BOUND: Duration = Duration::from_secs(15);
/// RSS growth over the baseline that fails the pass (generous: the point is "bounded").
const RSS_MARGIN_KIB: u64 = 256 * 1024;

/// `fuzz` scopes use the names in the vectors; `good` is the well-behaved client's.
const SCOPES: &str = r#"
[scopes.chat]
circuit_open = "wait"
quota_full = "wait"
poll_interval = "20ms"
stall_window = "2s"
[scopes.chat.breaker]
failure_threshold = 3
cooldown = "200ms"
max_cooldown = "1s"
[[scopes.chat.sources]]
name = "openai-gpt4o-eu"
tpm = 60000
rpm = 600
timeout = "2s"
[[scopes.chat.sources]]
name = "azure-gpt4o-us"
timeout = "2s"

[scopes.ocr]
circuit_open = "fail_fast"
quota_full = "fail_fast"
[[scopes.ocr.sources]]
name = "eu-ocr"
rpm = 100
timeout = "1s"

[scopes.good]
[scopes.good.pacer]
initial = 1000.0
max = 1000.0
[[scopes.good.sources]]
name = "good-src"
"#;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Frames of the golden vectors: the client requests (decoded) and every payload
/// (both directions, for splicing).
struct Corpus {
    requests: Vec<ClientFrame>,
    payloads: Vec<Vec<u8>>,
    /// Strings that name things the sidecar knows, plus the vectors' own.
    names: Vec<String>,
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn corpus() -> Corpus {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bindings/vectors/frames.json");
    let text = std::fs::read_to_string(&path).expect("read the golden vectors");
    let file: serde_json::Value = serde_json::from_str(&text).expect("vectors JSON");
    let mut c = Corpus {
        requests: Vec::new(),
        payloads: Vec::new(),
        names: ["chat", "ocr", "openai-gpt4o-eu", "azure-gpt4o-us", "eu-ocr"]
            .map(String::from)
            .to_vec(),
    };
    for v in file["vectors"].as_array().expect("vectors") {
        let frame = unhex(v["frame_hex"].as_str().expect("frame_hex"));
        let payload = frame[4..].to_vec();
        if v["direction"] == "client" {
            let f = codec::decode_client(&payload).expect("a client vector decodes");
            if let Request::Reset { source } = &f.request {
                c.names.push(source.clone());
            }
            c.requests.push(f);
        }
        c.payloads.push(payload);
    }
    assert!(c.requests.len() > 20, "the vectors cover every request");
    c
}

// ---- semantic mutations ------------------------------------------------------------

/// The largest f64 below 2^64: a valid `Duration` whose deadline arithmetic overflowed.
const HUGE_SECONDS: f64 = 18_446_744_073_709_549_568.0;

fn pick_u64(rng: &mut StdRng, learned: &[u64]) -> u64 {
    match rng.random_range(0..10) {
        0 => 0,
        1 => u64::MAX,
        2 => 1 << 63,
        3 => rng.random(),
        4 => 1_000_000_001,
        5..=7 if !learned.is_empty() => learned[rng.random_range(0..learned.len())],
        _ => rng.random_range(0..5_000),
    }
}

fn pick_f64(rng: &mut StdRng) -> f64 {
    const SPECIAL: [f64; 16] = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -0.0,
        0.0,
        -1.0,
        5e-324,
        1e308,
        f64::MAX,
        HUGE_SECONDS,
        86_400.0,
        86_400.001,
        31_536_000.0,
        31_536_000.5,
        0.001,
        2.5,
    ];
    match rng.random_range(0..4) {
        0 => f64::from_bits(rng.random()),
        1 => rng.random_range(0.0..100.0),
        _ => SPECIAL[rng.random_range(0..SPECIAL.len())],
    }
}

fn pick_string(rng: &mut StdRng, names: &[String]) -> String {
    match rng.random_range(0..10) {
        0 => String::new(),
        1 => "x".repeat(rng.random_range(1_000..60_000)),
        // Multibyte characters across the 128-byte echo bound.
        2 => format!(
            "{}{}",
            "a".repeat(rng.random_range(120..130)),
            "東京🚀".repeat(20)
        ),
        3 => "\0\u{7}\u{1b}[31m\r\n%s%n{}".into(),
        4 => "ä".repeat(rng.random_range(1..40_000)),
        5 => (0..rng.random_range(1..64))
            .map(|_| char::from(rng.random_range(b' '..b'~')))
            .collect(),
        _ => names[rng.random_range(0..names.len())].clone(),
    }
}

fn maybe<T>(rng: &mut StdRng, f: impl FnOnce(&mut StdRng) -> T) -> Option<T> {
    rng.random_bool(0.6).then(|| f(rng))
}

fn pick_outcome(rng: &mut StdRng, learned: &[u64]) -> Outcome {
    let kind = |rng: &mut StdRng| match rng.random_range(0..5) {
        0 => FailureKind::Timeout,
        1 => FailureKind::ServerError,
        2 => FailureKind::Connection,
        3 => FailureKind::BadResult,
        _ => FailureKind::Error,
    };
    let usage = |rng: &mut StdRng| Usage {
        tokens: maybe(rng, |r| pick_u64(r, learned)),
        input_tokens: maybe(rng, |r| pick_u64(r, learned)),
        output_tokens: maybe(rng, |r| pick_u64(r, learned)),
    };
    match rng.random_range(0..6) {
        0 => Outcome::Success {
            tokens: maybe(rng, |r| pick_u64(r, learned)),
            count_attempt: rng.random(),
        },
        1 => Outcome::Failure { kind: kind(rng) },
        2 => Outcome::RateLimited {
            retry_after_s: maybe(rng, pick_f64),
        },
        3 => Outcome::Cancelled,
        4 => Outcome::SuccessUsage {
            usage: usage(rng),
            count_attempt: rng.random(),
        },
        _ => Outcome::FailureUsage {
            kind: kind(rng),
            usage: usage(rng),
        },
    }
}

fn pick_spec(rng: &mut StdRng, c: &Corpus, learned: &[u64]) -> CallSpec {
    CallSpec {
        scope: pick_string(rng, &c.names),
        est_tokens: maybe(rng, |r| pick_u64(r, learned)),
        priority: rng.random_bool(0.2).then(|| pick_string(rng, &c.names)),
        est_input_tokens: maybe(rng, |r| pick_u64(r, learned)),
        est_output_tokens: maybe(rng, |r| pick_u64(r, learned)),
    }
}

/// A request of the same shape as `r`, its fields replaced at random; sometimes a
/// different request altogether.
fn mutate(r: &Request, rng: &mut StdRng, c: &Corpus, learned: &[u64]) -> Request {
    let base = if rng.random_bool(0.15) {
        c.requests[rng.random_range(0..c.requests.len())]
            .request
            .clone()
    } else {
        r.clone()
    };
    let u = |rng: &mut StdRng| pick_u64(rng, learned);
    match base {
        Request::Hello { .. } => Request::Hello {
            protocol_version: match rng.random_range(0..5) {
                0 => 1,
                1 => 2,
                2 => 0,
                3 => 3,
                _ => rng.random(),
            },
            client_name: pick_string(rng, &c.names),
            pid: rng.random(),
        },
        Request::BeginCall { .. } => Request::BeginCall {
            scope: pick_string(rng, &c.names),
            est_tokens: maybe(rng, u),
        },
        Request::Acquire { .. } => Request::Acquire { call: u(rng) },
        Request::Report { .. } => Request::Report {
            permit: u(rng),
            outcome: pick_outcome(rng, learned),
        },
        Request::EndCall { .. } => Request::EndCall { call: u(rng) },
        Request::ForceOpen { .. } => Request::ForceOpen {
            source: pick_string(rng, &c.names),
            // Keep real opens short so the fuzz scopes keep admitting.
            seconds: if rng.random_bool(0.3) {
                0.05
            } else {
                pick_f64(rng)
            },
        },
        Request::ForceClose { .. } => Request::ForceClose {
            source: pick_string(rng, &c.names),
        },
        Request::Reset { .. } => Request::Reset {
            source: pick_string(rng, &c.names),
        },
        Request::Cancel { .. } => Request::Cancel { target: u(rng) },
        Request::Start(_) => Request::Start(pick_spec(rng, c, learned)),
        Request::Begin(_) => Request::Begin(pick_spec(rng, c, learned)),
        Request::Retry { .. } => Request::Retry {
            permit: u(rng),
            outcome: pick_outcome(rng, learned),
        },
        Request::Finish { .. } => Request::Finish {
            permit: u(rng),
            outcome: pick_outcome(rng, learned),
        },
        Request::ReportObserved { .. } => Request::ReportObserved {
            permit: u(rng),
            outcome: pick_outcome(rng, learned),
            limits: pick_limits(rng, learned),
        },
        Request::RetryObserved { .. } => Request::RetryObserved {
            permit: u(rng),
            outcome: pick_outcome(rng, learned),
            limits: pick_limits(rng, learned),
        },
        Request::FinishObserved { .. } => Request::FinishObserved {
            permit: u(rng),
            outcome: pick_outcome(rng, learned),
            limits: pick_limits(rng, learned),
        },
        Request::StartTenant { .. } => Request::StartTenant {
            spec: pick_spec(rng, c, learned),
            tenant: pick_string(rng, &c.names),
        },
        Request::BeginTenant { .. } => Request::BeginTenant {
            spec: pick_spec(rng, c, learned),
            tenant: pick_string(rng, &c.names),
        },
        Request::TenantStatus { .. } => Request::TenantStatus {
            scope: rng.random_bool(0.5).then(|| pick_string(rng, &c.names)),
            tenant: pick_string(rng, &c.names),
        },
        other @ (Request::Status | Request::Ping | Request::StatusJson) => other,
    }
}

/// §18 observed limits with every part at random (absent, edge or learned values).
fn pick_limits(rng: &mut StdRng, learned: &[u64]) -> ipc_protocol::ObservedLimits {
    let dim = |rng: &mut StdRng| {
        maybe(rng, |r| ipc_protocol::ObservedLimit {
            limit: maybe(r, |r| pick_u64(r, learned)),
            remaining: maybe(r, |r| pick_u64(r, learned)),
            reset_s: maybe(r, pick_f64),
        })
    };
    ipc_protocol::ObservedLimits {
        requests: dim(rng),
        tokens: dim(rng),
        input_tokens: dim(rng),
        output_tokens: dim(rng),
        age_s: pick_f64(rng),
    }
}

// ---- byte mutations ----------------------------------------------------------------

fn put(p: &mut [u8], at: usize, bytes: &[u8]) {
    if at + bytes.len() <= p.len() {
        p[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

fn byte_mutate(p: &mut Vec<u8>, rng: &mut StdRng, c: &Corpus) {
    for _ in 0..rng.random_range(1..4) {
        let len = p.len().max(1);
        let at = rng.random_range(0..len);
        // A position inside the payload (when it has any).
        let inside = at.min(p.len().saturating_sub(1));
        match rng.random_range(0..11) {
            0 if !p.is_empty() => p[inside] ^= 1 << rng.random_range(0..8),
            1 if !p.is_empty() => p[inside] = rng.random(),
            2 => p.truncate(at),
            3 => p.extend((0..rng.random_range(1..32)).map(|_| rng.random::<u8>())),
            4 => {
                let other = &c.payloads[rng.random_range(0..c.payloads.len())];
                let from = rng.random_range(0..other.len().max(1));
                p.truncate(at);
                p.extend_from_slice(other.get(from..).unwrap_or_default());
            }
            // The request tag, right after the 8-byte id.
            5 => {
                let tag: u32 = match rng.random_range(0..3) {
                    0 => rng.random_range(0..24),
                    1 => u32::MAX,
                    _ => rng.random(),
                };
                put(p, 8, &tag.to_le_bytes());
            }
            // An absurd string / list length wherever a u64 may sit.
            6 => {
                let n: u64 = [u64::MAX, 1 << 63, p.len() as u64 + 1, 0x7fff_ffff, 1 << 40]
                    [rng.random_range(0..5)];
                put(p, at, &n.to_le_bytes());
            }
            // NaN / ∞ bit patterns wherever an f64 may sit.
            7 => {
                let f = [
                    f64::NAN,
                    f64::INFINITY,
                    f64::NEG_INFINITY,
                    HUGE_SECONDS,
                    -1.0,
                ][rng.random_range(0..5)];
                put(p, at, &f.to_le_bytes());
            }
            // Invalid UTF-8: a lone continuation, a bad pair, a surrogate, an overlong.
            8 => {
                let bad: &[u8] = [
                    &[0xff][..],
                    &[0xc3, 0x28],
                    &[0xed, 0xa0, 0x80],
                    &[0xc0, 0xaf],
                ][rng.random_range(0..4)];
                let at = at.min(p.len());
                p.splice(at..at, bad.iter().copied());
            }
            // A bool / Option byte that is neither 0 nor 1.
            9 if !p.is_empty() => p[inside] = rng.random_range(2..=255),
            _ => p.clear(),
        }
    }
}

/// One frame: the payload behind its length prefix, the prefix sometimes a lie.
/// Returns the bytes and whether the prefix promises more than is sent (a partial
/// frame the connection must end after).
fn frame(payload: &[u8], rng: &mut StdRng, lies: bool) -> (Vec<u8>, bool) {
    let honest = payload.len() as u32;
    let pick = if lies { rng.random_range(0..40) } else { 40 };
    let (prefix, partial) = match pick {
        0 => (u32::MAX, false),
        1 => (MAX_FRAME as u32 + 1, false),
        2 => (0, false),
        3 => (honest.saturating_sub(rng.random_range(1..8)), false),
        4 => (honest + rng.random_range(1..64), true),
        _ => (honest, false),
    };
    let mut out = prefix.to_be_bytes().to_vec();
    out.extend_from_slice(payload);
    (out, partial)
}

// ---- one fuzz connection -------------------------------------------------------------

#[derive(Default)]
struct Stats {
    connections: AtomicU64,
    connect_failures: AtomicU64,
    frames: AtomicU64,
    replies: AtomicU64,
    /// Frames from the sidecar a client could not decode.
    bad_replies: AtomicU64,
    hung: AtomicU64,
    first_bad_reply: Mutex<Option<String>>,
}

/// Drain the sidecar's replies, learning the call and permit ids it hands out.
async fn read_replies(
    read: tokio::net::unix::OwnedReadHalf,
    learned: Arc<Mutex<Vec<u64>>>,
    stats: Arc<Stats>,
) {
    let mut frames = FramedRead::new(read, ClientCodec::new(codec::DECODE_LIMIT));
    while let Some(f) = frames.next().await {
        match f {
            Ok(f) => {
                stats.replies.fetch_add(1, Ordering::Relaxed);
                let ids: &[u64] = match f.reply {
                    Reply::CallBegun { call } => &[call],
                    Reply::Granted { permit, .. } => &[permit],
                    Reply::Started { call, permit, .. } => &[call, permit],
                    _ => &[],
                };
                let mut l = learned.lock().unwrap();
                l.extend_from_slice(ids);
                let n = l.len();
                if n > 64 {
                    l.drain(..n - 64);
                }
            }
            Err(FrameError::Io(_)) => return,
            Err(e) => {
                stats.bad_replies.fetch_add(1, Ordering::Relaxed);
                stats
                    .first_bad_reply
                    .lock()
                    .unwrap()
                    .get_or_insert_with(|| e.to_string());
                return;
            }
        }
    }
}

async fn fuzz_connection(path: &Path, rng: &mut StdRng, c: &Corpus, stats: &Arc<Stats>) {
    let Ok(stream) = UnixStream::connect(path).await else {
        stats.connect_failures.fetch_add(1, Ordering::Relaxed);
        return;
    };
    stats.connections.fetch_add(1, Ordering::Relaxed);
    let (read, mut write) = stream.into_split();
    let learned = Arc::new(Mutex::new(Vec::new()));
    let reads = rng.random_bool(0.85);
    // Half the connections send only well-framed, decodable (if hostile) requests, so
    // they get deep into call state; the other half also break bytes and framing.
    let noisy = rng.random_bool(0.5);
    let mut unread = None;
    let reader = if reads {
        Some(tokio::spawn(read_replies(
            read,
            learned.clone(),
            stats.clone(),
        )))
    } else {
        unread = Some(read);
        None
    };
    // The handshake: mostly right, sometimes absent or wrong.
    let hello = match rng.random_range(0..10) {
        0 => None,
        1 => Some(1),
        9 => Some(rng.random()),
        _ => Some(2),
    };
    let mut bytes = Vec::new();
    if let Some(v) = hello {
        let f = ClientFrame {
            id: rng.random_range(0..3),
            request: support::daemon::hello(v),
        };
        bytes = frame(&codec::encode_client(&f).unwrap(), rng, false).0;
    }
    let n = if reads {
        rng.random_range(1..60)
    } else {
        rng.random_range(1..20)
    };
    let mut partial = false;
    for _ in 0..n {
        let seed = &c.requests[rng.random_range(0..c.requests.len())];
        let ids: Vec<u64> = learned.lock().unwrap().clone();
        let request = if rng.random_bool(0.7) {
            mutate(&seed.request, rng, c, &ids)
        } else {
            seed.request.clone()
        };
        let id = if rng.random_bool(0.2) {
            pick_u64(rng, &ids)
        } else {
            rng.random_range(1..50)
        };
        let Ok(mut payload) = codec::encode_client(&ClientFrame { id, request }) else {
            continue;
        };
        if payload.len() > MAX_FRAME && rng.random_bool(0.8) {
            payload.truncate(MAX_FRAME);
        }
        if noisy && rng.random_bool(0.35) {
            byte_mutate(&mut payload, rng, c);
        }
        let (f, p) = frame(&payload, rng, noisy);
        bytes.extend_from_slice(&f);
        stats.frames.fetch_add(1, Ordering::Relaxed);
        if p {
            partial = true;
            break;
        }
        // Sometimes in one write, sometimes frame by frame.
        if rng.random_bool(0.5) {
            let w = tokio::time::timeout(Duration::from_secs(2), write.write_all(&bytes)).await;
            bytes.clear();
            if !matches!(w, Ok(Ok(()))) {
                break; // closed by the sidecar, or it stopped reading us
            }
            if rng.random_bool(0.1) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..20))).await;
            }
        }
    }
    if !bytes.is_empty() {
        let _ = tokio::time::timeout(Duration::from_secs(2), write.write_all(&bytes)).await;
    }
    match rng.random_range(0..10) {
        // End in the middle of a frame.
        0 if !partial => {
            let _ = write.write_all(&[0, 0, 1]).await;
        }
        // Leave it open a moment without writing (idle, possibly unread).
        1 => tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await,
        _ => {}
    }
    let _ = write.shutdown().await;
    drop(write);
    drop(unread);
    if let Some(r) = reader {
        // The sidecar closes once our requests are answered; a reader still waiting
        // for its close after the bound means a hang.
        if tokio::time::timeout(CONN_BOUND, r).await.is_err() {
            stats.hung.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// ---- the well-behaved client ---------------------------------------------------------

#[derive(Default)]
struct Good {
    calls: AtomicU64,
    errors: Mutex<Vec<String>>,
    slowest: Mutex<Duration>,
}

async fn good_client(path: PathBuf, stop: Arc<AtomicBool>, good: Arc<Good>) {
    let mut c = Client::connect(&path, 2).await;
    let spec = CallSpec {
        scope: "good".into(),
        est_tokens: Some(10),
        priority: None,
        est_input_tokens: None,
        est_output_tokens: None,
    };
    let mut n: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let began = Instant::now();
        let step = async {
            let permit = match c.call(Request::Start(spec.clone())).await {
                Reply::Started { permit, .. } => permit,
                other => return Err(format!("Start: {other:?}")),
            };
            let finish = Request::Finish {
                permit,
                outcome: Outcome::Success {
                    tokens: Some(10),
                    count_attempt: true,
                },
            };
            match c.call(finish).await {
                Reply::Reported { .. } => {}
                other => return Err(format!("Finish: {other:?}")),
            }
            if n.is_multiple_of(10) {
                match c.call(Request::StatusJson).await {
                    Reply::StatusJson(_) => {}
                    other => return Err(format!("StatusJson: {other:?}")),
                }
                match c.call(Request::Ping).await {
                    Reply::Pong => {}
                    other => return Err(format!("Ping: {other:?}")),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(CALL_BOUND, step).await {
            Ok(Ok(())) => {
                good.calls.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(e)) => good.errors.lock().unwrap().push(e),
            Err(_) => good
                .errors
                .lock()
                .unwrap()
                .push(format!("call {n} stalled past {CALL_BOUND:?}")),
        }
        let took = began.elapsed();
        {
            let mut s = good.slowest.lock().unwrap();
            *s = (*s).max(took);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---- the pass --------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fuzzed_frames_from_many_connections_leave_the_sidecar_serving() {
    let secs = env_u64("POLYGATE_FUZZ_SECS").unwrap_or(DEFAULT_SECS);
    let seed = env_u64("POLYGATE_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    eprintln!("fuzz: {secs} s, seed {seed} (POLYGATE_FUZZ_SECS, POLYGATE_FUZZ_SEED)");
    let me = nix::unistd::getuid().as_raw();
    let mut daemon = Daemon::start(
        &format!("admin_uids = [{me}]\nmax_frame = {MAX_FRAME}"),
        SCOPES,
        &[],
    );
    let overall = Duration::from_secs(secs) + CONN_BOUND + Duration::from_secs(60);
    let corpus = Arc::new(corpus());
    let path = daemon.socket.clone();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let base_rss = daemon.rss_kib();
    let base_fds = daemon.fds();

    let run = async {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Stats::default());
        let good = Arc::new(Good::default());
        let good_task = tokio::spawn(good_client(path.clone(), stop.clone(), good.clone()));
        let deadline = Instant::now() + Duration::from_secs(secs);
        let workers: Vec<_> = (0..WORKERS)
            .map(|w| {
                let (path, corpus, stats) = (path.clone(), corpus.clone(), stats.clone());
                tokio::spawn(async move {
                    let mut rng = StdRng::seed_from_u64(seed ^ (w as u64).wrapping_mul(0x9e37));
                    while Instant::now() < deadline {
                        fuzz_connection(&path, &mut rng, &corpus, &stats).await;
                    }
                })
            })
            .collect();
        let mut peak_rss = base_rss;
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(250)).await;
            peak_rss = peak_rss.max(daemon.rss_kib());
        }
        for w in workers {
            w.await.expect("a fuzz worker panicked");
        }
        stop.store(true, Ordering::Relaxed);
        good_task.await.expect("the good client panicked");
        (stats, good, peak_rss)
    };
    let (stats, good, peak_rss) = tokio::time::timeout(overall, run)
        .await
        .expect("the fuzz pass hung");

    let calls = good.calls.load(Ordering::Relaxed);
    eprintln!(
        "fuzz: {} connections ({} refused), {} frames sent, {} replies; RSS {} → peak {} KiB; \
         good client: {calls} calls, slowest {:?}",
        stats.connections.load(Ordering::Relaxed),
        stats.connect_failures.load(Ordering::Relaxed),
        stats.frames.load(Ordering::Relaxed),
        stats.replies.load(Ordering::Relaxed),
        base_rss,
        peak_rss,
        *good.slowest.lock().unwrap(),
    );
    assert!(
        daemon.alive(),
        "the sidecar exited: {}",
        tail(&daemon.log_text())
    );
    let log = daemon.log_text();
    assert!(!log.contains("panicked"), "a panic: {}", tail(&log));
    assert_eq!(stats.hung.load(Ordering::Relaxed), 0, "connections hung");
    assert_eq!(
        stats.bad_replies.load(Ordering::Relaxed),
        0,
        "the sidecar sent frames a client cannot decode: {:?}",
        stats.first_bad_reply.lock().unwrap()
    );
    assert!(
        stats.connections.load(Ordering::Relaxed) > WORKERS as u64,
        "the fuzzers connected"
    );
    let errors = good.errors.lock().unwrap().clone();
    assert!(
        errors.is_empty(),
        "the well-behaved client was affected: {errors:?}"
    );
    assert!(
        calls >= 10,
        "the well-behaved client made only {calls} calls"
    );
    assert!(
        peak_rss < base_rss + RSS_MARGIN_KIB,
        "RSS grew from {base_rss} to {peak_rss} KiB"
    );
    // Every fuzz connection is gone: the fds come back.
    let fd_deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let fds = daemon.fds();
        if fds <= base_fds + 2 {
            break;
        }
        assert!(
            Instant::now() < fd_deadline,
            "fds: {base_fds} at start, {fds} after every connection closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = daemon.stop();
    assert!(status.success(), "SIGTERM after the pass: {status:?}");
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
