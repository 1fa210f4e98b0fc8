//! Running the daemon (§12): the runtime and logging, then the engine served on the
//! worker socket until a signal stops it.
//!
//! Start-up order matters and is kept here in one place: the backend (Redis is
//! connected lazily, so this works while it is down), the signal handlers (before any
//! socket exists, so an early SIGTERM drains cleanly), the admin listener (if its
//! address is taken, exit before a worker can connect), the worker socket, then
//! `READY=1`. The pieces: `listen` (sockets), `signals` (SIGTERM,
//! SIGINT, SIGHUP and reload), [`systemd`] (sd_notify, socket activation, watchdog),
//! and for §20 [`autostart`] (the lock file of a sidecar a client started) and `idle`
//! (`idle_exit`). An autostarted sidecar takes its lock before anything is bound.

pub mod autostart;
pub mod fdlimit;
mod idle;
mod listen;
mod signals;
mod sockfile;
pub mod systemd;

use std::io::{self, IsTerminal};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::backend::{AdminEvent, AnyBackend, Backend};
use crate::clock::{Clock, MonotonicClock};
use crate::config::{Config, LogFormat};
use crate::engine::Engine;
use crate::metrics::{self, Exposition, SharedView};
use crate::server::{self, ServerOptions};
use autostart::{Autostart, LockError, SocketLock};
use signals::{Lifecycle, Reload};
use systemd::sd_notify;

/// Extra time past `shutdown_grace` before the process stops waiting for itself.
const EXIT_SLACK: Duration = Duration::from_secs(2);

/// Run the daemon on `config` (read from `path`, which SIGHUP re-reads; `None`: the
/// embedded example) until it is stopped; the process's exit status. `autostart`:
/// started by a client's autostart (`--autostarted`, §20).
pub fn run(config: Config, path: Option<PathBuf>, autostart: Option<Autostart>) -> ExitCode {
    init_tracing(config.sidecar.log_format);
    let rt = match runtime(config.sidecar.worker_threads) {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(serve(config, path, autostart));
    // Request tasks still stuck (e.g. on a dead backend) must not hold up the exit.
    rt.shutdown_timeout(Duration::from_millis(200));
    code
}

/// The runtime of `sidecar.worker_threads`: one thread is tokio's current-thread
/// scheduler (what linkerd2-proxy does for one core too: no work stealing, no
/// cross-thread wake-ups), more is the work-stealing one with that many workers.
fn runtime(threads: Option<usize>) -> io::Result<tokio::runtime::Runtime> {
    let mut b = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    b.enable_all().build()
}

/// Logging to stderr at `RUST_LOG` (default `info`): human lines, or with
/// `log_format = "json"` one JSON object per line (`timestamp`, `level`, `fields`
/// with `message`, `target`) from tracing-subscriber's own JSON formatter.
fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr);
    // Under systemd the journal stamps every line itself.
    let journal = std::env::var_os("JOURNAL_STREAM").is_some();
    match (format, journal) {
        (LogFormat::Json, _) => fmt.json().with_span_list(false).init(),
        (LogFormat::Text, true) => fmt.with_ansi(false).without_time().init(),
        (LogFormat::Text, false) => fmt.with_ansi(io::stderr().is_terminal()).init(),
    }
}

/// Set everything up in order, serve, and clean up the socket file.
async fn serve(config: Config, path: Option<PathBuf>, autostart: Option<Autostart>) -> ExitCode {
    // The connection cap must fit the fd limit, or workers past it would hang in the
    // backlog: refuse a config that cannot hold, before anything is bound.
    let max_connections = match fdlimit::raise_nofile()
        .and_then(|nofile| fdlimit::connection_cap(config.sidecar.max_connections, nofile))
    {
        Ok(n) => n,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    // Redis is connected lazily: this succeeds while it is down.
    let backend = match AnyBackend::from_config(&config, clock.clone()).await {
        Ok(b) => b,
        Err(e) => {
            error!("{} backend: {e}", config.sidecar.backend.as_str());
            return ExitCode::FAILURE;
        }
    };
    // Signal handlers go in before the socket exists: a client (or systemd) may signal
    // as soon as it can connect, and an early SIGTERM/SIGINT must shut down cleanly
    // rather than kill the process with the default action.
    let lifecycle = Lifecycle::default();
    let (reload_tx, reload_rx) = tokio::sync::mpsc::unbounded_channel();
    let signals = match signals::spawn_handlers(lifecycle.clone(), reload_tx) {
        Ok(h) => h,
        Err(e) => {
            error!(error = %e, "cannot install signal handlers");
            return ExitCode::FAILURE;
        }
    };
    let (passed_worker, passed_admin) = match systemd::listen_fds() {
        Ok(a) => a.map_or((None, None), |a| (Some(a.worker), a.admin)),
        Err(e) => {
            error!("{e}");
            signals.abort();
            return ExitCode::FAILURE;
        }
    };
    // §20: an autostarted sidecar holds the lock beside its socket from here to its
    // exit; one that finds it held leaves at once (another start is under way).
    let lock = match autostart {
        Some(a) if passed_worker.is_none() => {
            match SocketLock::acquire(Path::new(&config.sidecar.socket), a) {
                Ok(l) => Some(l),
                Err(LockError::Busy(e)) => {
                    info!("{e}");
                    signals.abort();
                    return ExitCode::from(autostart::EXIT_BUSY);
                }
                Err(LockError::Failed(e)) => {
                    error!("{e}");
                    signals.abort();
                    return ExitCode::FAILURE;
                }
            }
        }
        _ => None,
    };
    // The admin listener first: if its address is taken, exit before the worker socket
    // exists, so no worker ever connects to a daemon that is about to go away.
    // A start that fails from here on removes the lock file it made.
    let fail = |e: &dyn std::fmt::Display, lock: Option<SocketLock>| {
        error!("{e}");
        signals.abort();
        if let Some(lock) = lock {
            lock.remove();
        }
        ExitCode::FAILURE
    };
    let admin = match listen::admin(&config, passed_admin).await {
        Ok(l) => l,
        Err(e) => return fail(&e, lock),
    };
    let bound = match listen::listen(&config, passed_worker) {
        Ok(b) => b,
        Err(e) => return fail(&e, lock),
    };
    let reload = Reload {
        requests: reload_rx,
        path,
    };
    let listeners = Listeners {
        worker: bound.listener,
        admin,
    };
    let limits = Limits {
        max_connections,
        idle_exit: config.sidecar.idle_exit.resolve(autostart.is_some()),
    };
    let code = run_engine(
        &config, lifecycle, reload, backend, clock, listeners, limits,
    )
    .await;
    signals.abort();
    listen::remove_created(bound.created.as_ref());
    // After the socket: a client that finds no lock file finds no socket either.
    if let Some(lock) = lock {
        lock.remove();
    }
    info!("stopped");
    code
}

/// The limits derived at start-up (from the config, the process's fd limit and how
/// it was started).
struct Limits {
    /// Worker connections served at once (`sidecar.max_connections`, checked against
    /// `RLIMIT_NOFILE`).
    max_connections: u32,
    /// §20 `sidecar.idle_exit` for this process (autostarted or not); `None`: never.
    idle_exit: Option<Duration>,
}

/// The bound sockets the daemon serves.
struct Listeners {
    /// The worker socket.
    worker: UnixListener,
    /// `sidecar.admin_listen`, when set.
    admin: Option<TcpListener>,
}

/// The engine and its companions (admin HTTP, reloader, watchdog, admin events) from
/// READY=1 until the worker server has drained or the drain is cut short.
async fn run_engine(
    config: &Config,
    lifecycle: Lifecycle,
    reload: Reload,
    backend: AnyBackend,
    clock: Arc<dyn Clock>,
    listeners: Listeners,
    limits: Limits,
) -> ExitCode {
    let admin_events = backend.admin_events();
    let remote = backend.is_remote();
    let engine = Engine::new(config, backend, clock);
    let admin_sync = admin_events.map(|rx| tokio::spawn(apply_admin_events(rx, engine.clone())));
    let opts = ServerOptions {
        max_connections: limits.max_connections as usize,
        ..ServerOptions::from_config(&config.sidecar)
    };
    // /metrics reads a remote backend in the background, never per scrape.
    let shared = (remote && listeners.admin.is_some()).then(Arc::<SharedView>::default);
    let refresh = shared
        .clone()
        .map(|view| metrics::spawn_refresh(engine.clone(), view, config.sidecar.metrics_refresh));
    let exposition = Exposition {
        engine: engine.clone(),
        server: opts.metrics.clone(),
        shared,
    };
    let grace = opts.shutdown_grace;
    let stop = lifecycle.stop.clone();
    // The admin listener outlives `stop`: it serves until the worker server has
    // drained, so `/ready` answers 503 during the drain.
    let admin_stop = CancellationToken::new();
    let admin_http = listeners.admin.map(|l| {
        match l.local_addr() {
            Ok(addr) => info!(%addr, "admin listener: /live /ready /metrics"),
            Err(_) => info!("admin listener: /live /ready /metrics"),
        }
        tokio::spawn(crate::admin_http::serve(
            l,
            exposition,
            admin_stop.clone().cancelled_owned(),
        ))
    });
    let reloader = signals::spawn_reloader(
        reload,
        engine.clone(),
        config.sidecar.clone(),
        lifecycle.clone(),
    );
    let watchdog = systemd::spawn_watchdog();
    let log_flusher = Some(crate::logs::spawn_flusher());
    let idle = limits.idle_exit.map(|after| {
        info!(
            idle_exit = %humantime::format_duration(after),
            "exits after sidecar.idle_exit without a connection"
        );
        idle::spawn(opts.stats.clone(), after, lifecycle.clone())
    });

    info!(
        version = env!("CARGO_PKG_VERSION"),
        backend = engine.backend_name(),
        scopes = config.scopes.len(),
        max_connections = limits.max_connections,
        "polygate-sidecar ready"
    );
    {
        // A SIGTERM during startup already said STOPPING=1.
        let _order = lifecycle.notify_lock();
        if !stop.is_cancelled() {
            sd_notify("READY", systemd::ready());
        }
    }

    let run = server::run(
        listeners.worker,
        engine,
        opts,
        stop.clone().cancelled_owned(),
    );
    let forced = async {
        stop.cancelled().await;
        tokio::time::sleep(grace + EXIT_SLACK).await;
    };
    let code = tokio::select! {
        r = run => match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                error!("{e}");
                ExitCode::FAILURE
            }
        },
        () = forced => {
            warn!("shutdown did not finish within {:?}; exiting anyway", grace + EXIT_SLACK);
            ExitCode::SUCCESS
        }
        // Logged by the signal handler.
        () = lifecycle.force.cancelled() => ExitCode::SUCCESS,
    };
    admin_stop.cancel();
    reloader.abort();
    for task in [watchdog, admin_sync, admin_http, refresh, log_flusher, idle]
        .into_iter()
        .flatten()
    {
        task.abort();
    }
    code
}

/// §9: admin events from the shared backend (any host's force_open / force_close /
/// reset), applied to this host's engine as they arrive.
async fn apply_admin_events(
    mut rx: broadcast::Receiver<AdminEvent>,
    engine: Arc<Engine<AnyBackend>>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        match rx.recv().await {
            Ok(ev) => engine.apply_admin_event(&ev),
            Err(RecvError::Lagged(n)) => warn!(missed = n, "admin events were dropped"),
            Err(RecvError::Closed) => return,
        }
    }
}
