//! The server fixture of `tests/server.rs`: a real Unix socket in a temp dir, the
//! server started in-process with `server::run` over the programmable
//! [`TestBackend`](super::test_backend::TestBackend), and a client built on
//! `ipc_protocol::ClientCodec`. One way to start a server ([`Setup`]), one client.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{
    ClientCodec, ClientFrame, ErrorKind, ErrorReply, Outcome, Reply, Request, ServerFrame,
    SourceStatus, StatusReport, PROTOCOL_VERSION,
};
use polygate::backend::memory::MemoryBackend;
use polygate::clock::{Clock, TokioClock};
use polygate::config::parse_str;
use polygate::engine::Engine;
use polygate::server::{self, ServerError, ServerOptions, ServerStats};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::codec::Framed;

use super::test_backend::TestBackend;

pub const MAX_FRAME: u32 = 4096;
/// Upper bound for any single expected reply.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

pub fn my_uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

/// A uid that is not ours.
pub fn other_uid() -> u32 {
    my_uid().wrapping_add(4242)
}

/// Scopes: `chat` (fail-fast, sources a and b) and `slow` (circuit_open = wait,
/// source s1), plus whatever `[sidecar]` lines the test adds.
pub fn config_toml(sidecar: &str) -> String {
    format!(
        r#"
[sidecar]
max_frame = {MAX_FRAME}
shutdown_grace = "2s"
{sidecar}

[scopes.chat]
circuit_open = "fail_fast"
quota_full = "fail_fast"

[[scopes.chat.sources]]
name = "a"
timeout = "10s"

[[scopes.chat.sources]]
name = "b"
timeout = "10s"

[scopes.slow]
circuit_open = "wait"
poll_interval = "20ms"
stall_window = "10m"

[[scopes.slow.sources]]
name = "s1"
timeout = "10s"
"#
    )
}

/// A running test server.
pub struct Server {
    pub _dir: tempfile::TempDir,
    pub path: PathBuf,
    pub stop: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<Result<(), ServerError>>,
    pub engine: Arc<Engine<TestBackend>>,
    pub stats: Arc<ServerStats>,
}

/// How to start a test server; [`Setup::new`] is `admin_uids = [my uid]` on a local
/// backend with the default options.
pub struct Setup {
    /// `[sidecar]` lines of the config.
    pub sidecar: String,
    /// The backend says it is remote (`Backend::is_remote`): the engine runs its round
    /// trips in tasks, the server spawns every request still pending after its first
    /// poll.
    pub remote: bool,
    /// Round-trip time of a remote backend's state-changing calls.
    pub delay: Duration,
    /// Changes to the options derived from the config.
    pub tweak: Box<dyn FnOnce(&mut ServerOptions)>,
}

impl Setup {
    pub fn new() -> Setup {
        Setup {
            sidecar: format!("admin_uids = [{}]", my_uid()),
            remote: false,
            delay: Duration::ZERO,
            tweak: Box::new(|_| {}),
        }
    }

    /// Replace the `[sidecar]` lines.
    pub fn sidecar(mut self, lines: &str) -> Setup {
        self.sidecar = lines.to_string();
        self
    }

    /// A remote backend (`delay` per state-changing round trip).
    pub fn remote(mut self, remote: bool, delay: Duration) -> Setup {
        self.remote = remote;
        self.delay = delay;
        self
    }

    /// Change the server options.
    pub fn options(mut self, tweak: impl FnOnce(&mut ServerOptions) + 'static) -> Setup {
        self.tweak = Box::new(tweak);
        self
    }

    pub async fn start(self) -> Server {
        let config =
            parse_str(&config_toml(&self.sidecar), std::iter::empty()).expect("test config");
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
        let mut names: Vec<String> = config
            .scopes
            .iter()
            .flat_map(|s| s.sources.iter().map(|x| x.name.clone()))
            .collect();
        names.dedup();
        let backend = TestBackend::new(
            MemoryBackend::new(clock.clone(), names),
            self.remote,
            self.delay,
        );
        let engine = Engine::new(&config, backend, clock);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sidecar.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut opts = ServerOptions::from_config(&config.sidecar);
        (self.tweak)(&mut opts);
        let stats = opts.stats.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::run(listener, engine.clone(), opts, async move {
            let _ = stopped.await;
        }));
        Server {
            _dir: dir,
            path,
            stop: Some(stop),
            task,
            engine,
            stats,
        }
    }
}

impl Server {
    /// [`Setup::new`] started.
    pub async fn start() -> Server {
        Setup::new().start().await
    }

    /// A started server and one greeted client.
    pub async fn with_client() -> (Server, Client) {
        let server = Server::start().await;
        let c = server.client().await;
        (server, c)
    }

    /// Make the backend fail (or work again).
    pub fn backend_down(&self, down: bool) {
        self.engine.backend().down.store(down, Ordering::SeqCst);
    }

    /// Poll the server's in-flight count until `pred` holds.
    pub async fn in_flight_until(&self, what: &str, pred: impl Fn(usize) -> bool) -> usize {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let n = self.stats.in_flight();
            if pred(n) {
                return n;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "in-flight count never reached {what}: {n}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The engine holds no permit and no reservation (and, if `calls`, no call).
    pub fn assert_nothing_held(&self, calls: bool) {
        let live = self.engine.live_counts();
        assert_eq!(live.permits, 0, "{live:?}");
        assert_eq!(live.pacer_in_flight, 0, "{live:?}");
        assert_eq!(live.reserved_tokens, 0, "{live:?}");
        if calls {
            assert_eq!(live.calls, 0, "{live:?}");
        }
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.path).await
    }

    /// Trigger shutdown and wait for `run` to return.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("server stops within its grace")
            .expect("server task")
    }
}

pub struct Client {
    pub framed: Framed<UnixStream, ClientCodec>,
    pub next_id: u64,
}

impl Client {
    /// Connected, no Hello sent yet.
    pub async fn raw(path: &Path) -> Client {
        let stream = UnixStream::connect(path).await.unwrap();
        Client {
            framed: Framed::new(stream, ClientCodec::new(1 << 20)),
            next_id: 1000,
        }
    }

    /// Connected and greeted.
    pub async fn connect(path: &Path) -> Client {
        let mut c = Self::raw(path).await;
        match c.call(hello(PROTOCOL_VERSION)).await {
            Reply::Welcome { .. } => c,
            other => panic!("expected Welcome, got {other:?}"),
        }
    }

    pub async fn send(&mut self, id: u64, request: Request) {
        self.framed.send(ClientFrame { id, request }).await.unwrap();
    }

    pub async fn recv(&mut self) -> ServerFrame {
        match tokio::time::timeout(REPLY_TIMEOUT, self.framed.next()).await {
            Ok(Some(Ok(f))) => f,
            Ok(other) => panic!("expected a frame, got {other:?}"),
            Err(_) => panic!("no reply within {REPLY_TIMEOUT:?}"),
        }
    }

    /// Send with a fresh id and wait for its reply (no other request in flight).
    pub async fn call(&mut self, request: Request) -> Reply {
        self.next_id += 1;
        let id = self.next_id;
        self.send(id, request).await;
        let f = self.recv().await;
        assert_eq!(f.id, id, "reply id");
        f.reply
    }

    /// The server closes the connection (EOF, or a reset).
    pub async fn expect_closed(&mut self) {
        match tokio::time::timeout(REPLY_TIMEOUT, self.framed.next()).await {
            Ok(None) | Ok(Some(Err(_))) => {}
            Ok(Some(Ok(f))) => panic!("expected the connection to close, got {f:?}"),
            Err(_) => panic!("connection still open after {REPLY_TIMEOUT:?}"),
        }
    }

    pub async fn status(&mut self) -> StatusReport {
        match self.call(Request::Status).await {
            Reply::Status(s) => s,
            other => panic!("expected Status, got {other:?}"),
        }
    }

    pub async fn source(&mut self, name: &str) -> SourceStatus {
        let report = self.status().await;
        report
            .scopes
            .iter()
            .flat_map(|s| s.sources.iter())
            .find(|s| s.name == name)
            .cloned()
            .unwrap_or_else(|| panic!("source {name} missing from {report:?}"))
    }

    pub async fn acquire(&mut self, call: u64) -> u64 {
        match self.call(Request::Acquire { call }).await {
            Reply::Granted { permit, .. } => permit,
            other => panic!("expected Granted, got {other:?}"),
        }
    }

    pub async fn begin(&mut self, scope: &str) -> u64 {
        match self
            .call(Request::BeginCall {
                scope: scope.into(),
                est_tokens: None,
            })
            .await
        {
            Reply::CallBegun { call } => call,
            other => panic!("expected CallBegun, got {other:?}"),
        }
    }

    pub async fn force_open(&mut self, source: &str, seconds: f64) {
        let r = self
            .call(Request::ForceOpen {
                source: source.into(),
                seconds,
            })
            .await;
        assert_eq!(r, Reply::Ok);
    }
}

pub fn hello(protocol_version: u32) -> Request {
    Request::Hello {
        protocol_version,
        client_name: "server-test".into(),
        pid: std::process::id(),
    }
}

pub fn error_of(reply: Reply) -> ErrorReply {
    match reply {
        Reply::Error(e) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

pub fn error_frame(f: ServerFrame, id: u64, kind: ErrorKind) -> ErrorReply {
    assert_eq!(f.id, id, "error id in {f:?}");
    let e = error_of(f.reply);
    assert_eq!(e.kind, kind, "{e:?}");
    e
}

/// Poll `source` until `pred` holds (engine bookkeeping may settle asynchronously).
pub async fn eventually(c: &mut Client, source: &str, pred: impl Fn(&SourceStatus) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let s = c.source(source).await;
        if pred(&s) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition never held: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn spec(scope: &str) -> ipc_protocol::CallSpec {
    ipc_protocol::CallSpec {
        scope: scope.into(),
        est_tokens: None,
        priority: None,
        est_input_tokens: None,
        est_output_tokens: None,
    }
}

pub fn success(tokens: Option<u64>) -> Outcome {
    Outcome::Success {
        tokens,
        count_attempt: true,
    }
}

pub fn timeout() -> Outcome {
    Outcome::Failure {
        kind: ipc_protocol::FailureKind::Timeout,
    }
}

/// `Started` → (call, permit, source, attempt).
pub fn started(reply: Reply) -> (u64, u64, String, u32) {
    match reply {
        Reply::Started {
            call,
            permit,
            source,
            attempt,
            ..
        } => (call, permit, source, attempt),
        other => panic!("expected Started, got {other:?}"),
    }
}

/// Wait until the engine holds no call, no permit and no reservation (teardown of a
/// cancelled request runs on its own task).
pub async fn nothing_held_eventually(server: &Server) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let live = server.engine.live_counts();
        if live.calls == 0 && live.permits == 0 && live.pacer_in_flight == 0 {
            server.assert_nothing_held(true);
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still held: {live:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
