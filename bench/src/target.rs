//! What the bench measures: a release sidecar it starts itself (temp config, temp
//! socket) or one already running (`--socket`), and the `redis-server` behind it.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::procs::{self, Proc};

/// Which backend the sidecar runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Memory,
    /// `redis://…` URL.
    Redis(String),
}

/// The bench configuration: scope `bench` (one source `a`, quotas far above any rate
/// the machine reaches, a pacer that never limits), `open` (circuit_open = wait) and
/// `quota` (quota_full = wait, one request a minute) for the waiters.
pub fn config(socket: &Path, backend: &Backend) -> String {
    let uid = nix::unistd::getuid().as_raw();
    let backend = match backend {
        Backend::Memory => "backend = \"memory\"".to_string(),
        Backend::Redis(url) => format!(
            "backend = \"redis\"\nredis_url = \"{url}\"\nkey_prefix = \"pgbench\"\n\
             redis_timeout = \"2s\""
        ),
    };
    format!(
        r#"[sidecar]
socket = "{socket}"
admin_uids = [{uid}]
{backend}

[scopes.bench]
circuit_open = "fail_fast"
quota_full = "fail_fast"
[scopes.bench.pacer]
initial = 100000
min = 1
max = 100000
[[scopes.bench.sources]]
name = "a"
tpm = 1000000000000
rpm = 1000000000000
est_tokens = 10
timeout = "60s"

[scopes.open]
circuit_open = "wait"
poll_interval = "50ms"
stall_window = "1h"
[scopes.open.pacer]
initial = 100000
min = 1
max = 100000
[[scopes.open.sources]]
name = "wo"
timeout = "1h"

[scopes.quota]
quota_full = "wait"
poll_interval = "50ms"
stall_window = "1h"
[scopes.quota.pacer]
initial = 100000
min = 1
max = 100000
[[scopes.quota.sources]]
name = "wq"
rpm = 1
timeout = "1h"
"#,
        socket = socket.display()
    )
}

/// A sidecar to measure.
pub struct Sidecar {
    pub socket: PathBuf,
    /// Its pid (from `SO_PEERCRED` when it was not started here).
    pub pid: u32,
    /// Kept for its drop (stops it), when started here.
    _proc: Option<Proc>,
}

impl Sidecar {
    /// Start `bin` on `backend`, config and socket in `dir`. `pin`: run it on CPU 0.
    pub fn start(bin: &Path, dir: &Path, backend: &Backend) -> Result<Sidecar, String> {
        Self::start_with(bin, dir, backend, "")
    }

    /// [`Sidecar::start`] with `extra` appended to the configuration (more scopes).
    pub fn start_with(
        bin: &Path,
        dir: &Path,
        backend: &Backend,
        extra: &str,
    ) -> Result<Sidecar, String> {
        if !bin.is_file() {
            return Err(format!(
                "sidecar binary {} not found: build it with `cargo build --release -p \
                 polygate-sidecar` or pass --sidecar-bin / --socket",
                bin.display()
            ));
        }
        let socket = dir.join("sidecar.sock");
        let cfg = dir.join("bench.toml");
        let text = format!("{}\n{extra}", config(&socket, backend));
        std::fs::write(&cfg, text).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(bin);
        cmd.arg("--config").arg(&cfg).env("RUST_LOG", "warn");
        let mut proc = Proc::spawn("polygate-sidecar", cmd, &dir.join("sidecar.log"))?;
        procs::wait_for_socket(&socket, &mut proc)?;
        Ok(Sidecar {
            socket,
            pid: proc.pid(),
            _proc: Some(proc),
        })
    }

    /// A sidecar already listening on `socket` (it must have the bench scopes).
    pub fn external(socket: &Path) -> Result<Sidecar, String> {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        let s = std::os::unix::net::UnixStream::connect(socket)
            .map_err(|e| format!("{}: {e}", socket.display()))?;
        let cred = getsockopt(&s, PeerCredentials).map_err(|e| e.to_string())?;
        Ok(Sidecar {
            socket: socket.to_path_buf(),
            pid: cred.pid() as u32,
            _proc: None,
        })
    }
}

/// A Redis server: a throwaway one started here, or `--redis-url`.
pub struct Redis {
    pub url: String,
    /// `host:port`.
    addr: String,
    _proc: Option<Proc>,
}

impl Redis {
    /// Start `redis-server` on a free port, nothing persisted, files in `dir`.
    pub fn start(dir: &Path) -> Result<Redis, String> {
        let port = procs::free_port()?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir);
        let proc = Proc::spawn("redis-server", cmd, &dir.join("redis.log"))
            .map_err(|e| format!("{e} (is redis-server installed?)"))?;
        let r = Redis {
            url: format!("redis://127.0.0.1:{port}/0"),
            addr: format!("127.0.0.1:{port}"),
            _proc: Some(proc),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while r.cmd(&["PING"]).is_err() {
            if Instant::now() > deadline {
                return Err(format!("redis-server on port {port} never answered PING"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(r)
    }

    /// A server already running at `url` (`redis://host:port[/db]`).
    pub fn external(url: &str) -> Result<Redis, String> {
        let addr = url
            .strip_prefix("redis://")
            .map(|r| r.split('/').next().unwrap_or(r))
            .map(|r| r.rsplit('@').next().unwrap_or(r))
            .ok_or_else(|| format!("--redis-url {url:?}: expected redis://host:port"))?;
        let r = Redis {
            url: url.to_string(),
            addr: addr.to_string(),
            _proc: None,
        };
        r.cmd(&["PING"])
            .map_err(|e| format!("--redis-url {url}: {e}"))?;
        Ok(r)
    }

    pub fn connect(&self) -> Result<Resp, String> {
        let s = TcpStream::connect(&self.addr).map_err(|e| format!("{}: {e}", self.addr))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        Ok(Resp {
            w: s.try_clone().map_err(|e| e.to_string())?,
            r: BufReader::new(s),
        })
    }

    /// One command on a fresh connection; the reply as text.
    pub fn cmd(&self, args: &[&str]) -> Result<String, String> {
        self.connect()?.cmd(args)
    }

    /// `INFO section` as `key → value`.
    pub fn info(&self, section: &str) -> Result<Vec<(String, String)>, String> {
        let text = self.cmd(&["INFO", section])?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect())
    }
}

/// A minimal RESP2 connection: commands as arrays of bulk strings, replies as text
/// (enough for PING, INFO, FLUSHALL and MONITOR).
pub struct Resp {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Resp {
    pub fn cmd(&mut self, args: &[&str]) -> Result<String, String> {
        let mut b = format!("*{}\r\n", args.len());
        for a in args {
            b.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        self.w.write_all(b.as_bytes()).map_err(|e| e.to_string())?;
        self.reply()
    }

    /// The next reply (arrays joined by newlines).
    pub fn reply(&mut self) -> Result<String, String> {
        let mut line = String::new();
        self.r.read_line(&mut line).map_err(|e| e.to_string())?;
        let line = line.trim_end_matches(['\r', '\n']);
        let (kind, rest) = line.split_at(1.min(line.len()));
        match kind {
            "+" | ":" => Ok(rest.to_string()),
            "-" => Err(format!("redis: {rest}")),
            "$" => {
                let n: i64 = rest.parse().map_err(|_| format!("bad bulk {rest}"))?;
                if n < 0 {
                    return Ok(String::new());
                }
                let mut buf = vec![0u8; n as usize + 2];
                std::io::Read::read_exact(&mut self.r, &mut buf).map_err(|e| e.to_string())?;
                buf.truncate(n as usize);
                String::from_utf8(buf).map_err(|e| e.to_string())
            }
            "*" => {
                let n: i64 = rest.parse().map_err(|_| format!("bad array {rest}"))?;
                let mut parts = Vec::new();
                for _ in 0..n.max(0) {
                    parts.push(self.reply()?);
                }
                Ok(parts.join("\n"))
            }
            _ => Err(format!("unexpected redis reply {line:?}")),
        }
    }
}
