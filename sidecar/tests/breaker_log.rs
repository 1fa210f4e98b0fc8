//! §12: every breaker transition the daemon observes is one log line (text and JSON
//! formats) naming scope, source, from, to and reason, and one increment of
//! `polygate_breaker_transitions_total` on `/metrics`.

mod support;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use ipc_protocol::{CallSpec, FailureKind, Outcome, Reply, Request};
use support::daemon::{Client, Daemon};

const SCOPES: &str = r#"
[scopes.chat]
circuit_open = "wait"

[scopes.chat.breaker]
failure_threshold = 2
cooldown = "200ms"
max_cooldown = "1s"

[[scopes.chat.sources]]
name = "primary"
"#;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spec() -> CallSpec {
    CallSpec {
        scope: "chat".into(),
        est_tokens: Some(10),
        priority: None,
        est_input_tokens: None,
        est_output_tokens: None,
    }
}

/// Start a call and return its permit and whether it is the probe.
async fn start(c: &mut Client) -> (u64, bool) {
    match c.call(Request::Start(spec())).await {
        Reply::Started {
            permit, is_probe, ..
        } => (permit, is_probe),
        other => panic!("expected Started, got {other:?}"),
    }
}

async fn finish(c: &mut Client, permit: u64, outcome: Outcome) {
    let r = c.call(Request::Finish { permit, outcome }).await;
    assert!(matches!(r, Reply::Reported { .. }), "{r:?}");
}

fn failure() -> Outcome {
    Outcome::Failure {
        kind: FailureKind::ServerError,
    }
}

/// GET `path` on the admin listener; the body.
fn http_get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("admin listener");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// closed → open (streak), open → half_open (cooldown over, this host's probe),
/// half_open → closed (probe success), closed → open (force); a 429 block.
async fn drive(d: &Daemon) {
    let mut c = Client::connect(&d.socket, ipc_protocol::PROTOCOL_VERSION).await;
    for _ in 0..2 {
        let (permit, _) = start(&mut c).await;
        finish(&mut c, permit, failure()).await;
    }
    // Waits out the 200 ms cooldown (circuit_open = "wait"), then probes.
    let (permit, is_probe) = tokio::time::timeout(Duration::from_secs(10), start(&mut c))
        .await
        .expect("probe granted after the cooldown");
    assert!(is_probe);
    finish(
        &mut c,
        permit,
        Outcome::Success {
            tokens: None,
            count_attempt: true,
        },
    )
    .await;
    let (permit, _) = start(&mut c).await;
    finish(
        &mut c,
        permit,
        Outcome::RateLimited {
            retry_after_s: Some(30.0),
        },
    )
    .await;
    let r = c
        .call(Request::ForceOpen {
            source: "primary".into(),
            seconds: 60.0,
        })
        .await;
    assert_eq!(r, Reply::Ok);
}

/// The log lines that carry a transition, waiting for `n` of them.
fn wait_for(d: &Daemon, needle: &str, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<String> = d
            .log_text()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect();
        if lines.len() >= n || Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const EXPECTED: [(&str, &str, &str); 5] = [
    ("closed", "open", "streak"),
    ("open", "half_open", "cooldown_over"),
    ("half_open", "closed", "probe_success"),
    ("closed", "blocked", "429_block"),
    ("closed", "open", "force"),
];

#[tokio::test(flavor = "multi_thread")]
async fn text_log_has_one_line_per_transition_and_metrics_count_them() {
    let port = free_port();
    let d = Daemon::start(&format!("admin_listen = \"127.0.0.1:{port}\""), SCOPES, &[]);
    drive(&d).await;
    let lines = wait_for(&d, "breaker primary:", EXPECTED.len());
    assert_eq!(lines.len(), EXPECTED.len(), "{}", d.log_text());
    for (line, (from, to, reason)) in lines.iter().zip(EXPECTED) {
        assert!(
            line.contains(&format!("breaker primary: {from} -> {to} ({reason})")),
            "{line}"
        );
        assert!(
            line.contains("scope=\"chat\"") || line.contains("scope=chat"),
            "{line}"
        );
        assert!(
            line.contains(&format!("to=\"{to}\"")) || line.contains(&format!("to={to}")),
            "{line}"
        );
    }
    // Opened by its streak: the cooldown and level are on the line.
    assert!(lines[0].contains("cooldown_s=0.2"), "{}", lines[0]);
    assert!(lines[0].contains("level=0"), "{}", lines[0]);

    let metrics = tokio::task::spawn_blocking(move || http_get(port, "/metrics"))
        .await
        .unwrap();
    for (from, to, reason) in EXPECTED {
        let sample = format!(
            "polygate_breaker_transitions_total{{scope=\"chat\",source=\"primary\",from=\"{from}\",to=\"{to}\",reason=\"{reason}\"}} "
        );
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&sample))
            .unwrap_or_else(|| panic!("{sample} missing:\n{metrics}"));
        let n: u64 = line[sample.len()..].trim().parse().unwrap();
        assert_eq!(n, 1, "{line}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn json_log_lines_name_the_source_and_new_state() {
    let d = Daemon::start("log_format = \"json\"", SCOPES, &[]);
    drive(&d).await;
    let lines = wait_for(&d, "\"source\":\"primary\",\"from\"", EXPECTED.len());
    assert_eq!(lines.len(), EXPECTED.len(), "{}", d.log_text());
    for (line, (from, to, reason)) in lines.iter().zip(EXPECTED) {
        let v: serde_json::Value = serde_json::from_str(line).expect("one JSON object per line");
        let f = &v["fields"];
        assert_eq!(f["source"], "primary", "{line}");
        assert_eq!(f["scope"], "chat", "{line}");
        assert_eq!(f["from"], from, "{line}");
        assert_eq!(f["to"], to, "{line}");
        assert_eq!(f["reason"], reason, "{line}");
    }
}
