//! systemd integration (§12): a tiny sd_notify(3) and sd_listen_fds(3), without
//! libsystemd (sozu style), and the watchdog task.
//!
//! * [`notify`] sends one datagram (`READY=1`, `STOPPING=1`, …) to `$NOTIFY_SOCKET`,
//!   a filesystem path or an abstract name written `@name`; without
//!   `$NOTIFY_SOCKET` (not run by systemd, or `Type=` other than `notify`) it does
//!   nothing.
//! * [`watchdog_interval`] reads `$WATCHDOG_USEC` (honouring `$WATCHDOG_PID`); the
//!   daemon should call [`watchdog`] at half that period.
//! * [`listen_fds`] takes the listening sockets passed by a systemd socket unit
//!   (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`): the worker socket, and the
//!   admin listener if the unit passes one.
//! * [`sd_notify`] logs a failed notification (the daemon never stops over one), and
//!   [`spawn_watchdog`] pings at half the watchdog period while the daemon runs.
//!
//! The environment is read only in the thin wrappers; the `*_to` / `*_from`
//! functions take everything as parameters, so they can be tested in parallel.
//!
//! Kept std-only rather than moved onto `sd-notify` 0.5 + `listenfd` 1.0 (read for
//! issue 14): `sd-notify` sends to `@name` as a filesystem path (no abstract
//! namespace), fails on an empty `$NOTIFY_SOCKET` and accepts `WATCHDOG_USEC=0`
//! (a zero-period interval panics tokio); `listenfd` accepts fds without
//! `LISTEN_PID`, ignores `LISTEN_FDNAMES`, drops malformed values silently, and
//! calls `env::remove_var` — unsound once the runtime's threads exist. The two
//! together are about the size of this file and less correct.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The first file descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;

/// Sends `state` to `$NOTIFY_SOCKET`; a no-op when the variable is unset or empty.
pub fn notify(state: &str) -> io::Result<()> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(socket) if !socket.is_empty() => notify_to(&socket, state),
        _ => Ok(()),
    }
}

/// Sends `state` as one datagram to the notification socket `socket`: a path, or
/// `@name` for a Linux abstract socket.
pub fn notify_to(socket: &OsStr, state: &str) -> io::Result<()> {
    let addr = notify_addr(socket)?;
    let sock = UnixDatagram::unbound()?;
    let sent = sock.send_to_addr(state.as_bytes(), &addr)?;
    if sent != state.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("sd_notify: sent {sent} of {} bytes", state.len()),
        ));
    }
    Ok(())
}

fn notify_addr(socket: &OsStr) -> io::Result<SocketAddr> {
    let bytes = socket.as_bytes();
    match bytes.first() {
        Some(b'@') => abstract_addr(&bytes[1..]),
        Some(b'/') => SocketAddr::from_pathname(Path::new(socket)),
        _ => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("NOTIFY_SOCKET={socket:?}: expected an absolute path or @abstract name"),
        )),
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn abstract_addr(name: &[u8]) -> io::Result<SocketAddr> {
    #[cfg(target_os = "android")]
    use std::os::android::net::SocketAddrExt;
    #[cfg(target_os = "linux")]
    use std::os::linux::net::SocketAddrExt;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn abstract_addr(_name: &[u8]) -> io::Result<SocketAddr> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract NOTIFY_SOCKET addresses exist only on Linux",
    ))
}

/// `READY=1`: startup (or a reload) finished; the socket is accepting.
pub fn ready() -> io::Result<()> {
    notify("READY=1")
}

/// `STOPPING=1`: shutdown has begun.
pub fn stopping() -> io::Result<()> {
    notify("STOPPING=1")
}

/// `RELOADING=1` with the `MONOTONIC_USEC=` stamp systemd wants; send [`ready`]
/// when the reload is done.
pub fn reloading() -> io::Result<()> {
    notify(&reloading_state(monotonic_usec()?))
}

/// `WATCHDOG=1`: keep-alive ping; send at least every [`watchdog_interval`] / 2.
pub fn watchdog() -> io::Result<()> {
    notify("WATCHDOG=1")
}

fn reloading_state(monotonic_usec: u64) -> String {
    format!("RELOADING=1\nMONOTONIC_USEC={monotonic_usec}")
}

fn monotonic_usec() -> io::Result<u64> {
    use nix::time::{clock_gettime, ClockId};
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).map_err(io::Error::from)?;
    let secs = u64::try_from(ts.tv_sec()).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec()).unwrap_or(0);
    Ok(secs * 1_000_000 + nanos / 1_000)
}

/// Log a failed sd_notify message `what`; systemd integration never stops the daemon.
pub fn sd_notify(what: &str, r: io::Result<()>) {
    if let Err(e) = r {
        tracing::warn!(error = %e, "sd_notify {what} failed");
    }
}

/// When systemd's watchdog is enabled for this process: a task sending `WATCHDOG=1`
/// at half the period, until aborted.
pub fn spawn_watchdog() -> Option<tokio::task::JoinHandle<()>> {
    watchdog_interval().map(|every| {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every / 2);
            loop {
                tick.tick().await;
                sd_notify("WATCHDOG", watchdog());
            }
        })
    })
}

/// The watchdog timeout systemd expects pings within (`WatchdogSec=`), if the
/// watchdog is enabled for this process.
pub fn watchdog_interval() -> Option<Duration> {
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    watchdog_interval_from(usec.as_deref(), pid.as_deref(), std::process::id())
}

/// [`watchdog_interval`] from explicit values: `WATCHDOG_USEC` must be a positive
/// integer, and `WATCHDOG_PID`, when set, must be `my_pid` (else the variables were
/// meant for another process, e.g. our parent).
pub fn watchdog_interval_from(
    watchdog_usec: Option<&str>,
    watchdog_pid: Option<&str>,
    my_pid: u32,
) -> Option<Duration> {
    if let Some(pid) = watchdog_pid {
        if pid.trim().parse::<u32>().ok()? != my_pid {
            return None;
        }
    }
    let usec: u64 = watchdog_usec?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// The sockets systemd passed (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`): one
/// name per fd (`None` where systemd gave none), or `None` when not socket-activated
/// (unset, or meant for another pid); an error when the values are malformed or the
/// names do not match the count.
pub fn listen_fd_names_from(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    listen_fdnames: Option<&str>,
    my_pid: u32,
) -> io::Result<Option<Vec<Option<String>>>> {
    let (Some(pid), Some(fds)) = (listen_pid, listen_fds) else {
        return Ok(None);
    };
    let bad = |what: &str, v: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket activation: {what}={v:?} is not a number"),
        )
    };
    let pid: u32 = pid.trim().parse().map_err(|_| bad("LISTEN_PID", pid))?;
    if pid != my_pid {
        return Ok(None);
    }
    let n: u32 = fds.trim().parse().map_err(|_| bad("LISTEN_FDS", fds))?;
    if n == 0 {
        return Ok(None);
    }
    if n > MAX_LISTEN_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket activation: LISTEN_FDS={n} is more than {MAX_LISTEN_FDS} sockets"),
        ));
    }
    let names: Vec<Option<String>> = match listen_fdnames {
        None | Some("") => vec![None; n as usize],
        Some(names) => {
            let names: Vec<Option<String>> = names
                .split(':')
                .map(|s| (!s.is_empty()).then(|| s.to_string()))
                .collect();
            if names.len() != n as usize {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "socket activation: LISTEN_FDNAMES has {} names for LISTEN_FDS={n}",
                        names.len()
                    ),
                ));
            }
            names
        }
    };
    Ok(Some(names))
}

/// At most this many passed sockets are looked at (systemd passes a handful).
const MAX_LISTEN_FDS: u32 = 64;

/// What kind of socket a passed fd is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketKind {
    /// A listening Unix stream socket: the worker socket.
    Unix,
    /// A listening TCP socket (IPv4 or IPv6): the admin listener.
    Tcp,
    /// Anything else (datagram, FIFO, …): not ours, closed.
    Other,
}

/// Which passed socket (index) is the worker socket and which the admin listener:
/// a socket named `worker` / `admin` (`FileDescriptorName=`) wins; otherwise the
/// first Unix stream socket is the worker socket and the first TCP socket the
/// admin listener.
pub fn pick_sockets(sockets: &[(Option<String>, SocketKind)]) -> (Option<usize>, Option<usize>) {
    let named = |want: &str, kind: SocketKind| {
        sockets
            .iter()
            .position(|(n, k)| n.as_deref() == Some(want) && *k == kind)
    };
    let first = |kind: SocketKind| sockets.iter().position(|(_, k)| *k == kind);
    (
        named("worker", SocketKind::Unix).or_else(|| first(SocketKind::Unix)),
        named("admin", SocketKind::Tcp).or_else(|| first(SocketKind::Tcp)),
    )
}

/// Whether the passed sockets have already been taken by [`listen_fds`]: they have
/// one owner only.
static LISTEN_FD_TAKEN: AtomicBool = AtomicBool::new(false);

/// The listening sockets systemd socket activation passed (`polygate.socket`), or
/// `None` when not socket-activated: the worker socket (a Unix stream socket,
/// required) and, if passed, the admin listener (a TCP socket), chosen by
/// [`pick_sockets`]. Every passed fd is set close-on-exec; those not used are closed.
/// Both are returned in blocking mode: call `set_nonblocking(true)` before handing
/// them to tokio. Only the first call can return them; later calls return `None`.
pub fn listen_fds() -> io::Result<Option<Activated>> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let names = std::env::var("LISTEN_FDNAMES").ok();
    let Some(names) = listen_fd_names_from(
        pid.as_deref(),
        fds.as_deref(),
        names.as_deref(),
        std::process::id(),
    )?
    else {
        return Ok(None);
    };
    if LISTEN_FD_TAKEN.swap(true, Ordering::SeqCst) {
        return Ok(None);
    }
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    use std::os::fd::{FromRawFd, OwnedFd};

    let mut owned = Vec::with_capacity(names.len());
    for (i, name) in names.into_iter().enumerate() {
        let raw = LISTEN_FDS_START + i as i32;
        // SAFETY: systemd passed fds 3 … 3+LISTEN_FDS-1 to this very process
        // (LISTEN_PID == our pid), so they are open and nothing else in the process
        // owns them; the LISTEN_FD_TAKEN guard above makes this the only place that
        // ever takes ownership, so each OwnedFd is its fd's unique owner and closes
        // it exactly once.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        fcntl(&fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).map_err(io::Error::from)?;
        let kind = socket_kind(&fd);
        owned.push((name, kind, fd));
    }
    let kinds: Vec<(Option<String>, SocketKind)> =
        owned.iter().map(|(n, k, _)| (n.clone(), *k)).collect();
    let (worker, admin) = pick_sockets(&kinds);
    let Some(worker) = worker else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket activation: none of the {} passed sockets is a Unix stream socket \
                 (use ListenStream=/path)",
                owned.len()
            ),
        ));
    };
    let mut fds: Vec<Option<OwnedFd>> = owned.into_iter().map(|(_, _, fd)| Some(fd)).collect();
    let worker = UnixListener::from(fds[worker].take().expect("picked once"));
    let admin = admin.map(|i| std::net::TcpListener::from(fds[i].take().expect("picked once")));
    Ok(Some(Activated { worker, admin }))
}

/// The sockets socket activation passed.
#[derive(Debug)]
pub struct Activated {
    /// The worker socket.
    pub worker: UnixListener,
    /// The admin listener, if the socket unit passed one (it replaces
    /// `sidecar.admin_listen`).
    pub admin: Option<std::net::TcpListener>,
}

/// What kind of listening socket `fd` is.
fn socket_kind(fd: &std::os::fd::OwnedFd) -> SocketKind {
    use nix::sys::socket::{getsockname, getsockopt, sockopt, AddressFamily, SockType};
    use nix::sys::socket::{SockaddrLike, SockaddrStorage};
    let stream = getsockopt(fd, sockopt::SockType).is_ok_and(|t| t == SockType::Stream);
    let family = getsockname::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(fd))
        .ok()
        .and_then(|a| a.family());
    match (stream, family) {
        (true, Some(AddressFamily::Unix)) => SocketKind::Unix,
        (true, Some(AddressFamily::Inet | AddressFamily::Inet6)) => SocketKind::Tcp,
        _ => SocketKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(sock: &UnixDatagram) -> String {
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn notify_to_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1").unwrap();
        assert_eq!(recv(&server), "READY=1");
        notify_to(path.as_os_str(), "STOPPING=1").unwrap();
        assert_eq!(recv(&server), "STOPPING=1");
        notify_to(path.as_os_str(), &reloading_state(42)).unwrap();
        assert_eq!(recv(&server), "RELOADING=1\nMONOTONIC_USEC=42");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn notify_to_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("polygate-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(OsStr::new(&format!("@{name}")), "WATCHDOG=1").unwrap();
        assert_eq!(recv(&server), "WATCHDOG=1");
    }

    #[test]
    fn notify_to_missing_socket_fails_and_relative_path_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nobody-listens.sock");
        assert!(notify_to(missing.as_os_str(), "READY=1").is_err());
        let e = notify_to(OsStr::new("relative.sock"), "READY=1").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
    }

    #[test]
    fn monotonic_clock_reads() {
        assert!(monotonic_usec().unwrap() > 0);
    }

    #[test]
    fn watchdog_interval_parsing() {
        let me = 4242;
        assert_eq!(watchdog_interval_from(None, None, me), None);
        assert_eq!(
            watchdog_interval_from(Some("30000000"), None, me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            watchdog_interval_from(Some("30000000"), Some("4242"), me),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            watchdog_interval_from(Some("30000000"), Some("1"), me),
            None
        );
        assert_eq!(watchdog_interval_from(Some("0"), None, me), None);
        assert_eq!(watchdog_interval_from(Some("soon"), None, me), None);
        assert_eq!(watchdog_interval_from(Some("5"), Some("x"), me), None);
    }

    #[test]
    fn listen_fd_names_parsing() {
        let me = 77;
        let parse = |pid, fds, names| listen_fd_names_from(pid, fds, names, me);
        assert_eq!(parse(None, None, None).unwrap(), None);
        assert_eq!(parse(Some("77"), None, None).unwrap(), None);
        assert_eq!(parse(Some("76"), Some("1"), None).unwrap(), None);
        assert_eq!(parse(Some("77"), Some("0"), None).unwrap(), None);
        assert_eq!(
            parse(Some("77"), Some("2"), None).unwrap(),
            Some(vec![None, None])
        );
        assert_eq!(
            parse(Some("77"), Some("2"), Some("admin:worker")).unwrap(),
            Some(vec![Some("admin".into()), Some("worker".into())])
        );
        assert_eq!(
            parse(Some("77"), Some("2"), Some(":worker")).unwrap(),
            Some(vec![None, Some("worker".into())])
        );
        let e = parse(Some("77"), Some("2"), Some("worker")).unwrap_err();
        assert!(e.to_string().contains("1 names for LISTEN_FDS=2"), "{e}");
        assert!(parse(Some("x"), Some("1"), None).is_err());
        assert!(parse(Some("77"), Some("one"), None).is_err());
        assert!(parse(Some("77"), Some("100000"), None).is_err());
    }

    #[test]
    fn sockets_are_picked_by_name_then_by_kind() {
        use SocketKind::*;
        let s = |n: Option<&str>, k| (n.map(String::from), k);
        assert_eq!(pick_sockets(&[s(None, Unix)]), (Some(0), None));
        assert_eq!(
            pick_sockets(&[s(None, Tcp), s(None, Unix)]),
            (Some(1), Some(0))
        );
        assert_eq!(
            pick_sockets(&[
                s(Some("x"), Unix),
                s(Some("worker"), Unix),
                s(None, Tcp),
                s(Some("admin"), Tcp)
            ]),
            (Some(1), Some(3))
        );
        // A name on the wrong kind of socket does not count.
        assert_eq!(pick_sockets(&[s(Some("worker"), Tcp)]), (None, Some(0)));
        assert_eq!(pick_sockets(&[s(None, Other)]), (None, None));
    }
}
