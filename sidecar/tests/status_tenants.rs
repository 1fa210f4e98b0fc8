//! §19 "Visibility" through the real binary: the daemon started from a configuration
//! with tenants, calls made by a raw protocol-3 client, then `polygate-sidecar status
//! --tenant NAME [--scope S] [--json]`, `status` (top tenants by spend and totals) and
//! the admin listener's `/metrics` (the top `tenant_metrics_top` tenants only).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{CallSpec, ClientCodec, ClientFrame, Outcome, Reply, Request, Usage};
use tokio::net::UnixStream;
use tokio_util::codec::Framed;

const BIN: &str = env!("CARGO_BIN_EXE_polygate-sidecar");

/// Every test here ends well within this.
const LIMIT: Duration = Duration::from_secs(60);

/// A tenant id with a quote, a backslash and a newline.
const HOSTILE: &str = "ev\"il\\\nid";

/// `chat` has tenants (acme overridden, everyone else the default; prices per million
/// tokens: $2 input, $10 output); `emb` has none. One tenant's figures in `/metrics`.
fn config(socket: &Path, admin: std::net::SocketAddr) -> String {
    format!(
        r#"
[sidecar]
socket = "{}"
socket_mode = "0600"
shutdown_grace = "1s"
admin_listen = "{admin}"
tenant_metrics_top = 1

[scopes.chat]
quota_full = "fail_fast"
[[scopes.chat.sources]]
name = "primary"
tpm = 60000
rpm = 600
usd_per_1m_input = 2.0
usd_per_1m_output = 10.0

[scopes.chat.tenants]
default = {{ tpm = 1000, rpm = 10, usd_per_day = 5.0 }}

[[scopes.chat.tenants.override]]
name = "acme"
tpm = 2000
usd_per_month = 50.0
weight = 2

[scopes.emb]
[[scopes.emb.sources]]
name = "embedder"
"#,
        socket.display()
    )
}

/// The binary with a clean slate of override-looking variables.
fn sidecar() -> Command {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.contains("__") {
            cmd.env_remove(k);
        }
    }
    cmd.env_remove("POLYGATE_SOCKET")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("LISTEN_FDS");
    cmd
}

/// The daemon, killed on drop.
struct Daemon(std::process::Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start the daemon on `dir`'s socket; returns it once the socket answers.
async fn daemon(dir: &Path) -> (Daemon, std::path::PathBuf, std::net::SocketAddr) {
    let socket = dir.join("s.sock");
    let admin = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let file = dir.join("polygate.toml");
    std::fs::write(&file, config(&socket, admin)).unwrap();
    let child = sidecar()
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let d = Daemon(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(&socket).await.is_err() {
        assert!(Instant::now() < deadline, "the daemon did not listen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (d, socket, admin)
}

/// A raw protocol-3 connection.
struct Client {
    framed: Framed<UnixStream, ClientCodec>,
    next: u64,
}

impl Client {
    async fn connect(socket: &Path) -> Client {
        let stream = UnixStream::connect(socket).await.unwrap();
        let mut c = Client {
            framed: Framed::new(stream, ClientCodec::new(1 << 20)),
            next: 1,
        };
        let hello = Request::Hello {
            protocol_version: 3,
            client_name: "status-tenants-test".into(),
            pid: std::process::id(),
        };
        assert!(matches!(c.ask(hello).await, Reply::Welcome { .. }));
        c
    }

    async fn ask(&mut self, request: Request) -> Reply {
        let id = self.next;
        self.next += 1;
        self.framed.send(ClientFrame { id, request }).await.unwrap();
        let f = tokio::time::timeout(Duration::from_secs(5), self.framed.next())
            .await
            .expect("a reply within 5 s")
            .unwrap()
            .unwrap();
        assert_eq!(f.id, id);
        f.reply
    }

    /// Start a `chat` call for `tenant` (`""`: a plain Start) estimated at `input` +
    /// `output` tokens; its permit.
    async fn start(&mut self, tenant: &str, input: u64, output: u64) -> u64 {
        let spec = CallSpec {
            scope: "chat".into(),
            est_tokens: None,
            priority: None,
            est_input_tokens: Some(input),
            est_output_tokens: Some(output),
        };
        let request = match tenant {
            "" => Request::Start(spec),
            t => Request::StartTenant {
                spec,
                tenant: t.into(),
            },
        };
        match self.ask(request).await {
            Reply::Started { permit, .. } => permit,
            other => panic!("{tenant:?}: not started: {other:?}"),
        }
    }

    /// Finish `permit` with the usage `input` + `output`.
    async fn finish(&mut self, permit: u64, input: u64, output: u64) {
        let outcome = Outcome::SuccessUsage {
            usage: Usage {
                tokens: None,
                input_tokens: Some(input),
                output_tokens: Some(output),
            },
            count_attempt: true,
        };
        let r = self.ask(Request::Finish { permit, outcome }).await;
        assert!(matches!(r, Reply::Reported { .. }), "{r:?}");
    }
}

/// `polygate-sidecar status ARGS --socket PATH`, off the runtime's threads.
async fn status(args: &[&str], socket: &Path) -> (Option<i32>, String, String) {
    let mut cmd = sidecar();
    cmd.arg("status").args(args).arg("--socket").arg(socket);
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The traffic every test sees: acme one call finished (100 in + 50 out: $0.0007)
/// and one still open (its estimate, 100 + 50, reserved); globex 300 in ($0.0006);
/// the hostile id 10 in ($0.00002); an anonymous call. Returns the client holding
/// acme's open call.
async fn traffic(socket: &Path) -> Client {
    let mut c = Client::connect(socket).await;
    let p = c.start("acme", 100, 50).await;
    c.finish(p, 100, 50).await;
    let p = c.start("globex", 300, 0).await;
    c.finish(p, 300, 0).await;
    let p = c.start(HOSTILE, 10, 0).await;
    c.finish(p, 10, 0).await;
    let p = c.start("", 10, 0).await;
    c.finish(p, 10, 0).await;
    c.start("acme", 100, 50).await;
    c
}

/// The line of `text` that starts (after its indent) with `first`.
fn row<'a>(text: &'a str, first: &str) -> Vec<&'a str> {
    text.lines()
        .find(|l| l.trim_start().starts_with(first))
        .unwrap_or_else(|| panic!("no {first:?} row in:\n{text}"))
        .split_whitespace()
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn status_tenant_shows_limits_levels_spend_and_calls() {
    tokio::time::timeout(LIMIT, async {
        let dir = tempfile::tempdir().unwrap();
        let (_d, socket, _) = daemon(dir.path()).await;
        let _open = traffic(&socket).await;

        // acme: its override (tpm 2000, weight 2, $50 a month) over the default (rpm
        // 10, $5 a day); 300 tokens and 2 requests taken (one call still reserved).
        let (code, out, err) = status(&["--tenant", "acme"], &socket).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(out.starts_with("tenant acme\n"), "{out}");
        assert!(
            out.contains("scope chat: weight 2, waiting here 0"),
            "{out}"
        );
        assert!(!out.contains("scope emb"), "emb has no tenants:\n{out}");
        let tpm = row(&out, "tpm");
        assert_eq!(tpm[1], "2000", "{out}");
        let level: f64 = tpm[2].parse().unwrap();
        assert!(
            (1700.0..1702.0).contains(&level),
            "2000 - 300 (+ refill): {out}"
        );
        let rpm = row(&out, "rpm");
        assert_eq!((rpm[1], rpm[2]), ("10", "8"), "{out}");
        assert!(!out.contains("tpd"), "no tpd limit, no row:\n{out}");
        // Spent: the finished call's $0.0007 and the open one's reserved $0.0007.
        assert!(out.contains("spent today (UTC): $0.0014 of $5.00"), "{out}");
        assert!(
            out.contains("spent this month (UTC): $0.0014 of $50.00"),
            "{out}"
        );
        assert!(out.contains("in flight (every host): 1"), "{out}");
        assert!(
            out.contains(
                "this host: calls 1, in flight 1, grants 2, refused 0, tokens 150, $0.0007 settled"
            ),
            "{out}"
        );

        // --json: the TenantStatus document, one line.
        let (code, out, err) = status(&["--tenant", "acme", "--json"], &socket).await;
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(out.lines().count(), 1, "{out}");
        let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(doc["tenant"], "acme");
        let chat = &doc["scopes"]["chat"];
        assert_eq!(chat["limits"]["tpm"], 2000);
        assert_eq!(chat["limits"]["rpm"], 10);
        assert_eq!(chat["limits"]["usd_per_day"], 5.0);
        assert_eq!(chat["ledger"]["in_flight"], 1);
        assert_eq!(
            chat["ledger"]["levels"]["rpm"].as_f64().map(f64::floor),
            Some(8.0)
        );
        assert!((chat["ledger"]["usd_spent_day"].as_f64().unwrap() - 0.0014).abs() < 1e-9);
        assert_eq!(chat["host"]["calls"], 1);
        assert_eq!(doc["scopes"].as_object().unwrap().len(), 1, "{doc}");

        // A tenant never seen: the default limits and a fresh ledger, no error.
        let (code, out, err) = status(&["--tenant", "nobody", "--scope", "chat"], &socket).await;
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(row(&out, "tpm")[1..], ["1000", "1000"], "{out}");
        assert_eq!(row(&out, "rpm")[1..], ["10", "10"], "{out}");
        assert!(out.contains("spent today (UTC): $0.00 of $5.00"), "{out}");
        assert!(
            out.contains("spent this month (UTC): not counted (no usd_per_month budget)"),
            "{out}"
        );
        assert!(out.contains("in flight (every host): 0"), "{out}");
        assert!(out.contains("this host: not seen"), "{out}");
        let (_, out, _) = status(&["--tenant", "nobody", "--json"], &socket).await;
        let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            doc["scopes"]["chat"]["ledger"]["levels"]["tpm"], 1000.0,
            "{doc}"
        );

        // The anonymous tenant: no limit configured, so no ledger.
        let (code, out, err) = status(&["--tenant", ""], &socket).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(
            out.starts_with("tenant \"\" (the anonymous tenant"),
            "{out}"
        );
        assert!(out.contains("no token or request limit"), "{out}");
        assert!(out.contains("no limit: no shared ledger"), "{out}");
        assert!(
            out.contains("spent today (UTC): not counted (no usd_per_day budget)"),
            "{out}"
        );
        assert!(
            out.contains("calls that name no tenant are not counted"),
            "{out}"
        );

        // A hostile id stays on its lines, escaped.
        let (code, out, err) = status(&["--tenant", HOSTILE], &socket).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(out.starts_with("tenant \"ev\\\"il\\\\\\nid\"\n"), "{out}");
        assert!(out.contains("tokens 10, $0.00002 settled"), "{out}");

        // An unknown scope, and a scope without tenants: errors naming them.
        let (code, out, err) = status(&["--tenant", "acme", "--scope", "nope"], &socket).await;
        assert_eq!(code, Some(1), "{out}");
        assert!(err.contains("\"nope\"") && err.contains("chat"), "{err}");
        let (code, _, err) = status(&["--tenant", "acme", "--scope", "emb"], &socket).await;
        assert_eq!(code, Some(1));
        assert!(err.contains("\"emb\" has no tenants"), "{err}");
        // --scope means nothing without --tenant.
        let (code, _, err) = status(&["--scope", "chat"], &socket).await;
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("--tenant"), "{err}");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn status_lists_the_top_tenants_by_spend_and_metrics_only_the_top_n() {
    tokio::time::timeout(LIMIT, async {
        let dir = tempfile::tempdir().unwrap();
        let (_d, socket, admin) = daemon(dir.path()).await;
        let _open = traffic(&socket).await;

        let (code, out, err) = status(&[], &socket).await;
        assert_eq!(code, Some(0), "{err}");
        let at = out
            .find("scope chat tenants: 3 tracked here (max 100000), fair turns vtc")
            .unwrap_or_else(|| panic!("no tenants table:\n{out}"));
        assert!(!out.contains("scope emb tenants"), "{out}");
        let table: Vec<&str> = out[at..].lines().skip(1).take(5).collect();
        let first = |l: &str| l.split_whitespace().next().unwrap_or("").to_string();
        let names: Vec<String> = table.iter().map(|l| first(l)).collect();
        // Best spender first: acme $0.0007, globex $0.0006, the hostile id $0.00002.
        assert_eq!(
            names,
            ["TENANT", "acme", "globex", "\"ev\\\"il\\\\\\nid\"", "(all"],
            "{out}"
        );
        assert_eq!(
            table[1].split_whitespace().skip(1).collect::<Vec<_>>(),
            ["1", "1", "2", "0", "150", "$0.0007"],
            "acme: calls, in flight, grants, refused, tokens, spent"
        );
        // The totals: every tenant's figures summed (the anonymous call is no tenant's).
        assert_eq!(
            table[4].split_whitespace().skip(2).collect::<Vec<_>>(),
            ["1", "1", "4", "0", "460", "$0.00132"],
            "{out}"
        );

        // /metrics on the daemon's admin listener: tenant_metrics_top = 1.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut m = String::new();
        s.read_to_string(&mut m).await.unwrap();
        let tenant_lines: Vec<&str> = m
            .lines()
            .filter(|l| l.starts_with("polygate_tenant_tokens_total{"))
            .collect();
        assert_eq!(
            tenant_lines,
            ["polygate_tenant_tokens_total{scope=\"chat\",tenant=\"acme\"} 150"],
            "{m}"
        );
        assert!(
            m.lines()
                .any(|l| l == "polygate_tenants_tokens_total{scope=\"chat\"} 460"),
            "{m}"
        );
    })
    .await
    .expect("test timed out");
}
