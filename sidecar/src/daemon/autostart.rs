//! §20: the lock file of an autostarted sidecar, `SOCKET.lock` beside its socket.
//!
//! The lock (`flock`, exclusive) is what makes "exactly one sidecar per socket" hold
//! when many clients find nothing listening at once. A client that can `flock` (Python,
//! Go) takes it, checks the socket once more, starts the sidecar with the locked file
//! as an inherited descriptor (`--lock-fd N`) and closes its own copy: the lock is
//! then the sidecar's, held from before the decision to start until the sidecar's
//! exit, so no second starter ever gets between them. A client that cannot (Node.js)
//! starts the sidecar without one; the sidecar then takes the lock itself and, if
//! another process holds it (a starting client or a running sidecar), exits with
//! [`EXIT_BUSY`], which such a client reads as "someone else is starting it: keep
//! connecting".
//!
//! The file is removed when the sidecar exits, and only while it is still the one
//! this process locked (same device and inode): a client that locked the unlinked
//! file checks the same and opens the path again.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{fcntl, FcntlArg, FdFlag, Flock, FlockArg};
use tracing::warn;

use super::sockfile;

/// Exit status of an autostarted sidecar that found the lock held by another
/// process (`EX_TEMPFAIL`): not a failure of the start, another one is under way.
pub const EXIT_BUSY: u8 = 75;

/// How the sidecar was started by a client's autostart (`--autostarted`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Autostart {
    /// `--lock-fd`: the descriptor of `SOCKET.lock`, already locked by the client
    /// that started this process; `None`: lock it here.
    pub lock_fd: Option<RawFd>,
}

/// Why the lock was not taken.
#[derive(Debug)]
pub(super) enum LockError {
    /// Another process holds it: exit [`EXIT_BUSY`].
    Busy(String),
    /// Anything else (the directory, the descriptor): a failed start.
    Failed(String),
}

/// The lock file beside `socket`: `SOCKET.lock`.
pub fn lock_path(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// The locked `SOCKET.lock`, held for the life of the process.
pub(super) struct SocketLock {
    /// Where it is.
    path: PathBuf,
    /// The locked file (unlocked when dropped; the kernel unlocks it at exit anyway).
    file: Flock<File>,
}

impl SocketLock {
    /// Take the lock beside `socket`: the inherited descriptor `a.lock_fd` (which the
    /// client locked), or the file opened here. The socket's directory is created and
    /// checked first (§12), as binding the socket would.
    pub fn acquire(socket: &Path, a: Autostart) -> Result<SocketLock, LockError> {
        let path = lock_path(socket);
        let dir = match socket.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        sockfile::check_dir(dir).map_err(LockError::Failed)?;
        if let Some(fd) = a.lock_fd {
            let file = inherited(fd)?;
            return Self::lock(path.clone(), file)?.ok_or_else(|| {
                LockError::Failed(format!(
                    "--lock-fd {fd} is not the lock file {} (it was replaced)",
                    path.display()
                ))
            });
        }
        // The file may be unlinked by an exiting sidecar between our open and our
        // lock: then open it again.
        for _ in 0..5 {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
                .map_err(|e| {
                    LockError::Failed(format!("cannot open lock file {}: {e}", path.display()))
                })?;
            if let Some(lock) = Self::lock(path.clone(), file)? {
                return Ok(lock);
            }
        }
        Err(LockError::Busy(format!(
            "the lock file {} keeps being replaced; another sidecar is starting or stopping",
            path.display()
        )))
    }

    /// Lock `file` without waiting; `Ok(None)` when it is no longer the file at `path`.
    fn lock(path: PathBuf, file: File) -> Result<Option<SocketLock>, LockError> {
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(LockError::Busy(format!(
                    "another process holds {}: a sidecar is starting or serving on this \
                     socket already; exiting",
                    path.display()
                )))
            }
            Err((_, e)) => {
                return Err(LockError::Failed(format!(
                    "cannot lock {}: {e}",
                    path.display()
                )))
            }
        };
        let ours = file
            .metadata()
            .map_err(|e| LockError::Failed(format!("cannot inspect {}: {e}", path.display())))?;
        match std::fs::metadata(&path) {
            Ok(m) if (m.dev(), m.ino()) == (ours.dev(), ours.ino()) => {
                Ok(Some(SocketLock { path, file }))
            }
            _ => Ok(None),
        }
    }

    /// Remove the lock file if it is still the one this process locked, then unlock.
    /// Called after the socket is gone, so a client that then finds no lock file
    /// finds no socket either and starts a new sidecar.
    pub fn remove(self) {
        if let (Ok(m), Ok(ours)) = (std::fs::metadata(&self.path), self.file.metadata()) {
            if (m.dev(), m.ino()) == (ours.dev(), ours.ino()) {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    warn!(lock = %self.path.display(), error = %e, "cannot remove the lock file");
                }
            }
        }
    }
}

/// §20: close every descriptor above 2 that this process inherited, but `keep` (the
/// lock's, `--lock-fd`). A client's runtime may hold descriptors without
/// close-on-exec (Go passes on those its own parent gave it; any binding, a pipe a
/// shell set up), and a detached sidecar holding the write end of a caller's pipe
/// keeps a `cmd | cat` from ending until it exits (`idle_exit`, 10 minutes). Call it
/// first thing in `main`, before this process opens anything of its own: every
/// descriptor above 2 is then inherited. Linux's `/proc/self/fd` is read; where it
/// is missing nothing is closed.
pub fn close_inherited(keep: Option<RawFd>) {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<RawFd> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    // The directory's own descriptor is in the list and closed by now: the F_GETFD
    // check below skips it.
    for fd in fds {
        if fd <= 2 || Some(fd) == keep {
            continue;
        }
        // SAFETY: only borrowed for the F_GETFD check.
        let open = fcntl(unsafe { BorrowedFd::borrow_raw(fd) }, FcntlArg::F_GETFD).is_ok();
        if open {
            // SAFETY: `fd` is open and was inherited (nothing in this process has
            // opened a descriptor yet, see above), so nothing here owns it; dropping
            // the OwnedFd closes it.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

/// Take ownership of the inherited descriptor `fd` after checking that it is open.
fn inherited(fd: RawFd) -> Result<File, LockError> {
    if fd < 3 {
        return Err(LockError::Failed(format!(
            "--lock-fd {fd}: expected a descriptor above 2 (0-2 are stdin, stdout, stderr)"
        )));
    }
    // SAFETY: only borrowed for the F_GETFD check; nothing is done with `fd` if it
    // is not open.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    fcntl(borrowed, FcntlArg::F_GETFD)
        .map_err(|e| LockError::Failed(format!("--lock-fd {fd}: not an open descriptor ({e})")))?;
    // SAFETY: `fd` is open (checked above) and was handed to this process by the
    // client that started it (`--lock-fd`); nothing else in this process owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // It was inherited without close-on-exec; this process starts nothing, but set it.
    let _ = fcntl(owned.as_fd(), FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
    Ok(File::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    #[test]
    fn one_holder_and_the_file_goes_with_it() {
        let tmp = tempfile::tempdir().unwrap();
        let socket = tmp.path().join("run/s.sock");
        let first = SocketLock::acquire(&socket, Autostart::default()).expect("free lock");
        assert!(lock_path(&socket).exists());
        assert!(matches!(
            SocketLock::acquire(&socket, Autostart::default()),
            Err(LockError::Busy(_))
        ));
        first.remove();
        assert!(!lock_path(&socket).exists(), "removed at exit");
        let again = SocketLock::acquire(&socket, Autostart::default()).expect("free again");
        // A lock file replaced meanwhile is left alone.
        std::fs::remove_file(lock_path(&socket)).unwrap();
        std::fs::write(lock_path(&socket), "").unwrap();
        again.remove();
        assert!(lock_path(&socket).exists());
    }

    #[test]
    fn an_inherited_locked_descriptor_is_taken_over() {
        let tmp = tempfile::tempdir().unwrap();
        let socket = tmp.path().join("s.sock");
        // What a client hands over: the lock file's descriptor (the lock is taken on
        // that same open file, so it is the client's lock continued).
        let fd = File::create(lock_path(&socket)).unwrap().into_raw_fd();
        let lock = SocketLock::acquire(&socket, Autostart { lock_fd: Some(fd) }).expect("ours");
        assert!(matches!(
            SocketLock::acquire(&socket, Autostart::default()),
            Err(LockError::Busy(_))
        ));
        drop(lock);
        assert!(matches!(
            SocketLock::acquire(&socket, Autostart { lock_fd: Some(1) }),
            Err(LockError::Failed(_))
        ));
    }
}
