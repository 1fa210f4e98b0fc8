//! The real `polygate-sidecar` binary: `--check-config`, the `status` client, and the
//! daemon's lifecycle (bind, serve, SIGTERM, socket removed).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{ClientCodec, ClientFrame, Reply, Request, PROTOCOL_VERSION};
use polygate::backend::memory::MemoryBackend;
use polygate::clock::{Clock, TokioClock};
use polygate::config::parse_str;
use polygate::engine::Engine;
use polygate::server::{self, ServerOptions};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::Framed;

const BIN: &str = env!("CARGO_BIN_EXE_polygate-sidecar");

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

fn config(socket: &Path) -> String {
    format!(
        r#"
[sidecar]
socket = "{}"
socket_mode = "0600"
shutdown_grace = "1s"

[scopes.chat]
[[scopes.chat.sources]]
name = "primary"
tpm = 6000
rpm = 60

[[scopes.chat.sources]]
name = "fallback"
"#,
        socket.display()
    )
}

#[test]
fn check_config_accepts_the_embedded_example() {
    let out = sidecar().arg("--check-config").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.contains("configuration OK"), "{stdout}");
    assert!(stdout.contains("chat"), "{stdout}");
}

#[test]
fn check_config_accepts_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&dir.path().join("s.sock"))).unwrap();
    let out = sidecar()
        .arg("--config")
        .arg(&file)
        .arg("--check-config")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("chat (2 sources)"), "{stdout}");
}

#[test]
fn invalid_env_override_fails_naming_the_variable() {
    for check in [true, false] {
        let mut cmd = sidecar();
        cmd.env("CHAT__CIRCUIT_OPEN", "sometimes");
        if check {
            cmd.arg("--check-config");
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "check={check}: {out:?}");
        assert!(stderr.contains("CHAT__CIRCUIT_OPEN"), "{stderr}");
        assert!(
            stderr.contains("fail_fast"),
            "allowed values named: {stderr}"
        );
    }
}

#[test]
fn invalid_config_file_fails_with_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[scopes.chat]\nmax_attempts = 0\n[[scopes.chat.sources]]\nname = \"x\"\n",
    )
    .unwrap();
    let out = sidecar()
        .arg("--config")
        .arg(&file)
        .arg("--check-config")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("max_attempts"), "{stderr}");
}

/// An in-process server on `path` for configuration `text` (memory backend); stop it
/// by sending on the returned channel.
fn serve_in_process(
    path: &Path,
    text: &str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), server::ServerError>>,
) {
    let config = parse_str(text, std::iter::empty()).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let names: Vec<String> = config
        .scopes
        .iter()
        .flat_map(|s| s.sources.iter().map(|x| x.name.clone()))
        .collect();
    let backend = MemoryBackend::new(clock.clone(), names);
    let engine = Engine::new(&config, backend, clock);
    let listener = UnixListener::bind(path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server::run(
        listener,
        engine,
        ServerOptions::from_config(&config.sidecar),
        async move {
            let _ = stopped.await;
        },
    ));
    (stop, task)
}

/// `polygate-sidecar status ARGS --socket PATH`, run off the runtime's threads.
async fn status_command(args: &[&str], path: &Path) -> std::process::Output {
    let mut cmd = sidecar();
    cmd.arg("status").args(args).arg("--socket").arg(path);
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn status_command_prints_every_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let (stop, task) = serve_in_process(&path, &config(&path));
    let out = status_command(&[], &path).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("backend: memory"), "{stdout}");
    assert!(stdout.contains("scope chat"), "{stdout}");
    for word in ["primary", "fallback", "STATE", "closed", "PACER", "TOKENS"] {
        assert!(stdout.contains(word), "{word:?} missing:\n{stdout}");
    }

    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

/// `status | head -1`: the reader is gone before the output is written (a pipe whose
/// read end is closed, so every write fails with EPIPE). The command ends quietly with
/// success, never a panic (exit 101, "failed printing to stdout"); 20 runs of each form.
#[tokio::test(flavor = "multi_thread")]
async fn status_command_ends_quietly_on_a_closed_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let (stop, task) = serve_in_process(&path, &config(&path));
    for run in 0..20 {
        let args: &[&str] = if run % 2 == 0 { &[] } else { &["--json"] };
        let mut cmd = sidecar();
        cmd.arg("status").args(args).arg("--socket").arg(&path);
        let out = tokio::task::spawn_blocking(move || {
            let (read, write) = nix::unistd::pipe().unwrap();
            drop(read);
            cmd.stdout(Stdio::from(write)).stderr(Stdio::piped());
            let child = cmd.spawn().unwrap();
            drop(cmd);
            child.wait_with_output().unwrap()
        });
        let out = tokio::time::timeout(Duration::from_secs(20), out)
            .await
            .expect("status ends")
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "run {run} {args:?}: {stderr}"
        );
        assert_eq!(out.status.code(), Some(0), "run {run} {args:?}: {out:?}");
    }
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn status_json_names_every_scope_and_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let text = format!(
        "{}\n[scopes.emb]\n[[scopes.emb.sources]]\nname = \"embedder\"\n\n\
         [[scopes.emb.sources]]\nname = \"primary\"\ntpm = 6000\nrpm = 60\n",
        config(&path)
    );
    let (stop, task) = serve_in_process(&path, &text);
    let out = status_command(&["--json"], &path).await;
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.lines().count(),
        1,
        "one document, one line: {stdout}"
    );
    let doc: serde_json::Value = serde_json::from_str(&stdout).expect("status --json parses");
    assert_eq!(doc["backend"], "memory");
    assert_eq!(doc["protocol_version"], PROTOCOL_VERSION);
    let scopes: Vec<(&str, Vec<&str>)> = doc["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|sc| {
            let sources = sc["sources"].as_array().unwrap();
            let names = sources
                .iter()
                .map(|s| s["name"].as_str().unwrap())
                .collect();
            (sc["name"].as_str().unwrap(), names)
        })
        .collect();
    assert_eq!(
        scopes,
        vec![
            ("chat", vec!["primary", "fallback"]),
            ("emb", vec!["embedder", "primary"]),
        ]
    );
    let primary = &doc["scopes"][0]["sources"][0];
    assert_eq!(primary["state"], "closed");
    assert_eq!(primary["tokens_available"], 6000.0);
    assert!(primary["requests_available"].is_number());
    assert!(doc["scopes"][0]["sources"][1]["tokens_available"].is_null());

    stop.send(()).unwrap();
    task.await.unwrap().unwrap();

    // The same errors and exit status as the table: an unreachable socket is 1.
    let out = sidecar()
        .args(["status", "--json", "--socket", "/nonexistent/polygate.sock"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/polygate.sock"));
}

#[test]
fn version_names_the_protocol_versions() {
    let out = sidecar().arg("--version").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let expected = format!(
        "polygate-sidecar {} (protocol versions {}-{})",
        env!("CARGO_PKG_VERSION"),
        ipc_protocol::MIN_PROTOCOL_VERSION,
        PROTOCOL_VERSION
    );
    assert_eq!(stdout.trim_end(), expected);
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_are_one_json_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&path)).unwrap();
    for (how, set) in [("file", true), ("env", false)] {
        let text = if set {
            config(&path).replace("[sidecar]\n", "[sidecar]\nlog_format = \"json\"\n")
        } else {
            config(&path)
        };
        std::fs::write(&file, text).unwrap();
        let mut cmd = sidecar();
        cmd.arg("--config").arg(&file);
        if !set {
            cmd.env("SIDECAR__LOG_FORMAT", "json");
        }
        let mut daemon = Daemon::spawn(&mut cmd);
        let deadline = Instant::now() + Duration::from_secs(10);
        while UnixStream::connect(&path).await.is_err() {
            assert!(Instant::now() < deadline, "{how}: never listened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        daemon.signal(nix::sys::signal::Signal::SIGTERM);
        let status = daemon.exit_within(Duration::from_secs(5)).await;
        assert!(status.is_some_and(|s| s.success()), "{how}: {status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await; // the reader thread drains
        let stderr = daemon.stderr();
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(lines.len() >= 3, "{how}: {stderr}");
        let mut messages = Vec::new();
        for line in &lines {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{how}: not JSON ({e}): {line:?}"));
            assert!(v["level"].is_string(), "{how}: {line}");
            assert!(v["fields"].is_object(), "{how}: {line}");
            messages.push(v["fields"]["message"].as_str().unwrap().to_string());
        }
        assert!(
            messages.iter().any(|m| m == "polygate-sidecar ready"),
            "{messages:?}"
        );
        assert!(
            messages.iter().any(|m| m.contains("SIGTERM")),
            "{messages:?}"
        );
    }
    // A bad value names the variable and the allowed values.
    let out = sidecar()
        .arg("--config")
        .arg(&file)
        .arg("--check-config")
        .env("SIDECAR__LOG_FORMAT", "xml")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("SIDECAR__LOG_FORMAT") && stderr.contains("text, json"),
        "{stderr}"
    );
}

#[test]
fn status_command_reports_an_unreachable_socket() {
    let out = sidecar()
        .args(["status", "--socket", "/nonexistent/polygate.sock"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/polygate.sock"));
}

#[tokio::test(flavor = "multi_thread")]
async fn daemon_serves_then_exits_cleanly_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    // The socket's directory does not exist yet: the daemon creates it.
    let path = dir.path().join("run").join("sidecar.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&path)).unwrap();
    let mut child = sidecar()
        .arg("--config")
        .arg(&file)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(10);
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&path).await {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "daemon never listened on {path:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket_mode applied");

    let mut framed = hello(stream, "binary-test").await;
    framed
        .send(ClientFrame {
            id: 2,
            request: Request::Ping,
        })
        .await
        .unwrap();
    assert_eq!(framed.next().await.unwrap().unwrap().reply, Reply::Pong);

    let started = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    // The idle connection is closed by the shutdown.
    let end = tokio::time::timeout(Duration::from_secs(5), framed.next())
        .await
        .expect("connection closed on shutdown");
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
    let status = tokio::task::spawn_blocking(move || {
        let s = child.wait().unwrap();
        let mut err = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (s, err)
    })
    .await
    .unwrap();
    let (status, stderr) = status;
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "exit within grace + a little: {:?}",
        started.elapsed()
    );
    assert!(!path.exists(), "socket file removed on exit");
    assert!(stderr.contains("SIGTERM"), "{stderr}");

    // A stale socket file (nobody listening) is replaced on the next start.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let mut child = sidecar()
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    listening(&path, "daemon did not replace the stale socket").await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// Wait (at most 10 s) until a daemon accepts connections on `path`; `what` is
/// the failure.
async fn listening(path: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(path).await.is_err() {
        assert!(Instant::now() < deadline, "{what}: {path:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Say Hello on `stream` as `name`; the framed connection, welcomed.
async fn hello(stream: UnixStream, name: &str) -> Framed<UnixStream, ClientCodec> {
    let mut framed = Framed::new(stream, ClientCodec::new(1 << 20));
    framed
        .send(ClientFrame {
            id: 1,
            request: Request::Hello {
                protocol_version: PROTOCOL_VERSION,
                client_name: name.into(),
                pid: std::process::id(),
            },
        })
        .await
        .unwrap();
    let welcome = tokio::time::timeout(Duration::from_secs(5), framed.next())
        .await
        .expect("a Welcome within 5 s")
        .unwrap()
        .unwrap();
    assert!(
        matches!(welcome.reply, Reply::Welcome { .. }),
        "{welcome:?}"
    );
    framed
}

// ---------------------------------------------------------------------------------
// Lifecycle with the admin listener and systemd notifications.

/// A free TCP port on 127.0.0.1 (bound, then released for the daemon).
fn free_admin_addr() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The test configuration with `admin_listen` and a long shutdown grace.
fn admin_config(socket: &Path, admin: std::net::SocketAddr, grace: &str) -> String {
    config(socket).replace(
        "shutdown_grace = \"1s\"",
        &format!("shutdown_grace = \"{grace}\"\nadmin_listen = \"{admin}\""),
    )
}

/// A running daemon: killed on drop; stderr collected as it comes.
struct Daemon {
    child: std::process::Child,
    stderr: Arc<std::sync::Mutex<String>>,
}

impl Daemon {
    fn spawn(cmd: &mut Command) -> Daemon {
        let mut child = cmd
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(std::sync::Mutex::new(String::new()));
        let mut pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut chunk = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&chunk[..n]));
            }
        });
        Daemon { child, stderr }
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The exit status, if the process exits within `limit`.
    async fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, and the process must exit cleanly within 5 s.
    async fn terminate(&mut self) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let status = self.exit_within(Duration::from_secs(5)).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "{status:?}: {}",
            self.stderr()
        );
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The notification socket a daemon is pointed at with `$NOTIFY_SOCKET`.
struct Notifications(tokio::net::UnixDatagram);

impl Notifications {
    fn bind(path: &Path) -> Self {
        Notifications(tokio::net::UnixDatagram::bind(path).unwrap())
    }

    /// The next message, if one comes within `limit`.
    async fn next(&self, limit: Duration) -> Option<String> {
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(limit, self.0.recv(&mut buf))
            .await
            .ok()?
            .unwrap();
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }
}

/// `GET path` on the admin listener: the status code.
async fn admin_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    out.get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {out:?}")))
}

/// Connect to the worker socket, say Hello, and take a permit for a `chat` call.
async fn client_with_a_permit(path: &Path) -> (Framed<UnixStream, ClientCodec>, u64) {
    let stream = UnixStream::connect(path).await.unwrap();
    let mut framed = Framed::new(stream, ClientCodec::new(1 << 20));
    let mut ask = async |id: u64, request: Request| {
        framed.send(ClientFrame { id, request }).await.unwrap();
        let f = tokio::time::timeout(Duration::from_secs(5), framed.next())
            .await
            .expect("a reply")
            .unwrap()
            .unwrap();
        assert_eq!(f.id, id);
        f.reply
    };
    let hello = Request::Hello {
        protocol_version: PROTOCOL_VERSION,
        client_name: "binary-test".into(),
        pid: std::process::id(),
    };
    assert!(matches!(ask(1, hello).await, Reply::Welcome { .. }));
    let begin = Request::BeginCall {
        scope: "chat".into(),
        est_tokens: None,
    };
    let Reply::CallBegun { call } = ask(2, begin).await else {
        panic!("no call")
    };
    let Reply::Granted { permit, .. } = ask(3, Request::Acquire { call }).await else {
        panic!("no permit")
    };
    (framed, permit)
}

#[tokio::test(flavor = "multi_thread")]
async fn ready_answers_503_during_the_drain_and_sighup_is_ignored_once_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sidecar.sock");
    let admin = free_admin_addr();
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, admin_config(&path, admin, "10s")).unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notes = Notifications::bind(&notify_path);
    let mut daemon = Daemon::spawn(
        sidecar()
            .arg("--config")
            .arg(&file)
            .env("NOTIFY_SOCKET", &notify_path),
    );
    assert_eq!(
        notes.next(Duration::from_secs(10)).await.as_deref(),
        Some("READY=1"),
        "{}",
        daemon.stderr()
    );
    let (mut framed, permit) = client_with_a_permit(&path).await;
    assert_eq!(admin_get(admin, "/ready").await.unwrap(), 200);

    // SIGTERM with a permit out: the daemon drains, and the admin listener says so.
    let started = Instant::now();
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(
        notes.next(Duration::from_secs(5)).await.as_deref(),
        Some("STOPPING=1")
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match admin_get(admin, "/ready").await {
            Ok(503) => break,
            Ok(200) if Instant::now() < deadline => {}
            other => panic!("/ready during the drain: {other:?}\n{}", daemon.stderr()),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(admin_get(admin, "/live").await.unwrap(), 200);

    // A SIGHUP now reloads nothing and never tells systemd READY=1 again.
    daemon.signal(nix::sys::signal::Signal::SIGHUP);
    let late = notes.next(Duration::from_millis(500)).await;
    assert_eq!(late, None, "notification after STOPPING=1");
    assert_eq!(admin_get(admin, "/ready").await.unwrap(), 503);

    // Reporting the permit ends the drain: the connection closes, the daemon exits.
    framed
        .send(ClientFrame {
            id: 4,
            request: Request::Report {
                permit,
                outcome: ipc_protocol::Outcome::Cancelled,
            },
        })
        .await
        .unwrap();
    let status = daemon.exit_within(Duration::from_secs(5)).await;
    let stderr = daemon.stderr();
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "exited after the drain, not the 10 s grace: {:?}",
        started.elapsed()
    );
    assert!(stderr.contains("not reloading"), "{stderr}");
    assert!(!stderr.contains("configuration reloaded"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_signal_during_the_drain_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sidecar.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(
        &file,
        config(&path).replace("shutdown_grace = \"1s\"", "shutdown_grace = \"20s\""),
    )
    .unwrap();
    let mut daemon = Daemon::spawn(sidecar().arg("--config").arg(&file));
    listening(&path, "daemon never listened").await;
    let (_framed, _permit) = client_with_a_permit(&path).await;

    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    // Draining: the permit keeps it going.
    assert_eq!(daemon.exit_within(Duration::from_millis(500)).await, None);
    let started = Instant::now();
    daemon.signal(nix::sys::signal::Signal::SIGINT);
    let status = daemon.exit_within(Duration::from_secs(3)).await;
    let stderr = daemon.stderr();
    assert!(
        status.is_some(),
        "still running 3 s after a second signal\n{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(stderr.contains("SIGINT again while draining"), "{stderr}");
    assert!(!path.exists(), "socket file removed on exit");
}

#[test]
fn a_taken_admin_address_fails_before_the_worker_socket_exists() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run").join("sidecar.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(
        &file,
        admin_config(&path, taken.local_addr().unwrap(), "1s"),
    )
    .unwrap();
    let out = sidecar()
        .arg("--config")
        .arg(&file)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(stderr.contains("admin_listen"), "{stderr}");
    assert!(
        !stderr.contains("listening"),
        "worker socket bound first:\n{stderr}"
    );
    assert!(
        !dir.path().join("run").exists(),
        "the worker socket's directory was created"
    );
    drop(taken);
}

/// Socket activation as systemd does it, with two sockets passed in the "wrong"
/// order and named by `LISTEN_FDNAMES`: the daemon serves workers on the one named
/// `worker` and the admin HTTP on the one named `admin`, binds nothing itself, and
/// leaves the socket file (systemd's) in place on exit.
#[tokio::test(flavor = "multi_thread")]
async fn socket_activation_takes_the_named_sockets() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("activated.sock");
    let unused = dir.path().join("never-bound.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&unused)).unwrap();
    let worker = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let (w, a) = (worker.as_raw_fd(), admin.as_raw_fd());
    let mut cmd = Command::new("/bin/sh");
    // `exec` keeps the shell's pid, so LISTEN_PID=$$ names the daemon.
    cmd.arg("-c")
        .arg(format!(
            "LISTEN_PID=$$ exec {BIN} --config {}",
            file.display()
        ))
        .env("LISTEN_FDS", "2")
        .env("LISTEN_FDNAMES", "admin:worker")
        .env_remove("NOTIFY_SOCKET");
    // SAFETY: dup2 is async-signal-safe; only the two inherited fds are touched.
    unsafe {
        cmd.pre_exec(move || {
            for (from, to) in [(a, 3), (w, 4)] {
                if nix::libc::dup2(from, to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut daemon = Daemon::spawn(&mut cmd);
    drop((worker, admin)); // the daemon holds its copies

    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Ok(code) = admin_get(admin_addr, "/live").await {
            break code;
        }
        assert!(
            Instant::now() < deadline,
            "no admin listener: {}",
            daemon.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(code, 200);
    let framed = hello(UnixStream::connect(&path).await.unwrap(), "activation-test").await;
    assert!(!unused.exists(), "bound a socket of its own");
    drop(framed);
    daemon.terminate().await;
    assert!(
        path.exists(),
        "the activated socket file is systemd's: left in place"
    );
    assert!(
        daemon.stderr().contains("socket activation"),
        "{}",
        daemon.stderr()
    );
}

/// §20: an autostarted sidecar keeps nothing its starter left open but the lock: the
/// write end of a caller's pipe, inherited on fd 7, is closed at start, so the pipe's
/// reader sees its end (a `cmd | cat` ends) while the sidecar runs on.
#[tokio::test(flavor = "multi_thread")]
async fn an_autostarted_sidecar_closes_the_descriptors_it_inherited() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("auto.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&path)).unwrap();
    // Close-on-exec here, so that no other test's child inherits the write end.
    let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let w = write_end.as_raw_fd();
    let mut cmd = sidecar();
    cmd.arg("--config").arg(&file).arg("--autostarted");
    // SAFETY: dup2 is async-signal-safe; only fd 7 is touched (dup2 leaves the copy
    // without close-on-exec, as an inherited descriptor is).
    unsafe {
        cmd.pre_exec(move || {
            if nix::libc::dup2(w, 7) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let pipe = format!(
        "pipe:[{}]",
        nix::sys::stat::fstat(&write_end).unwrap().st_ino
    );
    let mut daemon = Daemon::spawn(&mut cmd);
    drop(write_end);
    listening(&path, "the autostarted sidecar does not listen").await;
    let pid = daemon.child.id();
    let held: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.as_os_str() == pipe.as_str())
        .collect();
    assert!(
        held.is_empty(),
        "the sidecar still holds the inherited {pipe}: {}",
        daemon.stderr()
    );
    let mut reader = std::fs::File::from(read_end);
    let read = tokio::task::spawn_blocking(move || reader.read(&mut [0u8; 1]));
    let n = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the pipe's end within 5 s")
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "the pipe ended");
    assert!(daemon.child.try_wait().unwrap().is_none(), "still serving");
    daemon.terminate().await;
}

/// §7a: status (table and JSON) shows every configured bucket: level, capacity,
/// refill per second, debt.
#[tokio::test(flavor = "multi_thread")]
async fn status_shows_every_bucket_with_capacity_refill_and_debt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let text = format!(
        "{}\n[scopes.claude]\n[[scopes.claude.sources]]\nname = \"anthropic\"\nrpm = 60\n\
         itpm = 6000\notpm = 1200\nburst = \"1s\"\nrpd = 1000\n",
        config(&path)
    );
    let (stop, task) = serve_in_process(&path, &text);
    let out = status_command(&["--json"], &path).await;
    assert!(out.status.success(), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let src = &doc["scopes"][1]["sources"][0];
    assert_eq!(src["name"], "anthropic");
    let buckets = src["buckets"].as_array().unwrap();
    let names: Vec<&str> = buckets
        .iter()
        .map(|b| b["bucket"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rpm", "itpm", "otpm", "rpd"]);
    let by = |n: &str| buckets.iter().find(|b| b["bucket"] == n).unwrap();
    assert_eq!(by("rpm")["capacity"], 1, "60 rpm over a 1 s burst");
    assert_eq!(by("rpm")["level"], 1.0, "starts full");
    assert_eq!(by("itpm")["capacity"], 100);
    assert_eq!(by("otpm")["refill_per_s"], 20.0);
    assert_eq!(by("rpd")["capacity"], 1000, "burst does not apply per day");
    assert_eq!(by("otpm")["debt"], 0.0);
    // The default source shows §7's two buckets at a minute's worth.
    let primary = &doc["scopes"][0]["sources"][0]["buckets"];
    assert_eq!(primary[0]["bucket"], "tpm");
    assert_eq!(primary[0]["capacity"], 6000);
    assert_eq!(primary[1]["refill_per_s"], 1.0);
    let out = status_command(&[], &path).await;
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("scope claude quota buckets:"), "{stdout}");
    let otpm = stdout.lines().find(|l| l.contains("otpm")).unwrap();
    for cell in ["anthropic", "20", "20.000"] {
        assert!(otpm.contains(cell), "{cell:?} missing from {otpm:?}");
    }
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

/// `sidecar.worker_threads`: by default (1) the daemon serves calls on a single
/// thread (the current-thread runtime); with 2 it runs two runtime workers beside
/// the main thread.
#[tokio::test(flavor = "multi_thread")]
async fn worker_threads_sets_the_runtime_threads() {
    for (line, expected) in [("", 1usize), ("worker_threads = 2", 3)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sidecar.sock");
        let file = dir.path().join("polygate.toml");
        let cfg = config(&path).replace(
            "shutdown_grace = \"1s\"",
            &format!("shutdown_grace = \"1s\"\n{line}"),
        );
        std::fs::write(&file, cfg).unwrap();
        let mut daemon = Daemon::spawn(sidecar().arg("--config").arg(&file));
        listening(&path, "daemon never listened").await;
        // A whole call is served (begin, acquire; the permit is given back on close).
        let (framed, permit) = client_with_a_permit(&path).await;
        assert_ne!(permit, 0);
        drop(framed);
        let runtime_threads = std::fs::read_dir(format!("/proc/{}/task", daemon.child.id()))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| {
                let name = name.trim();
                name == "tokio-rt-worker" || name == "polygate-sideca"
            })
            .count();
        // The main thread runs a current-thread runtime itself; with workers it
        // blocks in `block_on` beside them (named tokio-rt-worker).
        assert_eq!(runtime_threads, expected, "config line {line:?}");
        daemon.terminate().await;
    }
}

/// §12: a non-root sidecar with no `socket` key listens on
/// `$XDG_RUNTIME_DIR/polygate/sidecar.sock`, and `status` of the same user, told
/// nothing, finds it there. Needs root (to drop to uid 65534) and `setpriv`.
#[tokio::test(flavor = "multi_thread")]
async fn non_root_sidecar_and_status_meet_on_the_xdg_runtime_dir_default() {
    use std::os::unix::fs::PermissionsExt;
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    let Some(setpriv) = setpriv else {
        eprintln!("SKIPPED: setpriv (util-linux) not found; the non-root default is not tested");
        return;
    };
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root, cannot drop to uid 65534 with setpriv");
        return;
    }
    const NOBODY: u32 = 65534;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let xdg = dir.path().join("xdg");
    std::fs::create_dir(&xdg).unwrap();
    std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700)).unwrap();
    nix::unistd::chown(&xdg, Some(NOBODY.into()), Some(NOBODY.into())).unwrap();
    let file = dir.path().join("polygate.toml");
    std::fs::write(
        &file,
        "[sidecar]\nshutdown_grace = \"1s\"\n\n[[scopes.chat.sources]]\nname = \"a\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let as_nobody = |args: &[&str]| {
        let mut cmd = Command::new(setpriv);
        cmd.args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            BIN,
        ])
        .args(args);
        for (k, _) in std::env::vars() {
            if k.contains("__") {
                cmd.env_remove(k);
            }
        }
        cmd.env_remove("POLYGATE_SOCKET")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("LISTEN_FDS")
            .env("XDG_RUNTIME_DIR", &xdg);
        cmd
    };
    let config = file.to_str().unwrap();
    let mut daemon = Daemon::spawn(&mut as_nobody(&["--config", config]));
    let socket = xdg.join("polygate").join("sidecar.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "never listened on {}: {}",
            socket.display(),
            daemon.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), NOBODY);
    let mut status = as_nobody(&["status"]);
    let out = tokio::task::spawn_blocking(move || status.output().unwrap())
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}\n{}", daemon.stderr());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("scope chat"),
        "{out:?}"
    );

    // Without XDG_RUNTIME_DIR the non-root default does not exist: both ends say
    // what to set instead of failing on /run/polygate with "Permission denied".
    let mut status = as_nobody(&["status"]);
    status.env_remove("XDG_RUNTIME_DIR");
    let out = status.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr.contains("XDG_RUNTIME_DIR") && stderr.contains("POLYGATE_SOCKET"),
        "{stderr}"
    );
    let mut check = as_nobody(&["--config", config, "--check-config"]);
    check.env_remove("XDG_RUNTIME_DIR");
    let out = check.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(stderr.contains("[sidecar] socket"), "{stderr}");

    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let st = daemon.exit_within(Duration::from_secs(5)).await;
    assert!(
        st.is_some_and(|s| s.success()),
        "{st:?}: {}",
        daemon.stderr()
    );
    assert!(!socket.exists(), "socket removed on exit");
}

/// §12: a permission error names the setting to change, on both sides.
#[test]
fn permission_errors_name_the_setting_to_change() {
    if !nix::unistd::geteuid().is_root() || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("SKIPPED: needs root and /usr/bin/setpriv to act as another user");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.path().join("polygate.toml");
    // A directory uid 65534 cannot create (its parent belongs to root, 0755).
    let socket = dir.path().join("run").join("s.sock");
    std::fs::write(
        &file,
        format!(
            "[sidecar]\nsocket = \"{}\"\n\n[[scopes.chat.sources]]\nname = \"a\"\n",
            socket.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("/usr/bin/setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            BIN,
            "--config",
        ])
        .arg(&file)
        .env_remove("SIDECAR__SOCKET")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("Permission denied") && stderr.contains("[sidecar] socket"),
        "{stderr}"
    );

    // The client side: a socket this user may not open.
    let sock_dir = dir.path().join("private");
    std::fs::create_dir(&sock_dir).unwrap();
    std::fs::set_permissions(&sock_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let path = sock_dir.join("s.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let out = Command::new("/usr/bin/setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            BIN,
            "status",
            "--socket",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        stderr.contains("Permission denied") && stderr.contains("POLYGATE_SOCKET"),
        "{stderr}"
    );
}

/// A SIGHUP with an invalid file logs which file is invalid (and the running
/// configuration stays: the daemon keeps serving).
#[tokio::test(flavor = "multi_thread")]
async fn sighup_with_an_invalid_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&path)).unwrap();
    let mut daemon = Daemon::spawn(sidecar().arg("--config").arg(&file));
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&path).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "never listened: {}",
            daemon.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::write(&file, config(&path).replace("rpm = 60", "rpm = -1")).unwrap();
    daemon.signal(nix::sys::signal::Signal::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let log = daemon.stderr();
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("SIGHUP") && l.contains("invalid"))
        {
            break l.to_string();
        }
        assert!(Instant::now() < deadline, "no reload error logged: {log}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(line.contains(&file.display().to_string()), "{line}");
    assert!(line.contains("rpm = -1 (line"), "{line}");
    assert!(UnixStream::connect(&path).await.is_ok(), "still serving");
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let st = daemon.exit_within(Duration::from_secs(5)).await;
    assert!(st.is_some_and(|s| s.success()), "{st:?}");
}

/// `health` (the container's HEALTHCHECK): 0 while /ready answers 200, 1 when
/// nothing listens, 2 when it has no address to probe.
#[tokio::test(flavor = "multi_thread")]
async fn health_probes_the_admin_listener() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let admin = free_admin_addr();
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, admin_config(&path, admin, "1s")).unwrap();
    let mut daemon = Daemon::spawn(sidecar().arg("--config").arg(&file));
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_get(admin, "/ready").await.ok() != Some(200) {
        assert!(
            Instant::now() < deadline,
            "never ready: {}",
            daemon.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run = |args: Vec<String>| async move {
        let mut cmd = sidecar();
        cmd.args(args);
        tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap()
    };
    let out = run(vec!["health".into(), "--admin".into(), admin.to_string()]).await;
    assert!(out.status.success(), "{out:?}");
    // The address from the --config file.
    let out = run(vec![
        "--config".into(),
        file.display().to_string(),
        "health".into(),
        "--path".into(),
        "/live".into(),
    ])
    .await;
    assert!(out.status.success(), "{out:?}");
    let out = run(vec![
        "health".into(),
        "--path".into(),
        "/nope".into(),
        "--admin".into(),
        admin.to_string(),
    ])
    .await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("404"),
        "{out:?}"
    );

    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let st = daemon.exit_within(Duration::from_secs(5)).await;
    assert!(st.is_some_and(|s| s.success()), "{st:?}");
    let out = run(vec!["health".into(), "--admin".into(), admin.to_string()]).await;
    assert_eq!(out.status.code(), Some(1), "nothing listens: {out:?}");

    let out = run(vec!["health".into()]).await; // embedded example: no admin_listen
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("admin_listen"),
        "{out:?}"
    );
}

/// §20: `--autostarted` holds SOCKET.lock for its life (a second one exits 75 and
/// leaves the first alone), stays while a connection is open, exits within
/// `idle_exit` (+ one tick) after the last one closes, and removes socket and lock.
#[tokio::test(flavor = "multi_thread")]
async fn an_autostarted_sidecar_holds_its_lock_and_exits_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run").join("sidecar.sock");
    let lock = dir.path().join("run").join("sidecar.sock.lock");
    let file = dir.path().join("polygate.toml");
    std::fs::write(&file, config(&path)).unwrap();
    let start = move || {
        let mut cmd = sidecar();
        cmd.arg("--config")
            .arg(&file)
            .arg("--autostarted")
            .env("SIDECAR__IDLE_EXIT", "700ms")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd
    };
    let start2 = start.clone();
    let mut child = start().spawn().unwrap();
    listening(&path, "the autostarted sidecar never listened").await;
    assert!(lock.exists(), "the lock file sits beside the socket");

    let second = tokio::task::spawn_blocking(move || start2().output().unwrap())
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(75), "{err}");
    assert!(err.contains("sidecar.sock.lock"), "{err}");
    assert!(
        path.exists() && lock.exists(),
        "the loser leaves both alone"
    );

    let framed = hello(UnixStream::connect(&path).await.unwrap(), "idle-test").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "exited with a connection open"
    );
    drop(framed);
    let closed = Instant::now();
    let (status, stderr) = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut err = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (child.wait().unwrap(), err)
    })
    .await
    .unwrap();
    let took = closed.elapsed();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(2700),
        "exited {took:?} after the last connection closed (idle_exit 700ms)"
    );
    assert!(stderr.contains("idle_exit"), "{stderr}");
    assert!(!path.exists(), "socket removed");
    assert!(!lock.exists(), "lock file removed");
}

/// §20: an autostarted sidecar that took its lock and then cannot start (its admin
/// address is taken) removes the lock file again: nothing is left beside the socket.
#[test]
fn an_autostarted_sidecar_that_fails_to_bind_removes_its_lock_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sidecar.sock");
    let lock = dir.path().join("sidecar.sock.lock");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = sidecar()
        .arg("--autostarted")
        .env("SIDECAR__SOCKET", &path)
        .env(
            "SIDECAR__ADMIN_LISTEN",
            taken.local_addr().unwrap().to_string(),
        )
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&taken.local_addr().unwrap().to_string()),
        "{err}"
    );
    assert!(!lock.exists(), "the lock file was left behind");
    assert!(!path.exists(), "no socket was made");
}
