//! The processes a bench run starts (the sidecar, `redis-server`, the echo floor) and
//! what it reads about them from `/proc`: CPU time and resident memory.
//!
//! Every child is killed when its handle drops, so a failed or interrupted run leaves
//! nothing behind (common brief: never leave background processes running).

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A child process, stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Proc {
    /// What it is, for error messages.
    pub name: String,
    /// The running child.
    child: Child,
}

impl Proc {
    /// Start `cmd` with its stdout and stderr in `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Proc, String> {
        use std::os::unix::process::CommandExt;
        // If the bench dies without dropping this handle (killed, timed out), the
        // child goes with it.
        // SAFETY: prctl(2) is async-signal-safe; nothing else runs in the child
        // between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let out = fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start {name} ({cmd:?}): {e}"))?;
        Ok(Proc {
            name: name.to_string(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Err` if it already exited.
    pub fn alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("{} exited early: {status}", self.name)),
            Err(e) => Err(format!("{}: {e}", self.name)),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait until a Unix socket accepts connections.
pub fn wait_for_socket(path: &Path, proc: &mut Proc) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Ok(());
        }
        proc.alive()?;
        if Instant::now() > deadline {
            return Err(format!(
                "{} never listened on {}",
                proc.name,
                path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// CPU time (user + system, all threads) of `pid` so far.
pub fn cpu_time(pid: u32) -> Result<Duration, String> {
    cpu_times(pid).map(|(user, system)| user + system)
}

/// CPU time of `pid` so far, split: (user, system). The system part is the
/// kernel's work on the process's behalf — for a socket server, mostly its
/// syscalls — which the sidecar and an echo server doing the same syscalls share;
/// the user part is what the server's own code costs.
pub fn cpu_times(pid: u32) -> Result<(Duration, Duration), String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14, 15.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or("unparsable /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<u64, String> {
        f.get(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("/proc/{pid}/stat field {}", i + 3))
    };
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as u64;
    let d = |t: u64| Duration::from_nanos(t * 1_000_000_000 / hz);
    // rest[0] is field 3 (state): utime is field 14 → index 11, stime index 12.
    Ok((d(ticks(11)?), d(ticks(12)?)))
}

/// Resident memory of `pid`, in MiB.
pub fn rss_mib(pid: u32) -> Result<f64, String> {
    let f = fs::File::open(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    for line in BufReader::new(f).lines().map_while(Result::ok) {
        if let Some(v) = line.strip_prefix("VmRSS:") {
            let kib: f64 = v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .map_err(|_| format!("VmRSS {v:?}"))?;
            return Ok(kib / 1024.0);
        }
    }
    Err(format!("no VmRSS for pid {pid}"))
}

/// The machine's load averages (`/proc/loadavg`, first three fields).
pub fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Pin every thread of `pid` (0 = this process) to `cpus`.
pub fn pin(pid: u32, cpus: &[usize]) -> Result<(), String> {
    use nix::sched::{sched_setaffinity, CpuSet};
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c).map_err(|e| e.to_string())?;
    }
    let pid = if pid == 0 { std::process::id() } else { pid };
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).map_err(|e| e.to_string())?;
    for t in tasks.flatten() {
        if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
            sched_setaffinity(Pid::from_raw(tid), &set)
                .map_err(|e| format!("sched_setaffinity({tid}): {e}"))?;
        }
    }
    Ok(())
}

/// Every CPU this machine has.
pub fn all_cpus() -> Vec<usize> {
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// A TCP port nobody listens on right now.
pub fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// The repository root (the bench runs from anywhere inside it, or from `target/`).
pub fn repo_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(Path::to_path_buf).unwrap_or(here)
}
