//! The load generator: N connections, each making calls back to back for a while,
//! every call's latency recorded. The same code drives the sidecar and the echo
//! floor, so their figures differ only by the server.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::frames::{echo_request, Frame, Reader, ReplySizes, Requests, Template};

/// What one call is.
#[derive(Clone)]
pub enum Shape {
    /// Version 2: `Start` + `Finish` (two round trips).
    V2,
    /// Version 1: `BeginCall`, `Acquire`, `Report`, `EndCall` (four round trips).
    V1,
    /// The echo floor: one round trip per `(request, reply)` payload size pair.
    Echo(Vec<(usize, usize)>),
    /// Version 3 (DESIGN §19): this `Start` or `StartTenant` frame + `Finish`, on a
    /// connection that said protocol 3 (the `tenants` scenario's cost part).
    V3(Arc<Template>),
}

impl Shape {
    /// Round trips (= request frames) per call.
    pub fn frames(&self) -> usize {
        match self {
            Shape::V2 | Shape::V3(_) => 2,
            Shape::V1 => 4,
            Shape::Echo(rts) => rts.len(),
        }
    }

    /// The echo floor of `self`: the same round trips with the same frame sizes.
    pub fn floor(&self) -> Shape {
        let q = Requests::new();
        let r = ReplySizes::new();
        Shape::Echo(match self {
            Shape::V2 => vec![
                (q.start.payload_len(), r.started),
                (q.finish.payload_len(), r.reported),
            ],
            Shape::V3(t) => vec![
                (t.payload_len(), r.started),
                (q.finish.payload_len(), r.reported),
            ],
            Shape::V1 => vec![
                (q.begin.payload_len(), r.begun),
                (q.acquire.payload_len(), r.granted),
                (q.report.payload_len(), r.reported),
                (q.end.payload_len(), r.ok),
            ],
            Shape::Echo(v) => v.clone(),
        })
    }

    /// The protocol version the connection's `Hello` says (`None`: an echo server
    /// needs no `Hello`).
    fn hello(&self) -> Option<u32> {
        match self {
            Shape::Echo(_) => None,
            Shape::V3(_) => Some(3),
            Shape::V2 | Shape::V1 => Some(2),
        }
    }
}

/// A tokio connection with a read buffer and a reusable write buffer.
pub struct Conn {
    stream: UnixStream,
    reader: Reader,
    out: Vec<u8>,
    next_id: u64,
}

impl Conn {
    pub async fn connect(path: &Path, hello: bool) -> io::Result<Conn> {
        Conn::connect_version(path, hello.then_some(2)).await
    }

    /// Connect; `hello`: the protocol version to say (`None`: no handshake).
    pub async fn connect_version(path: &Path, hello: Option<u32>) -> io::Result<Conn> {
        let mut c = Conn {
            stream: UnixStream::connect(path).await?,
            reader: Reader::default(),
            out: Vec::with_capacity(256),
            next_id: 1,
        };
        if let Some(protocol_version) = hello {
            let t = Template::new(ipc_protocol::Request::Hello {
                protocol_version,
                client_name: "polygate-bench".into(),
                pid: std::process::id(),
            });
            let mut out = Vec::new();
            t.put(&mut out, 1, None);
            c.stream.write_all(&out).await?;
            c.recv(|f| f.check()).await?;
        }
        Ok(c)
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Write `out`, read one reply, hand it to `read`.
    async fn rt<T>(&mut self, read: impl FnOnce(&Frame<'_>) -> Result<T, String>) -> io::Result<T> {
        self.stream.write_all(&self.out).await?;
        self.out.clear();
        self.recv(read).await
    }

    async fn recv<T>(
        &mut self,
        read: impl FnOnce(&Frame<'_>) -> Result<T, String>,
    ) -> io::Result<T> {
        loop {
            if let Some(f) = self.reader.next() {
                return read(&f).map_err(io::Error::other);
            }
            if self.stream.read_buf(self.reader.spare()).await? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed"));
            }
        }
    }

    /// Send raw frames (bench setup: pipelined Starts, admin requests).
    pub async fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// The next reply's id and, for `Started`, its permit (errors are `Err`).
    pub async fn recv_started(&mut self) -> io::Result<(u64, u64)> {
        self.recv(|f| Ok((f.id(), f.started_permit()?))).await
    }

    /// The next reply, checked for an error.
    pub async fn recv_ok(&mut self) -> io::Result<u64> {
        self.recv(|f| f.check().map(|()| f.id())).await
    }

    /// The next reply, a `Status`.
    pub async fn recv_status(&mut self) -> io::Result<ipc_protocol::StatusReport> {
        self.recv(|f| crate::frames::status_of(f.payload)).await
    }

    /// One call of `shape`.
    pub async fn call(&mut self, shape: &Shape, q: &Requests) -> io::Result<()> {
        match shape {
            Shape::V2 => {
                let id = self.id();
                q.start.put(&mut self.out, id, None);
                let permit = self.rt(|f| f.started_permit()).await?;
                let id = self.id();
                q.finish.put(&mut self.out, id, Some(permit));
                self.rt(|f| f.check()).await
            }
            Shape::V3(start) => {
                let id = self.id();
                start.put(&mut self.out, id, None);
                let permit = self.rt(|f| f.started_permit()).await?;
                let id = self.id();
                q.finish.put(&mut self.out, id, Some(permit));
                self.rt(|f| f.check()).await
            }
            Shape::V1 => {
                let id = self.id();
                q.begin.put(&mut self.out, id, None);
                let call = self.rt(|f| f.field()).await?;
                let id = self.id();
                q.acquire.put(&mut self.out, id, Some(call));
                let permit = self.rt(|f| f.field()).await?;
                let id = self.id();
                q.report.put(&mut self.out, id, Some(permit));
                self.rt(|f| f.check()).await?;
                let id = self.id();
                q.end.put(&mut self.out, id, Some(call));
                self.rt(|f| f.check()).await
            }
            Shape::Echo(rts) => {
                for &(req, reply) in rts {
                    let id = self.id();
                    echo_request(&mut self.out, id, req, reply);
                    let got = self.rt(|f| Ok(f.id())).await?;
                    if got != id {
                        return Err(io::Error::other(format!("echo id {got}, sent {id}")));
                    }
                }
                Ok(())
            }
        }
    }
}

/// What a load run measured.
pub struct Run {
    /// Calls completed inside the measured window.
    pub calls: u64,
    /// Calls completed in the whole run, warm-up included.
    pub total_calls: u64,
    /// The window.
    pub wall: Duration,
    /// Per-call latencies, sorted, in ns.
    pub latencies: Vec<u32>,
    /// Server CPU over the window, if its pid was given.
    pub server_cpu: Option<Duration>,
    /// The system (kernel) part of `server_cpu`.
    pub server_sys: Option<Duration>,
    /// Round trips per call.
    pub frames_per_call: usize,
}

impl Run {
    pub fn calls_per_s(&self) -> f64 {
        self.calls as f64 / self.wall.as_secs_f64()
    }

    /// The `q`-quantile latency in µs.
    pub fn quantile_us(&self, q: f64) -> f64 {
        quantile_ns(&self.latencies, q) / 1000.0
    }

    /// Server CPU per request frame, µs.
    pub fn cpu_per_frame_us(&self) -> Option<f64> {
        let frames = (self.calls * self.frames_per_call as u64).max(1) as f64;
        self.server_cpu.map(|c| c.as_secs_f64() * 1e6 / frames)
    }

    /// The kernel's part of [`Run::cpu_per_frame_us`], µs.
    pub fn sys_per_frame_us(&self) -> Option<f64> {
        let frames = (self.calls * self.frames_per_call as u64).max(1) as f64;
        self.server_sys.map(|c| c.as_secs_f64() * 1e6 / frames)
    }
}

/// The `q`-quantile of sorted ns values.
pub fn quantile_ns(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i] as f64
}

/// Run `clients` connections making `shape` calls for `warmup + seconds`; only the
/// last `seconds` count. `server` is the pid whose CPU is measured over that window.
pub async fn run(
    path: &Path,
    shape: &Shape,
    clients: usize,
    warmup: Duration,
    seconds: Duration,
    server: Option<u32>,
) -> Result<Run, String> {
    let q = Arc::new(Requests::new());
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        let c = Conn::connect_version(path, shape.hello())
            .await
            .map_err(|e| format!("connect {}: {e}", path.display()))?;
        conns.push(c);
    }
    let mut tasks = Vec::with_capacity(clients);
    for mut c in conns {
        let (q, shape) = (q.clone(), shape.clone());
        let (measuring, stop) = (measuring.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat: Vec<u32> = Vec::with_capacity(1 << 16);
            let (mut calls, mut total) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                c.call(&shape, &q).await.map_err(|e| e.to_string())?;
                total += 1;
                if measuring.load(Ordering::Relaxed) {
                    lat.push(t.elapsed().as_nanos().min(u32::MAX as u128) as u32);
                    calls += 1;
                }
            }
            Ok::<_, String>((calls, total, lat))
        }));
    }
    tokio::time::sleep(warmup).await;
    let cpu0 = server.map(crate::procs::cpu_times).transpose()?;
    let t0 = Instant::now();
    measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(seconds).await;
    measuring.store(false, Ordering::Relaxed);
    let wall = t0.elapsed();
    let cpu1 = server.map(crate::procs::cpu_times).transpose()?;
    stop.store(true, Ordering::Relaxed);
    let (mut calls, mut total_calls) = (0, 0);
    let mut latencies = Vec::new();
    for t in tasks {
        let (n, all, l) = t.await.map_err(|e| e.to_string())??;
        calls += n;
        total_calls += all;
        latencies.extend(l);
    }
    latencies.sort_unstable();
    Ok(Run {
        calls,
        total_calls,
        wall,
        latencies,
        server_cpu: cpu0
            .zip(cpu1)
            .map(|(a, b)| (b.0 + b.1).saturating_sub(a.0 + a.1)),
        server_sys: cpu0.zip(cpu1).map(|(a, b)| b.1.saturating_sub(a.1)),
        frames_per_call: shape.frames(),
    })
}

/// Where a freshly started echo floor listens, and its process.
pub struct Floor {
    pub kind: crate::echo::Kind,
    pub socket: PathBuf,
    pub proc: crate::procs::Proc,
}

impl Floor {
    /// Start the echo server `kind` (this binary, `echo-server` mode) in `dir`.
    pub fn start(kind: crate::echo::Kind, dir: &Path) -> Result<Floor, String> {
        let socket = dir.join(format!("echo-{}.sock", kind.name()));
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("echo-server")
            .arg("--kind")
            .arg(kind.name())
            .arg("--socket")
            .arg(&socket);
        let mut proc = crate::procs::Proc::spawn(
            &format!("echo server ({})", kind.name()),
            cmd,
            &dir.join(format!("echo-{}.log", kind.name())),
        )?;
        crate::procs::wait_for_socket(&socket, &mut proc)?;
        Ok(Floor { kind, socket, proc })
    }
}
