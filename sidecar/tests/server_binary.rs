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
use polygate::config::parse::parse_str;
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

#[tokio::test(flavor = "multi_thread")]
async fn status_command_prints_every_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let config = parse_str(&config(&path), std::iter::empty()).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    let backend = MemoryBackend::new(clock.clone(), ["primary", "fallback"]);
    let engine = Engine::new(&config, backend, clock);
    let listener = UnixListener::bind(&path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server::run(
        listener,
        engine,
        ServerOptions::from_config(&config.sidecar),
        async move {
            let _ = stopped.await;
        },
    ));

    let out = tokio::task::spawn_blocking({
        let path = path.clone();
        move || {
            sidecar()
                .arg("status")
                .arg("--socket")
                .arg(&path)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
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

    let mut framed = Framed::new(stream, ClientCodec::new(1 << 20));
    framed
        .send(ClientFrame {
            id: 1,
            request: Request::Hello {
                protocol_version: PROTOCOL_VERSION,
                client_name: "binary-test".into(),
                pid: std::process::id(),
            },
        })
        .await
        .unwrap();
    let welcome = framed.next().await.unwrap().unwrap();
    assert!(
        matches!(welcome.reply, Reply::Welcome { .. }),
        "{welcome:?}"
    );
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
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&path).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "daemon did not replace the stale socket"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
