//! The admin listener (`/live`, `/ready`, `/metrics`) and the OpenMetrics exposition:
//! routes, a strict parse of every scrape, histograms that move with traffic, probes
//! that idle connections cannot lock out, and scrapes that cost a remote backend
//! nothing.

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{ClientCodec, ClientFrame, Reply, Request, PROTOCOL_VERSION};
use polygate::admin_http::{serve_with, AdminOptions};
use polygate::backend::memory::MemoryBackend;
use polygate::backend::{FailureKind, Outcome};
use polygate::clock::{Clock, TokioClock};
use polygate::engine::Engine;
use polygate::metrics::{self, Exposition, ServerMetrics, SharedView};
use polygate::peer::AccessPolicy;
use polygate::server::{self, ServerOptions};
use support::engine_cfg::*;
use support::test_backend::TestBackend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

/// Every test here ends well within this.
const LIMIT: Duration = Duration::from_secs(20);

/// One request on a fresh connection (`Connection: close`): status, headers, body.
async fn get_full(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .expect("response within 5 s")
        .unwrap();
    let code = out[9..12].parse().unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (code, head.to_string(), body.to_string())
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let (code, _, body) = get_full(addr, "GET", path).await;
    (code, body)
}

fn exposition(e: &Arc<Engine<MemoryBackend>>) -> Exposition<MemoryBackend> {
    Exposition {
        engine: e.clone(),
        server: Arc::default(),
        shared: None,
    }
}

/// A running admin listener on 127.0.0.1: its address, and how to stop it.
struct Admin {
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Admin {
    async fn start(exp: Exposition<MemoryBackend>, opts: AdminOptions) -> Admin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve_with(listener, exp, opts, async {
            let _ = stopped.await;
        }));
        Admin { addr, stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

// ---------------------------------------------------------------------------------
// A strict OpenMetrics text parser (the subset the spec allows for our types).

/// One parsed sample.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// One parsed family.
#[derive(Debug, Default)]
struct Family {
    ty: String,
    unit: Option<String>,
    samples: Vec<Sample>,
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `{k="v",…}` → map; `rest` starts after `{`. Returns the labels and what follows `}`.
fn parse_labels(mut rest: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let key = &rest[..eq];
        if !valid_name(key) || key.contains(':') {
            return Err(format!("bad label name {key:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().ok_or("unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, '\n') => return Err("raw newline in label value".into()),
                (_, c) => value.push(c),
            }
        };
        if labels.insert(key.to_string(), value).is_some() {
            return Err(format!("label {key} repeated"));
        }
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err("expected , or } after a label".into());
        }
    }
}

fn parse_value(v: &str) -> Result<f64, String> {
    match v {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => v.parse::<f64>().map_err(|_| format!("bad value {v:?}")),
    }
}

/// Parse `text` strictly: descriptors before samples, each family contiguous and
/// declared once, sample names with the suffixes their type allows, well-formed
/// labels and values, histogram buckets cumulative and ending in `+Inf` = `_count`,
/// and `# EOF` as the last line. Returns the families by name.
fn parse_openmetrics(text: &str) -> Result<HashMap<String, Family>, String> {
    let mut families: HashMap<String, Family> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut current: Option<String> = None;
    let mut lines = text.split('\n').collect::<Vec<_>>();
    if lines.pop() != Some("") {
        return Err("the exposition must end with a newline".into());
    }
    if lines.pop() != Some("# EOF") {
        return Err("the last line must be # EOF".into());
    }
    for (n, line) in lines.iter().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let arg = parts.next().unwrap_or("");
            if !valid_name(name) {
                return Err(at(format!("bad family name {name:?}")));
            }
            if current.as_deref() != Some(name) {
                if families.contains_key(name) {
                    return Err(at(format!("family {name} declared twice")));
                }
                families.insert(name.to_string(), Family::default());
                order.push(name.to_string());
                current = Some(name.to_string());
            }
            let f = families.get_mut(name).unwrap();
            if !f.samples.is_empty() {
                return Err(at("descriptor after samples".into()));
            }
            match kind {
                "HELP" => {}
                "TYPE" => {
                    let ok = [
                        "counter",
                        "gauge",
                        "histogram",
                        "info",
                        "stateset",
                        "summary",
                        "gaugehistogram",
                        "unknown",
                    ];
                    if !ok.contains(&arg) {
                        return Err(at(format!("bad type {arg:?}")));
                    }
                    f.ty = arg.to_string();
                }
                "UNIT" => {
                    if !name.ends_with(&format!("_{arg}")) {
                        return Err(at("a family with a unit must end in _unit".into()));
                    }
                    f.unit = Some(arg.to_string());
                }
                _ => return Err(at(format!("unknown descriptor {kind:?}"))),
            }
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            return Err(at("blank line or stray comment".into()));
        }
        let fam_name = current
            .clone()
            .ok_or_else(|| at("sample before any family".into()))?;
        let f = families.get_mut(&fam_name).unwrap();
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end + 1..]).map_err(at)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let value = rest
            .strip_prefix(' ')
            .ok_or_else(|| at("expected a space before the value".into()))?;
        let value = value.split(' ').next().unwrap_or("");
        let value = parse_value(value).map_err(at)?;
        let suffix = name
            .strip_prefix(fam_name.as_str())
            .ok_or_else(|| at(format!("sample {name} outside family {fam_name}")))?;
        let allowed: &[&str] = match f.ty.as_str() {
            "counter" => &["_total", "_created"],
            "gauge" | "unknown" => &[""],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            "info" => &["_info"],
            "" => return Err(at("sample before its TYPE".into())),
            _ => &[""],
        };
        if !allowed.contains(&suffix) {
            return Err(at(format!("suffix {suffix:?} not allowed for a {}", f.ty)));
        }
        if f.ty == "counter" && suffix == "_total" && (value.is_nan() || value < 0.0) {
            return Err(at("a counter must be >= 0".into()));
        }
        f.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    for (name, f) in &families {
        if f.ty == "histogram" {
            check_histogram(name, f)?;
        }
    }
    Ok(families)
}

/// Per label set (without `le`): buckets ascending by `le`, counts cumulative, a
/// `+Inf` bucket equal to `_count`, and a `_sum`.
fn check_histogram(name: &str, f: &Family) -> Result<(), String> {
    type Key = BTreeMap<String, String>;
    /// A sample's labels without `le`.
    type Series = Vec<(String, String)>;
    let mut buckets: HashMap<Series, Vec<(f64, f64)>> = HashMap::new();
    let mut counts: HashMap<Series, f64> = HashMap::new();
    let mut sums: HashSet<Series> = HashSet::new();
    let key = |l: &Key| -> Series {
        l.iter()
            .filter(|(k, _)| k.as_str() != "le")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    for s in &f.samples {
        if s.name.ends_with("_bucket") {
            let le = s
                .labels
                .get("le")
                .ok_or(format!("{name}: bucket without le"))?;
            buckets
                .entry(key(&s.labels))
                .or_default()
                .push((parse_value(le)?, s.value));
        } else if s.name.ends_with("_count") {
            counts.insert(key(&s.labels), s.value);
        } else if s.name.ends_with("_sum") {
            sums.insert(key(&s.labels));
        }
    }
    if buckets.is_empty() {
        return Err(format!("{name}: a histogram without buckets"));
    }
    for (k, b) in &buckets {
        if !b.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1) {
            return Err(format!(
                "{name}{k:?}: buckets not ascending/cumulative: {b:?}"
            ));
        }
        let last = b.last().unwrap();
        if last.0 != f64::INFINITY {
            return Err(format!("{name}{k:?}: no +Inf bucket"));
        }
        if counts.get(k) != Some(&last.1) {
            return Err(format!("{name}{k:?}: +Inf bucket != _count"));
        }
        if !sums.contains(k) {
            return Err(format!("{name}{k:?}: no _sum"));
        }
    }
    Ok(())
}

/// The value of the sample `name` whose labels include every pair of `labels`.
fn value(f: &HashMap<String, Family>, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    f.values()
        .flat_map(|f| &f.samples)
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

#[test]
fn the_parser_refuses_what_openmetrics_forbids() {
    let ok = "# TYPE a counter\na_total 1\n# EOF\n";
    assert!(parse_openmetrics(ok).is_ok());
    for bad in [
        "# TYPE a counter\na_total 1\n",                       // no EOF
        "# TYPE a counter\na 1\n# EOF\n",                      // counter without _total
        "# TYPE a gauge\na{x=\"1} 1\n# EOF\n",                 // unterminated label
        "# TYPE a gauge\na 1\n# TYPE a gauge\n# EOF\n",        // declared twice
        "a 1\n# EOF\n",                                        // no family
        "# TYPE a_s gauge\n# UNIT a_s seconds\na_s 1\n# EOF\n", // unit suffix
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\nh_sum 0\n# EOF\n",
    ] {
        assert!(parse_openmetrics(bad).is_err(), "accepted: {bad:?}");
    }
}

// ---------------------------------------------------------------------------------

#[tokio::test]
async fn live_ready_metrics_and_errors() {
    timeout(LIMIT, async {
        let e = engine(&config(vec![
            scope("chat", vec![source("a"), source("b\"q")]),
            scope("emb", vec![source("a")]),
        ]));
        // Some traffic: a success, a failure, a 429, and a fail-fast CircuitOpen.
        for outcome in [
            Outcome::Success {
                tokens: None,
                split: None,
                count_attempt: true,
            },
            Outcome::failure(FailureKind::Timeout),
            Outcome::RateLimited { retry_after: None },
        ] {
            let call = e.begin_call(1, "emb", None).unwrap();
            let g = e.acquire(1, call).await.unwrap();
            e.report(1, g.permit, outcome).await.unwrap();
            e.end_call(1, call).await.unwrap();
        }
        e.force_open("a", secs(60)).await.unwrap();
        let call = e.begin_call(1, "emb", None).unwrap();
        assert!(e.acquire(1, call).await.is_err());

        let admin = Admin::start(exposition(&e), AdminOptions::default()).await;
        let addr = admin.addr;

        assert_eq!(get(addr, "/live").await, (200, "live\n".into()));
        assert_eq!(get(addr, "/ready").await.0, 200);
        assert_eq!(get(addr, "/nope").await.0, 404);
        let (code, head, _) = get_full(addr, "POST", "/metrics").await;
        assert_eq!(code, 405);
        assert!(
            head.to_ascii_lowercase().contains("allow: get, head"),
            "{head}"
        );
        let (code, head, body) = get_full(addr, "HEAD", "/live").await;
        assert_eq!((code, body.as_str()), (200, ""), "{head}");

        let (code, head, m) = get_full(addr, "GET", "/metrics").await;
        assert_eq!(code, 200);
        assert!(
            head.contains(
                "content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"
            ),
            "{head}"
        );
        let f = parse_openmetrics(&m).unwrap_or_else(|e| panic!("{e}\n{m}"));
        let info = format!(
            "polygate_info{{version=\"{}\",backend=\"memory\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        for line in [
            info.as_str(),
            "polygate_grants_total{source=\"a\"} 3",
            "polygate_reports_total{source=\"a\",outcome=\"success\"} 1",
            "polygate_reports_total{source=\"a\",outcome=\"failure\"} 1",
            "polygate_reports_total{source=\"a\",outcome=\"rate_limited\"} 1",
            "polygate_acquire_errors_total{scope=\"emb\",kind=\"circuit_open\"} 1",
            "polygate_breaker_state{source=\"a\",state=\"open\"} 1",
            "polygate_breaker_state{source=\"a\",state=\"closed\"} 0",
            // A label value with a quote is escaped.
            "polygate_pacer_in_flight{source=\"b\\\"q\"} 0",
        ] {
            assert!(m.lines().any(|l| l == line), "missing {line:?} in:\n{m}");
        }
        let ra = value(
            &f,
            "polygate_breaker_retry_after_seconds",
            &[("source", "a")],
        )
        .expect("retry_after sample");
        assert!(ra > 59.0 && ra <= 60.0, "{ra}");
        // Each family is declared once even though `a` is in two scopes.
        assert_eq!(f["polygate_breaker_epoch"].ty, "gauge");
        assert_eq!(
            f["polygate_breaker_epoch"]
                .samples
                .iter()
                .filter(|s| s.labels["source"] == "a")
                .count(),
            1
        );
        // Counters' families drop `_total`; seconds carry their unit.
        assert_eq!(f["polygate_grants"].ty, "counter");
        assert_eq!(
            f["polygate_breaker_retry_after_seconds"].unit.as_deref(),
            Some("seconds")
        );
        // Four Acquires in `emb` went through the engine: its wait histogram has
        // them; `chat` saw none.
        let count = |scope| {
            value(
                &f,
                "polygate_acquire_wait_seconds_count",
                &[("scope", scope)],
            )
            .unwrap()
        };
        assert_eq!((count("emb"), count("chat")), (4.0, 0.0));
        assert_eq!(f["polygate_acquire_wait_seconds"].ty, "histogram");

        e.shutdown();
        assert_eq!(get(addr, "/ready").await.0, 503);
        admin.stop().await;
    })
    .await
    .expect("test timed out");
}

/// Hello then `n` Pings on one worker connection.
async fn pings(path: &std::path::Path, n: u64) {
    let stream = tokio::net::UnixStream::connect(path).await.unwrap();
    let mut framed = tokio_util::codec::Framed::new(stream, ClientCodec::new(1 << 20));
    let hello = Request::Hello {
        protocol_version: PROTOCOL_VERSION,
        client_name: "metrics-test".into(),
        pid: std::process::id(),
    };
    framed
        .send(ClientFrame {
            id: 1,
            request: hello,
        })
        .await
        .unwrap();
    assert!(matches!(
        framed.next().await.unwrap().unwrap().reply,
        Reply::Welcome { .. }
    ));
    for id in 0..n {
        framed
            .send(ClientFrame {
                id: id + 2,
                request: Request::Ping,
            })
            .await
            .unwrap();
        assert_eq!(framed.next().await.unwrap().unwrap().reply, Reply::Pong);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn request_histograms_move_with_traffic() {
    timeout(LIMIT, async {
        let cfg = config(vec![scope("chat", vec![source("a")])]);
        let e = engine(&cfg);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let opts = ServerOptions::new(65536, AccessPolicy::from_config(&cfg.sidecar));
        let server_metrics: Arc<ServerMetrics> = opts.metrics.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let srv = tokio::spawn(server::run(
            tokio::net::UnixListener::bind(&path).unwrap(),
            e.clone(),
            opts,
            async move {
                let _ = stopped.await;
            },
        ));
        let exp = Exposition {
            engine: e.clone(),
            server: server_metrics,
            shared: None,
        };
        let scrape = || async {
            let m = metrics::render(&exp).await;
            parse_openmetrics(&m).unwrap_or_else(|err| panic!("{err}\n{m}"))
        };
        let ping = |f: &HashMap<String, Family>| {
            value(
                f,
                "polygate_request_duration_seconds_count",
                &[("request", "ping")],
            )
            .unwrap()
        };
        let before = scrape().await;
        assert_eq!(ping(&before), 0.0);
        pings(&path, 25).await;
        let after = scrape().await;
        assert_eq!(ping(&after), 25.0);
        let sum = value(
            &after,
            "polygate_request_duration_seconds_sum",
            &[("request", "ping")],
        )
        .unwrap();
        assert!(sum > 0.0 && sum < 25.0, "{sum}");
        // Hello is not counted (it is answered before requests are served); Report
        // saw nothing.
        assert_eq!(
            value(
                &after,
                "polygate_request_duration_seconds_count",
                &[("request", "report")]
            ),
            Some(0.0)
        );
        stop.send(()).unwrap();
        srv.await.unwrap().unwrap();
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn hundreds_of_idle_connections_cannot_fail_a_probe() {
    timeout(LIMIT, async {
        let e = engine(&config(vec![scope("chat", vec![source("a")])]));
        let opts = AdminOptions {
            header_read_timeout: Duration::from_millis(1500),
            ..AdminOptions::default()
        };
        let cap = opts.max_connections;
        let admin = Admin::start(exposition(&e), opts).await;
        let addr = admin.addr;

        // 200 connections that never send a byte, and 20 that send half a head.
        let mut idle = Vec::new();
        for i in 0..220 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            if i % 11 == 0 {
                s.write_all(b"GET /live HTTP/1.1\r\nHost: x\r\n")
                    .await
                    .unwrap();
            }
            idle.push(s);
        }
        // Every probe is served, at once, however many of them come.
        let started = Instant::now();
        for path in ["/live", "/ready", "/live", "/metrics"] {
            assert_eq!(get(addr, path).await.0, 200, "{path}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );

        // The connections over the cap were closed to make room (the oldest first),
        // and the rest are closed by the header read timeout: none is kept.
        let mut closed_early = 0;
        for (i, mut s) in idle.into_iter().enumerate() {
            let mut buf = [0u8; 256];
            let r = timeout(Duration::from_secs(4), s.read(&mut buf)).await;
            let r = r.unwrap_or_else(|_| panic!("idle connection {i} still open after 4 s"));
            if i < 220 - cap {
                closed_early += 1;
            }
            // EOF, a reset, or hyper's 408 for a partial head: all close it.
            if let Ok(n) = r {
                let out = String::from_utf8_lossy(&buf[..n]);
                assert!(n == 0 || out.starts_with("HTTP/1.1 408"), "{i}: {out:?}");
            }
        }
        assert!(closed_early > 0);
        admin.stop().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test]
async fn keep_alive_serves_many_requests_on_one_connection() {
    timeout(LIMIT, async {
        let e = engine(&config(vec![scope("chat", vec![source("a")])]));
        let admin = Admin::start(exposition(&e), AdminOptions::default()).await;
        let addr = admin.addr;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\nGET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 1024];
        while out.windows(6).filter(|w| w == b"ready\n").count() < 1 {
            let n = timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&out));
            out.extend_from_slice(&buf[..n]);
        }
        let out = String::from_utf8_lossy(&out);
        assert_eq!(out.matches("HTTP/1.1 200 OK").count(), 2, "{out}");
        admin.stop().await;
    })
    .await
    .expect("test timed out");
}

#[tokio::test(start_paused = true)]
async fn scrapes_cost_a_remote_backend_nothing() {
    let cfg = config(vec![
        scope("chat", vec![source("a"), source("b")]),
        scope("emb", vec![source("a")]),
    ]);
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let inner = MemoryBackend::new(clock.clone(), ["a", "b"]);
    let e = Engine::new(&cfg, TestBackend::new(inner, true, Duration::ZERO), clock);
    let view = Arc::new(SharedView::default());
    let refresh = metrics::spawn_refresh(e.clone(), view.clone(), secs(10));
    let exp = Exposition {
        engine: e.clone(),
        server: Arc::default(),
        shared: Some(view),
    };
    // Before the first refresh: no breaker samples, no age, host-local gauges live.
    let m = metrics::render(&exp).await;
    let f = parse_openmetrics(&m).unwrap_or_else(|err| panic!("{err}\n{m}"));
    assert!(value(&f, "polygate_breaker_epoch", &[("source", "a")]).is_none());
    assert!(value(&f, "polygate_pacer_ceiling", &[("source", "a")]).is_some());
    tokio::time::sleep(ms(1)).await; // the first refresh runs
    let snapshots = || e.backend().snapshots.load(Ordering::SeqCst);
    assert_eq!(snapshots(), 2, "one snapshot per distinct source");

    e.force_open("a", secs(60)).await.unwrap();
    for _ in 0..500 {
        let m = metrics::render(&exp).await;
        parse_openmetrics(&m).unwrap_or_else(|err| panic!("{err}\n{m}"));
    }
    assert_eq!(snapshots(), 2, "500 scrapes asked the backend nothing");
    // Stale until the next refresh (documented), then current.
    let m = metrics::render(&exp).await;
    let f = parse_openmetrics(&m).unwrap();
    assert_eq!(
        value(
            &f,
            "polygate_breaker_state",
            &[("source", "a"), ("state", "closed")]
        ),
        Some(1.0)
    );
    tokio::time::sleep(secs(10)).await;
    assert_eq!(snapshots(), 4);
    tokio::time::sleep(secs(3)).await;
    let m = metrics::render(&exp).await;
    let f = parse_openmetrics(&m).unwrap();
    assert_eq!(
        value(
            &f,
            "polygate_breaker_state",
            &[("source", "a"), ("state", "open")]
        ),
        Some(1.0)
    );
    // retry_after counts down between refreshes; the age says how old the view is.
    let ra = value(
        &f,
        "polygate_breaker_retry_after_seconds",
        &[("source", "a")],
    )
    .unwrap();
    assert!((46.0..=47.5).contains(&ra), "{ra}");
    let age = value(&f, "polygate_shared_state_age_seconds", &[]).unwrap();
    assert!((2.9..=3.1).contains(&age), "{age}");
    refresh.abort();
}

/// §7a: `/metrics` shows every configured bucket: level, capacity, refill, debt.
#[tokio::test]
async fn every_quota_bucket_is_a_labelled_sample() {
    timeout(LIMIT, async {
        let src = polygate::config::SourceConfig {
            rpm: Some(120),
            otpm: Some(600),
            burst: secs(1),
            ..source("a")
        };
        let e = engine(&config(vec![scope("chat", vec![src])]));
        let call = e
            .begin_call(
                1,
                "chat",
                polygate::engine::CallEst {
                    output: Some(30),
                    ..Default::default()
                },
            )
            .unwrap();
        let g = e.acquire(1, call).await.unwrap();
        let used = Outcome::Success {
            tokens: None,
            split: Some(polygate::backend::Split {
                input: 0,
                output: 40,
            }),
            count_attempt: true,
        };
        e.report(1, g.permit, used).await.unwrap();
        e.end_call(1, call).await.unwrap();
        let admin = Admin::start(exposition(&e), AdminOptions::default()).await;
        let (code, m) = get(admin.addr, "/metrics").await;
        assert_eq!(code, 200);
        let f = parse_openmetrics(&m).unwrap_or_else(|e| panic!("{e}\n{m}"));
        let at = |name: &str, bucket: &str| value(&f, name, &[("source", "a"), ("bucket", bucket)]);
        assert_eq!(at("polygate_quota_bucket_capacity", "rpm"), Some(2.0));
        assert_eq!(at("polygate_quota_bucket_capacity", "otpm"), Some(10.0));
        assert_eq!(
            at("polygate_quota_bucket_refill_per_second", "otpm"),
            Some(10.0)
        );
        assert_eq!(
            at("polygate_quota_bucket_capacity", "tpm"),
            None,
            "not configured"
        );
        let level = at("polygate_quota_bucket_level", "otpm").expect("a level");
        let debt = at("polygate_quota_bucket_debt", "otpm").expect("a debt");
        // 40 output tokens out of a bucket of 10: about -30 (refill meanwhile).
        assert!((-30.0..-25.0).contains(&level), "{level}\n{m}");
        assert!(
            (debt + level).abs() < 1e-9,
            "debt mirrors the level: {debt} {level}"
        );
        admin.stop().await;
    })
    .await
    .unwrap();
}

/// §15: the per-class families and the per-scope error counters, pinned to the
/// letter (integer gauges without a decimal point, the float share with one, every
/// refusal reason in order), so a refactor of their encoding cannot change a byte.
#[tokio::test(start_paused = true)]
async fn class_families_and_acquire_errors_render_exactly() {
    timeout(LIMIT, async {
        let class = |name: &str, weight: f64| polygate::config::PriorityConfig {
            name: name.into(),
            weight,
            reserve: 0.0,
            limit: 1.0,
        };
        // `chat`: three pacer slots, so a fourth Acquire waits.
        let mut chat = scope("chat", vec![source("a")]);
        chat.pacer.initial = 3.0;
        chat.pacer.min = 3.0;
        chat.pacer.max = 3.0;
        chat.priorities = vec![class("interactive", 2.0), class("batch", 1.0)];
        chat.default_priority = 1;
        // `bg`: its only source forced open, so its Acquires end `circuit_open`.
        let mut bg = scope("bg", vec![source("b")]);
        bg.priorities = vec![class("low", 1.0)];
        let e = engine(&config(vec![chat, bg]));
        let acquire = |cls: &str| {
            let call = e.begin_call_as(1, "chat", None, Some(cls)).unwrap();
            let e = e.clone();
            async move { e.acquire(1, call).await }
        };
        let _i = acquire("interactive").await.unwrap();
        let _b1 = acquire("batch").await.unwrap();
        let _b2 = acquire("batch").await.unwrap();
        let waiter = tokio::spawn(acquire("interactive"));
        tokio::time::sleep(ms(1)).await;
        e.force_open("b", secs(60)).await.unwrap();
        for _ in 0..2 {
            let call = e.begin_call(1, "bg", None).unwrap();
            assert!(e.acquire(1, call).await.is_err());
        }

        let m = metrics::render(&exposition(&e)).await;
        let families = [
            "polygate_class_",
            "# TYPE polygate_class_",
            "# HELP polygate_class_",
            "polygate_acquire_errors",
            "# TYPE polygate_acquire_errors",
            "# HELP polygate_acquire_errors",
        ];
        let got: Vec<&str> = m
            .lines()
            .filter(|l| families.iter().any(|f| l.starts_with(f)))
            .collect();
        let want = r#"# HELP polygate_acquire_errors Acquires that ended in a gateway error, by kind.
# TYPE polygate_acquire_errors counter
polygate_acquire_errors_total{scope="chat",kind="circuit_open"} 0
polygate_acquire_errors_total{scope="chat",kind="stalled"} 0
polygate_acquire_errors_total{scope="chat",kind="quota_exhausted"} 0
polygate_acquire_errors_total{scope="chat",kind="retry_exhausted"} 0
polygate_acquire_errors_total{scope="chat",kind="backend_unavailable"} 0
polygate_acquire_errors_total{scope="chat",kind="tenant_limited"} 0
polygate_acquire_errors_total{scope="bg",kind="circuit_open"} 2
polygate_acquire_errors_total{scope="bg",kind="stalled"} 0
polygate_acquire_errors_total{scope="bg",kind="quota_exhausted"} 0
polygate_acquire_errors_total{scope="bg",kind="retry_exhausted"} 0
polygate_acquire_errors_total{scope="bg",kind="backend_unavailable"} 0
polygate_acquire_errors_total{scope="bg",kind="tenant_limited"} 0
# HELP polygate_class_waiters Acquires of the priority class currently waiting.
# TYPE polygate_class_waiters gauge
polygate_class_waiters{scope="chat",class="interactive"} 1
polygate_class_waiters{scope="chat",class="batch"} 0
polygate_class_waiters{scope="bg",class="low"} 0
# HELP polygate_class_grant_share The class's share of the scope's grants on this host.
# TYPE polygate_class_grant_share gauge
polygate_class_grant_share{scope="chat",class="interactive"} 0.3333333333333333
polygate_class_grant_share{scope="chat",class="batch"} 0.6666666666666666
polygate_class_grant_share{scope="bg",class="low"} 0.0
# HELP polygate_class_in_flight Pacer slots the class holds on this host.
# TYPE polygate_class_in_flight gauge
polygate_class_in_flight{scope="chat",class="interactive"} 1
polygate_class_in_flight{scope="chat",class="batch"} 2
polygate_class_in_flight{scope="bg",class="low"} 0
# HELP polygate_class_grants Permits granted to calls of the class.
# TYPE polygate_class_grants counter
polygate_class_grants_total{scope="chat",class="interactive"} 1
polygate_class_grants_total{scope="chat",class="batch"} 2
polygate_class_grants_total{scope="bg",class="low"} 0
# HELP polygate_class_refusals Refusals of the class by reason: call-ending errors, and sources held back by its limit or another class's reserve.
# TYPE polygate_class_refusals counter
polygate_class_refusals_total{scope="chat",class="interactive",reason="circuit_open"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="stalled"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="quota_exhausted"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="retry_exhausted"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="backend_unavailable"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="tenant_limited"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="held_limit"} 0
polygate_class_refusals_total{scope="chat",class="interactive",reason="held_reserve"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="circuit_open"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="stalled"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="quota_exhausted"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="retry_exhausted"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="backend_unavailable"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="tenant_limited"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="held_limit"} 0
polygate_class_refusals_total{scope="chat",class="batch",reason="held_reserve"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="circuit_open"} 2
polygate_class_refusals_total{scope="bg",class="low",reason="stalled"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="quota_exhausted"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="retry_exhausted"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="backend_unavailable"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="tenant_limited"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="held_limit"} 0
polygate_class_refusals_total{scope="bg",class="low",reason="held_reserve"} 0
"#;
        assert_eq!(got.join("\n") + "\n", want, "in:\n{m}");
        waiter.abort();
    })
    .await
    .unwrap();
}

/// §19: with `tenant_metrics_top = N` and N + 5 tenants served, exactly N tenants get
/// per-tenant series (the top by dollars settled here, a hostile id escaped), every
/// scope with tenants gets totals that are the sum over all N + 5 (the refusal of a
/// tenant's own limit counted), and a scope without tenants gets none; with N = 0,
/// totals only.
#[tokio::test(start_paused = true)]
async fn tenant_families_cover_the_top_n_and_totals_sum_every_tenant() {
    const HOSTILE: &str = "evil\"\\\n\u{1F600}";
    timeout(LIMIT, async {
        let priced = polygate::config::SourceConfig {
            usd_per_1m_input: Some(1.0),
            ..source("a")
        };
        let mut chat = scope("chat", vec![priced]);
        chat.quota_full = polygate::config::Mode::FailFast;
        chat.tenants = Some(polygate::config::TenantsConfig {
            fairness: polygate::config::Fairness::Vtc,
            default: Default::default(),
            anonymous: Default::default(),
            overrides: vec![polygate::config::TenantOverride {
                name: "t0".into(),
                limits: polygate::config::TenantLimits {
                    rpm: Some(1),
                    ..Default::default()
                },
            }],
            max_tenants: 1000,
        });
        let mut cfg = config(vec![chat, scope("emb", vec![source("b")])]);
        let n = 3;
        cfg.sidecar.tenant_metrics_top = n as u32;
        let e = engine(&cfg);
        // t0..t6 and the hostile id: 8 = N + 5 tenants, tenant k settles 100 (k + 1)
        // tokens at $1 per million; the hostile one the most.
        let mut tenants: Vec<String> = (0..7).map(|k| format!("t{k}")).collect();
        tenants.push(HOSTILE.into());
        for (k, t) in tenants.iter().enumerate() {
            let call = e.begin_call_for(1, "chat", None, None, Some(t)).unwrap();
            let g = e.acquire(1, call).await.unwrap();
            let used = Outcome::Success {
                tokens: Some(100 * (k as u64 + 1)),
                split: None,
                count_attempt: true,
            };
            e.report(1, g.permit, used).await.unwrap();
            e.end_call(1, call).await.unwrap();
        }
        // t0's rpm of 1 refuses its second call.
        let call = e.begin_call_for(1, "chat", None, None, Some("t0")).unwrap();
        let refused = e.acquire(1, call).await;
        assert!(
            matches!(
                refused,
                Err(polygate::engine::EngineError::TenantLimited { .. })
            ),
            "{refused:?}"
        );
        let _ = e.end_call(1, call).await;

        let m = metrics::render(&exposition(&e)).await;
        let f = parse_openmetrics(&m).unwrap_or_else(|e| panic!("{e}\n{m}"));
        let per_tenant = [
            "polygate_tenant_calls",
            "polygate_tenant_in_flight",
            "polygate_tenant_grants",
            "polygate_tenant_refusals",
            "polygate_tenant_tokens",
            "polygate_tenant_usd_spent",
        ];
        for fam in per_tenant {
            let got: Vec<&str> = f[fam]
                .samples
                .iter()
                .map(|s| {
                    assert_eq!(s.labels["scope"], "chat", "{fam}");
                    s.labels["tenant"].as_str()
                })
                .collect();
            assert_eq!(got, [HOSTILE, "t6", "t5"], "{fam}: the top {n} by spend");
        }
        // The hostile id, escaped as OpenMetrics says, and read back whole above.
        let line =
            "polygate_tenant_tokens_total{scope=\"chat\",tenant=\"evil\\\"\\\\\\n\u{1F600}\"} 800";
        assert!(m.lines().any(|l| l == line), "missing {line:?} in:\n{m}");
        let tokens: u64 = (1..=8).map(|k| 100 * k).sum();
        let total = |name: &str| value(&f, name, &[("scope", "chat")]);
        assert_eq!(total("polygate_tenants_tracked"), Some(8.0));
        assert_eq!(total("polygate_tenants_grants_total"), Some(8.0));
        assert_eq!(total("polygate_tenants_refusals_total"), Some(1.0));
        assert_eq!(total("polygate_tenants_tokens_total"), Some(tokens as f64));
        assert_eq!(total("polygate_tenants_calls"), Some(0.0));
        assert_eq!(total("polygate_tenants_in_flight"), Some(0.0));
        let usd = total("polygate_tenants_usd_spent_total").unwrap();
        assert!((usd - tokens as f64 * 1e-6).abs() < 1e-12, "{usd}");
        let top_usd = value(&f, "polygate_tenant_usd_spent_total", &[("tenant", "t6")]).unwrap();
        assert!((top_usd - 700e-6).abs() < 1e-12, "{top_usd}");
        assert_eq!(
            value(&f, "polygate_tenant_refusals_total", &[("tenant", "t0")]),
            None,
            "t0 spent least: not in the top"
        );
        // `emb` has no tenants: no series of either kind.
        assert!(
            !f.values()
                .flat_map(|f| &f.samples)
                .any(|s| s.name.starts_with("polygate_tenant") && s.labels["scope"] == "emb"),
            "{m}"
        );

        // N = 0: the totals, no per-tenant family.
        let mut none = cfg.clone();
        none.sidecar.tenant_metrics_top = 0;
        let e0 = engine(&none);
        let call = e0
            .begin_call_for(1, "chat", None, None, Some("t1"))
            .unwrap();
        let g = e0.acquire(1, call).await.unwrap();
        e0.report(
            1,
            g.permit,
            Outcome::Success {
                tokens: Some(5),
                split: None,
                count_attempt: true,
            },
        )
        .await
        .unwrap();
        e0.end_call(1, call).await.unwrap();
        // An abandoned permit (never reported) keeps its estimate, dollars included.
        let call = e0
            .begin_call_for(1, "chat", Some(1000), None, Some("t2"))
            .unwrap();
        e0.acquire(1, call).await.unwrap();
        e0.end_call(1, call).await.unwrap();
        let m0 = metrics::render(&exposition(&e0)).await;
        let f0 = parse_openmetrics(&m0).unwrap_or_else(|e| panic!("{e}\n{m0}"));
        assert!(!m0.contains("polygate_tenant_"), "{m0}");
        assert_eq!(
            value(&f0, "polygate_tenants_tokens_total", &[("scope", "chat")]),
            Some(1005.0)
        );
        let usd = value(
            &f0,
            "polygate_tenants_usd_spent_total",
            &[("scope", "chat")],
        )
        .unwrap();
        assert!((usd - 1005e-6).abs() < 1e-12, "{usd}");
    })
    .await
    .unwrap();
}
