//! Signals and what they drive (§12): SIGTERM/SIGINT stop accepting and drain (a
//! second one exits at once); SIGHUP reloads the configuration file.
//!
//! [`Lifecycle`] is the shutdown state the signal handler and the reloader share; its
//! lock orders the systemd notifications, so systemd never hears `READY=1` after
//! `STOPPING=1`.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::systemd::{self, sd_notify};
use crate::backend::AnyBackend;
use crate::config::{self, SidecarConfig};
use crate::engine::Engine;

/// Shutdown as the signals drive it, shared by the signal handler and the reloader.
#[derive(Clone, Default)]
pub(super) struct Lifecycle {
    /// The first SIGTERM/SIGINT: stop accepting and drain.
    pub stop: CancellationToken,
    /// A second one while draining: exit now.
    pub force: CancellationToken,
    /// Held while cancelling `stop` and sending STOPPING=1, and while a reload checks
    /// `stop` and sends READY=1: systemd never hears READY=1 after STOPPING=1.
    notify: Arc<std::sync::Mutex<()>>,
}

impl Lifecycle {
    /// Hold this while deciding on, and sending, a systemd state change.
    pub(super) fn notify_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.notify.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// SIGTERM/SIGINT cancel `stop` (after telling systemd); a second one while draining
/// cancels `force` (exit now). SIGHUP asks for a reload on `reload`, unless shutdown
/// has begun.
pub(super) fn spawn_handlers(
    lifecycle: Lifecycle,
    reload: mpsc::UnboundedSender<()>,
) -> io::Result<tokio::task::JoinHandle<()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    Ok(tokio::spawn(async move {
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
                _ = hup.recv() => {
                    if lifecycle.stop.is_cancelled() {
                        info!("SIGHUP: shutting down; not reloading");
                    } else {
                        let _ = reload.send(());
                    }
                    continue;
                }
            };
            let guard = lifecycle.notify_lock();
            if lifecycle.stop.is_cancelled() {
                drop(guard);
                warn!("{name} again while draining: exiting now, without waiting for the drain");
                lifecycle.force.cancel();
            } else {
                info!("{name}: shutting down");
                sd_notify("STOPPING", systemd::stopping());
                lifecycle.stop.cancel();
            }
        }
    }))
}

/// SIGHUP requests and the file to re-read.
pub(super) struct Reload {
    /// One message per SIGHUP.
    pub requests: mpsc::UnboundedReceiver<()>,
    /// The `--config` file (`None`: the embedded example, nothing to reload).
    pub path: Option<PathBuf>,
}

/// Serve every reload request until the channel closes (or the task is aborted).
/// `running` is the `[sidecar]` table the daemon started with.
pub(super) fn spawn_reloader(
    reload: Reload,
    engine: Arc<Engine<AnyBackend>>,
    running: SidecarConfig,
    lifecycle: Lifecycle,
) -> tokio::task::JoinHandle<()> {
    let Reload { mut requests, path } = reload;
    tokio::spawn(async move {
        while requests.recv().await.is_some() {
            apply_reload(&engine, path.as_deref(), &running, &lifecycle);
        }
    })
}

/// SIGHUP: re-read the file (with the environment's overrides) and apply it to the
/// running engine. An invalid file, or one that adds/removes scopes or sources, is
/// refused whole and the running configuration stays; `[sidecar]` changes (socket,
/// backend, access lists, …) are reported as needing a restart. Once shutdown has
/// begun nothing is reloaded, and systemd is told nothing.
fn apply_reload(
    engine: &Engine<AnyBackend>,
    path: Option<&Path>,
    running: &SidecarConfig,
    lifecycle: &Lifecycle,
) {
    {
        let _order = lifecycle.notify_lock();
        if lifecycle.stop.is_cancelled() {
            info!("SIGHUP: shutting down; not reloading");
            return;
        }
        sd_notify("RELOADING", systemd::reloading());
    }
    match path {
        None => info!("SIGHUP: running on the embedded example configuration; nothing to reload"),
        Some(file) => match config::load(path, std::env::vars()) {
            Err(e) => error!(
                file = %file.display(),
                "SIGHUP: the configuration file {} is invalid, keeping the running configuration: {e}",
                file.display()
            ),
            Ok(new) => {
                if new.sidecar != *running {
                    warn!("SIGHUP: [sidecar] settings changed; they apply on restart");
                }
                match engine.reload(&new) {
                    Ok(changes) if changes.is_empty() => {
                        info!("SIGHUP: configuration reloaded, no scope or source changed")
                    }
                    Ok(changes) => info!(?changes, "SIGHUP: configuration reloaded"),
                    Err(e) => error!("SIGHUP: {e}"),
                }
            }
        },
    }
    let _order = lifecycle.notify_lock();
    if !lifecycle.stop.is_cancelled() {
        sd_notify("READY", systemd::ready());
    }
}
