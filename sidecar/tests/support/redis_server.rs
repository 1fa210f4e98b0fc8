//! Throwaway Redis servers for tests: a single node or a 3-master cluster, each on
//! free ports in a temp dir, killed on drop (and by a watchdog when the test process
//! exits, so servers held in statics never outlive the test binary).
//!
//! Part of the shared test support: `mod support;`, then `support::redis_server`.
//!
//! When `redis-server` cannot start: with `CI=true` the test panics loudly, otherwise
//! it prints a loud warning and the constructor returns `None` (the test skips).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `redis-server` binary (env `REDIS_SERVER` overrides).
fn server_bin() -> String {
    std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// `redis-cli` binary (env `REDIS_CLI` overrides).
fn cli_bin() -> String {
    std::env::var("REDIS_CLI").unwrap_or_else(|_| "redis-cli".into())
}

/// Skip (None) or, under CI, fail.
fn unavailable(why: &str) {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("redis-server unavailable under CI=true: {why}");
    }
    eprintln!();
    eprintln!("############################################################");
    eprintln!("## WARNING: redis-server unavailable, SKIPPING this test: ##");
    eprintln!("##   {why}");
    eprintln!("############################################################");
    eprintln!();
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A free port `p` such that `p + 10000` (the cluster bus port) is free as well.
fn free_port() -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind(("127.0.0.1", 0)).expect("bind an ephemeral port");
        let p = l.local_addr().unwrap().port();
        drop(l);
        if p < 55_000 && port_free(p) && port_free(p + 10_000) {
            return p;
        }
    }
    // Fall back to a pseudo-random range below the ephemeral one.
    let seed = std::process::id() as u16;
    for i in 0..2000u16 {
        let p = 20_000 + (seed.wrapping_add(i.wrapping_mul(7)) % 20_000);
        if port_free(p) && port_free(p + 10_000) {
            return p;
        }
    }
    panic!("no free port pair found");
}

/// Send one inline command over a fresh TCP connection; the raw reply.
pub fn raw_command(port: u16, cmd: &str, timeout: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(format!("{cmd}\r\n").as_bytes())?;
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn ping(port: u16) -> bool {
    raw_command(port, "PING", Duration::from_millis(200)).is_ok_and(|r| r.starts_with("+PONG"))
}

/// One redis-server process.
#[derive(Debug)]
pub struct RedisServer {
    /// Listening port.
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    cluster: bool,
    /// Extra `redis-server` arguments (kept for restarts).
    extra: Vec<String>,
}

impl RedisServer {
    /// A standalone server on a free port, or `None` (after a loud warning) when
    /// redis-server cannot start outside CI.
    pub fn start() -> Option<Self> {
        Self::start_with(false, &[])
    }

    /// A standalone server started with extra arguments (for example
    /// `--rename-command FCALL ""` to play a server without Redis Functions).
    pub fn start_with_args(extra: &[&str]) -> Option<Self> {
        Self::start_with(false, extra)
    }

    fn start_with(cluster: bool, extra: &[&str]) -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut srv = RedisServer {
            port: free_port(),
            child: None,
            dir,
            cluster,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        match srv.spawn() {
            Ok(()) => Some(srv),
            Err(e) => {
                unavailable(&e);
                None
            }
        }
    }

    fn spawn(&mut self) -> Result<(), String> {
        let port = self.port.to_string();
        let dir = self.dir.path();
        let mut cmd = Command::new(server_bin());
        cmd.args([
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--dir", &dir.to_string_lossy()])
        .args(["--logfile", &dir.join("redis.log").to_string_lossy()])
        .args(["--protected-mode", "no", "--daemonize", "no"])
        .args(&self.extra);
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args([
                    "--cluster-config-file",
                    &dir.join("nodes.conf").to_string_lossy(),
                ])
                .args(["--cluster-node-timeout", "2000"]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", server_bin()))?;
        let pid = child.id();
        self.child = Some(child);
        watchdog(pid);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if ping(self.port) {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                let log = std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default();
                self.child = None;
                return Err(format!("redis-server exited ({status}): {log}"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!(
            "redis-server on port {port} not answering PING after 5 s"
        ))
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL the server (its port stops answering at once).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port (empty: nothing was saved).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("restart failed: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// SIGSTOP: the port accepts connections but nothing answers (a "slow/dead" Redis).
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let ok = Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill -{sig} {pid} failed");
        }
    }

    /// Run `redis-cli -p <port> <args>`; its stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }

    /// `INFO commandstats` → calls of `cmd` (lower case, e.g. `evalsha`).
    pub fn command_calls(&self, cmd: &str) -> u64 {
        let info = self.cli(&["INFO", "commandstats"]);
        let needle = format!("cmdstat_{}:calls=", cmd.to_lowercase());
        info.lines()
            .find_map(|l| l.trim().strip_prefix(&needle))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// Temp dir of this server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Run redis-cli against `port`.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new(cli_bin())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cli_bin()));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Kill `pid` once this test process is gone (statics are never dropped).
fn watchdog(pid: u32) {
    let me = std::process::id();
    let script = format!(
        "while kill -0 {me} 2>/dev/null && kill -0 {pid} 2>/dev/null; do sleep 0.5; done; kill -9 {pid} 2>/dev/null"
    );
    let _ = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

/// A 3-master Redis Cluster (no replicas, unless started with them).
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, in slot order (node 0 holds slots 0..5460, …).
    pub nodes: Vec<RedisServer>,
    /// With [`RedisCluster::start_with_replicas`]: replica `i` follows `nodes[i]`.
    pub replicas: Vec<RedisServer>,
}

impl RedisCluster {
    /// [`RedisCluster::start`], plus one replica per master, each caught up (its
    /// link up) before this returns: a cluster that fails over when a master dies.
    pub fn start_with_replicas() -> Option<Self> {
        let mut c = Self::start()?;
        for _ in 0..3 {
            c.replicas.push(RedisServer::start_with(true, &[])?);
        }
        let seed = c.nodes[0].port.to_string();
        for r in &c.replicas {
            r.cli(&["CLUSTER", "MEET", "127.0.0.1", &seed]);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let ids: Vec<String> = c
            .nodes
            .iter()
            .map(|n| n.cli(&["CLUSTER", "MYID"]).trim().to_string())
            .collect();
        // A replica can follow a master only once it knows it (gossip).
        for (r, id) in c.replicas.iter().zip(&ids) {
            loop {
                let reply = r.cli(&["CLUSTER", "REPLICATE", id]);
                if reply.contains("OK") {
                    break;
                }
                if Instant::now() > deadline {
                    unavailable(&format!("CLUSTER REPLICATE failed: {reply}"));
                    return None;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        loop {
            let synced = c.replicas.iter().all(|r| {
                r.cli(&["INFO", "replication"])
                    .contains("master_link_status:up")
            });
            let ok = c.nodes.iter().chain(&c.replicas).all(|n| {
                let info = n.cli(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:6")
            });
            if synced && ok {
                return Some(c);
            }
            if Instant::now() > deadline {
                unavailable("replicas did not sync in 20 s");
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Three cluster-enabled servers joined with all 16384 slots covered, or `None`
    /// (after a loud warning) when redis-server cannot start outside CI.
    pub fn start() -> Option<Self> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(RedisServer::start_with(true, &[])?);
        }
        // Slots by hand (no interactive redis-cli --cluster), then MEET.
        let ranges = [(0, 5460), (5461, 10922), (10923, 16383)];
        for (n, (lo, hi)) in nodes.iter().zip(ranges) {
            let r = n.cli(&["CLUSTER", "ADDSLOTSRANGE", &lo.to_string(), &hi.to_string()]);
            if !r.contains("OK") {
                unavailable(&format!("CLUSTER ADDSLOTSRANGE failed: {r}"));
                return None;
            }
        }
        for n in &nodes[1..] {
            n.cli(&["CLUSTER", "MEET", "127.0.0.1", &nodes[0].port.to_string()]);
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let ok = nodes.iter().all(|n| {
                let info = n.cli(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
            });
            if ok {
                break;
            }
            if Instant::now() > deadline {
                unavailable("cluster did not reach cluster_state:ok in 15 s");
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(RedisCluster {
            nodes,
            replicas: Vec::new(),
        })
    }

    /// Seed URLs of all nodes (masters first, then replicas).
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .chain(&self.replicas)
            .map(RedisServer::url)
            .collect()
    }

    /// Index of the master (in [`RedisCluster::nodes`]) that held `key`'s slot at
    /// the start (asked of any node still answering: one may have been killed).
    pub fn master_index(&self, key: &str) -> usize {
        let slot: u32 = self
            .nodes
            .iter()
            .chain(&self.replicas)
            .find_map(|n| n.cli(&["CLUSTER", "KEYSLOT", key]).trim().parse().ok())
            .expect("CLUSTER KEYSLOT");
        match slot {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        }
    }

    /// The node holding `key`'s slot.
    pub fn node_for(&self, key: &str) -> &RedisServer {
        let slot: u32 = cli(self.nodes[0].port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT");
        let i = match slot {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        };
        &self.nodes[i]
    }

    /// Waits until replica `i` has applied everything master `i` has written so far
    /// (its `slave_repl_offset` reaches the master's `master_repl_offset`), and panics
    /// after `timeout`. `WAIT` cannot do this from a test: it counts only the writes
    /// of the connection that sends it, and `cli` opens a fresh one each time.
    pub fn wait_replicated(&self, i: usize, timeout: Duration) {
        fn field(info: &str, key: &str) -> Option<u64> {
            info.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse().ok())
        }
        let deadline = Instant::now() + timeout;
        loop {
            let want = field(
                &self.nodes[i].cli(&["INFO", "replication"]),
                "master_repl_offset",
            );
            let have = field(
                &self.replicas[i].cli(&["INFO", "replication"]),
                "slave_repl_offset",
            );
            if let (Some(want), Some(have)) = (want, have) {
                if have >= want {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "replica {i} did not catch up with its master in {timeout:?} \
                 (master_repl_offset {want:?}, slave_repl_offset {have:?})"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sum of `cmd` calls over all nodes.
    pub fn command_calls(&self, cmd: &str) -> u64 {
        self.nodes.iter().map(|n| n.command_calls(cmd)).sum()
    }
}

/// Path of a file in the crate's tests directory (for diagnostics).
pub fn tests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests")
}
