//! The worker socket's file and directory (§12 "Bounded under abuse"): the directory
//! must not be writable by any other user — one who can write it can replace the
//! socket and impersonate the sidecar to every worker — and shutdown removes the
//! socket file only while it is still the one this process bound (same device and
//! inode), never whatever else now sits at the path. Socket activation never gets
//! here: systemd owns that socket.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tracing::warn;

/// Group and other write bits.
const WRITABLE_BY_OTHERS: u32 = 0o022;
/// The sticky bit: in such a directory only a file's owner may rename or remove it.
const STICKY: u32 = 0o1000;

/// Create `dir` (and its parents, mode 0755) if missing, then refuse it unless no
/// other user can write it: the directory itself must be owned by us or root with no
/// group/other write bit; every ancestor must be owned by us or root and be either
/// not writable by others or sticky (like `/tmp`: nobody else can rename our
/// directory away). The error names the directory, its owner and its mode.
pub(super) fn check_dir(dir: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|e| {
            format!(
                "cannot create socket directory {}: {e}{}",
                dir.display(),
                permission_hint(&e)
            )
        })?;
    let real = std::fs::canonicalize(dir)
        .map_err(|e| format!("cannot resolve socket directory {}: {e}", dir.display()))?;
    let me = nix::unistd::geteuid().as_raw();
    for (i, d) in real.ancestors().enumerate() {
        let meta = std::fs::metadata(d)
            .map_err(|e| format!("cannot inspect {} (socket directory): {e}", d.display()))?;
        let mode = meta.permissions().mode() & 0o7777;
        let owner_ok = meta.uid() == me || meta.uid() == 0;
        let writable = mode & WRITABLE_BY_OTHERS != 0;
        // The socket's own directory may not be sticky-and-writable either: another
        // user could bind the path while no socket is there (before start, after exit).
        let ok = owner_ok && (!writable || (i > 0 && mode & STICKY != 0));
        if !ok {
            let what = if i == 0 {
                format!("socket directory {}", d.display())
            } else {
                format!(
                    "{} (a parent of the socket directory {})",
                    d.display(),
                    dir.display()
                )
            };
            return Err(format!(
                "{what} is owned by {} with mode {mode:04o}: another user could replace the \
                 socket and impersonate the sidecar; refusing to start. Make it owned by \
                 uid {me} or root and not writable by group or others (e.g. chmod 0755), \
                 or choose another sidecar.socket",
                owner_name(meta.uid()),
            ));
        }
    }
    Ok(())
}

/// §12: what to change after a permission error on the socket's path (empty for
/// any other error).
pub(super) fn permission_hint(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::PermissionDenied {
        "; set [sidecar] socket (or SIDECAR__SOCKET) to a path this user may create, \
         e.g. under $XDG_RUNTIME_DIR (the default for a non-root user when the key is \
         unset), and point workers at it with POLYGATE_SOCKET"
    } else {
        ""
    }
}

/// `uid 1000 (alice)`, or just the uid when it has no name.
fn owner_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => format!("uid {uid} ({})", u.name),
        _ => format!("uid {uid}"),
    }
}

/// The socket file this process bound, identified by device and inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SocketFile {
    /// Where it was bound.
    pub path: PathBuf,
    /// `st_dev` right after the bind.
    dev: u64,
    /// `st_ino` right after the bind.
    ino: u64,
}

impl SocketFile {
    /// The file now at `path` (call right after binding it).
    pub fn bound_at(path: PathBuf) -> io::Result<Self> {
        let m = std::fs::symlink_metadata(&path)?;
        Ok(SocketFile {
            dev: m.dev(),
            ino: m.ino(),
            path,
        })
    }

    /// Remove the file if it is still ours; another file at the path (someone
    /// replaced the socket) is left alone and logged.
    pub fn remove_if_ours(&self) {
        let p = &self.path;
        match std::fs::symlink_metadata(p) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!(socket = %p.display(), error = %e, "cannot inspect the socket file"),
            Ok(m) if (m.dev(), m.ino()) != (self.dev, self.ino) => warn!(
                socket = %p.display(),
                "the socket path now holds a file this process did not create; left in place"
            ),
            Ok(_) => match std::fs::remove_file(p) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => warn!(socket = %p.display(), error = %e, "cannot remove the socket file"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_directory_passes_and_an_open_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run/polygate");
        check_dir(&dir).expect("created 0755, ours");
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & WRITABLE_BY_OTHERS, 0, "{mode:o}");
        for mode in [0o777, 0o775, 0o1777, 0o757] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = check_dir(&dir).unwrap_err();
            assert!(e.contains(&dir.display().to_string()), "{e}");
            assert!(e.contains(&format!("{mode:04o}")), "{e}");
        }
        // A sticky, world-writable parent (like /tmp) is fine.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(
            dir.parent().unwrap(),
            std::fs::Permissions::from_mode(0o1777),
        )
        .unwrap();
        check_dir(&dir).expect("sticky parent");
        std::fs::set_permissions(
            dir.parent().unwrap(),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        let e = check_dir(&dir).unwrap_err();
        assert!(e.contains("a parent of the socket directory"), "{e}");
    }

    #[test]
    fn only_our_own_socket_file_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let _ours = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let file = SocketFile::bound_at(path.clone()).unwrap();
        std::fs::rename(&path, tmp.path().join("moved.sock")).unwrap();
        let _theirs = std::os::unix::net::UnixListener::bind(&path).unwrap();
        file.remove_if_ours();
        assert!(path.exists(), "another process's socket is left alone");
        std::fs::remove_file(&path).unwrap();
        std::fs::rename(tmp.path().join("moved.sock"), &path).unwrap();
        file.remove_if_ours();
        assert!(!path.exists(), "ours is removed");
        file.remove_if_ours(); // already gone: nothing to do
    }
}
