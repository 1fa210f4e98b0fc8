//! The sockets the daemon serves (§12): the worker socket — passed by systemd
//! (socket activation) or bound here with exactly `socket_mode`, in a directory no
//! other user can write (`sockfile`), replacing only a stale socket file — and the
//! optional admin HTTP listener (passed by systemd too, or bound at `admin_listen`).

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::{TcpListener, UnixListener};
use tracing::{info, warn};

use super::sockfile::{self, SocketFile};
use crate::config::Config;

/// A bound worker listener, and the socket file to remove on exit when we created it.
pub(super) struct Bound {
    /// Accepts worker connections.
    pub listener: UnixListener,
    /// The socket file this process created (`None` when socket-activated).
    pub created: Option<SocketFile>,
}

/// Remove the socket file this process created (`created` of [`Bound`]) if it is
/// still there; never a file it did not create, even at the same path.
pub(super) fn remove_created(created: Option<&SocketFile>) {
    if let Some(f) = created {
        f.remove_if_ours();
    }
}

/// The admin listener: the one systemd passed (socket activation), else
/// `sidecar.admin_listen` bound (`Ok(None)` when unset); the error names the key.
pub(super) async fn admin(
    c: &Config,
    passed: Option<std::net::TcpListener>,
) -> Result<Option<TcpListener>, String> {
    if let Some(l) = passed {
        let tokio = l
            .set_nonblocking(true)
            .and_then(|()| TcpListener::from_std(l));
        let l = tokio.map_err(|e| format!("socket-activated admin listener: {e}"))?;
        info!("using the admin socket passed by systemd (socket activation)");
        if let Ok(addr) = l.local_addr() {
            warn_if_exposed(addr);
        }
        return Ok(Some(l));
    }
    match c.sidecar.admin_listen {
        None => Ok(None),
        Some(addr) => {
            let l = TcpListener::bind(addr)
                .await
                .map_err(|e| format!("sidecar.admin_listen = {addr}: cannot bind: {e}"))?;
            warn_if_exposed(addr);
            Ok(Some(l))
        }
    }
}

/// §12: the admin listener has no authentication (`/metrics` names every source and
/// its state), so one reachable beyond this host is worth a warning at start.
fn warn_if_exposed(addr: std::net::SocketAddr) {
    if !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "sidecar.admin_listen is not a loopback address: /live, /ready and /metrics \
             are served without authentication to anyone who can reach it (source names, \
             breaker and quota state); bind 127.0.0.1 or ::1, or firewall the port"
        );
    }
}

/// The listening socket: the one systemd passed (socket activation), else our own.
pub(super) fn listen(
    c: &Config,
    passed: Option<std::os::unix::net::UnixListener>,
) -> Result<Bound, String> {
    if let Some(std_listener) = passed {
        std_listener
            .set_nonblocking(true)
            .map_err(|e| format!("socket-activated listener: {e}"))?;
        let listener = UnixListener::from_std(std_listener)
            .map_err(|e| format!("socket-activated listener: {e}"))?;
        info!("using the socket passed by systemd (socket activation)");
        return Ok(Bound {
            listener,
            created: None,
        });
    }
    let path = PathBuf::from(&c.sidecar.socket);
    let fail = |what: &str, e: io::Error| {
        let hint = sockfile::permission_hint(&e);
        format!("{what} {}: {e}{hint}", path.display())
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    sockfile::check_dir(dir)?;
    remove_stale_socket(&path)?;
    // Bind with a tight umask so the socket never exists with looser permissions
    // than `socket_mode`, then widen it to exactly that.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(&path);
    nix::sys::stat::umask(old);
    let listener = bound.map_err(|e| fail("cannot bind", e))?;
    std::fs::set_permissions(
        &path,
        std::fs::Permissions::from_mode(c.sidecar.socket_mode),
    )
    .map_err(|e| fail("cannot set the mode of", e))?;
    let created = SocketFile::bound_at(path.clone()).map_err(|e| fail("cannot inspect", e))?;
    info!(socket = %path.display(), mode = format_args!("{:o}", c.sidecar.socket_mode), "listening");
    Ok(Bound {
        listener,
        created: Some(created),
    })
}

/// Remove a socket file nobody listens on; refuse to touch a live socket or a file
/// that is not a socket.
fn remove_stale_socket(path: &Path) -> Result<(), String> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("cannot inspect {}: {e}", path.display())),
    };
    if !meta.file_type().is_socket() {
        return Err(format!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(format!(
            "another process is already listening on {}",
            path.display()
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            warn!(socket = %path.display(), "removing a stale socket file");
            std::fs::remove_file(path)
                .map_err(|e| format!("cannot remove stale socket {}: {e}", path.display()))
        }
        Err(e) => Err(format!(
            "cannot tell whether {} is in use: {e}",
            path.display()
        )),
    }
}
