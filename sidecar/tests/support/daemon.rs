//! The real `polygate-sidecar` binary as a test subject: started on a config in a
//! private temp dir, its stderr (the log) captured in a file, its memory (RSS) and
//! open fds read from `/proc`, and a raw wire client for it. Used where a bound is
//! about the process itself (memory returned, log lines, fds) rather than the engine.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{ClientCodec, ClientFrame, FrameError, Reply, Request, ServerFrame};
use tokio::net::UnixStream;
use tokio_util::codec::Framed;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_polygate-sidecar");

/// How long a started daemon may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One running daemon; killed when dropped.
pub struct Daemon {
    /// The process.
    pub child: Child,
    /// Holds the config, the socket and the log; removed on drop.
    pub dir: tempfile::TempDir,
    /// The worker socket.
    pub socket: PathBuf,
    /// The captured stderr.
    pub log: PathBuf,
}

/// A command for the binary with no override-looking variables inherited.
pub fn sidecar_command() -> Command {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.contains("__") {
            cmd.env_remove(k);
        }
    }
    cmd.env_remove("POLYGATE_SOCKET")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("LISTEN_FDS")
        .env_remove("RUST_LOG")
        .env_remove("JOURNAL_STREAM");
    cmd
}

impl Daemon {
    /// Start on `[sidecar]` lines `sidecar` (the socket is added) and the scope tables
    /// `scopes`, with extra environment `env`; returns once the socket accepts.
    pub fn start(sidecar: &str, scopes: &str, env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("sidecar.sock");
        let log = dir.path().join("stderr.log");
        let config = dir.path().join("polygate.toml");
        // `socket_mode` defaults to 0600 here unless the test sets its own.
        let mode = match sidecar.contains("socket_mode") {
            true => "",
            false => "socket_mode = \"0600\"\n",
        };
        std::fs::write(
            &config,
            format!(
                "[sidecar]\nsocket = \"{}\"\n{mode}shutdown_grace = \"1s\"\n{sidecar}\n\n{scopes}\n",
                socket.display()
            ),
        )
        .expect("write config");
        let mut cmd = sidecar_command();
        cmd.arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn the sidecar");
        let mut d = Daemon {
            child,
            dir,
            socket,
            log,
        };
        d.wait_listening();
        d
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "the sidecar exited at start ({status}): {}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the sidecar did not listen within {START_TIMEOUT:?}: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory in KiB (`VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// Open file descriptors.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Everything logged so far.
    pub fn log_text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// Still running?
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// SIGTERM, then wait (bounded) for the exit. The temp dir (log, socket path)
    /// stays until the `Daemon` is dropped.
    pub fn stop(&mut self) -> ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            assert!(Instant::now() < deadline, "no exit within 20 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A raw wire client (no binding).
pub struct Client {
    /// The framed socket.
    pub framed: Framed<UnixStream, ClientCodec>,
    /// The id of the last request sent by [`Client::call`].
    pub next_id: u64,
}

/// How long a client waits for one expected reply.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

impl Client {
    /// Connected, nothing sent; accepts replies up to 16 MiB.
    pub async fn raw(path: &Path) -> std::io::Result<Client> {
        let stream = UnixStream::connect(path).await?;
        Ok(Client {
            framed: Framed::new(stream, ClientCodec::new(ipc_protocol::codec::DECODE_LIMIT)),
            next_id: 1,
        })
    }

    /// Connected and greeted with protocol `version`.
    pub async fn connect(path: &Path, version: u32) -> Client {
        let mut c = Self::raw(path).await.expect("connect");
        match c.call(hello(version)).await {
            Reply::Welcome { .. } => c,
            other => panic!("expected Welcome, got {other:?}"),
        }
    }

    /// Send one frame; the error if the sidecar already closed (a refused connection).
    pub async fn try_send(&mut self, id: u64, request: Request) -> Result<(), FrameError> {
        self.framed.send(ClientFrame { id, request }).await
    }

    /// Send one frame.
    pub async fn send(&mut self, id: u64, request: Request) {
        self.framed
            .send(ClientFrame { id, request })
            .await
            .expect("send");
    }

    /// The next frame (panics on a close or after [`REPLY_TIMEOUT`]).
    pub async fn recv(&mut self) -> ServerFrame {
        match tokio::time::timeout(REPLY_TIMEOUT, self.framed.next()).await {
            Ok(Some(Ok(f))) => f,
            Ok(other) => panic!("expected a frame, got {other:?}"),
            Err(_) => panic!("no reply within {REPLY_TIMEOUT:?}"),
        }
    }

    /// Send with a fresh id and wait for its reply.
    pub async fn call(&mut self, request: Request) -> Reply {
        self.next_id += 1;
        let id = self.next_id;
        self.send(id, request).await;
        loop {
            let f = self.recv().await;
            if f.id == id {
                return f.reply;
            }
        }
    }
}

/// A `Hello` of `version`.
pub fn hello(version: u32) -> Request {
    Request::Hello {
        protocol_version: version,
        client_name: "hardening-test".into(),
        pid: std::process::id(),
    }
}
