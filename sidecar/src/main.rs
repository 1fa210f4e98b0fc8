//! `polygate-sidecar`: the daemon, `--check-config`, and the `status` client.
//!
//! A thin shell over the `polygate` library: configuration, socket setup, systemd
//! integration and signals live here; everything else is [`polygate::server::run`].

use std::io::{self, IsTerminal};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use futures_util::{SinkExt, StreamExt};
use ipc_protocol::{ClientCodec, ClientFrame, Reply, Request};
use polygate::backend::redis::{AdminEvent, AdminOp};
use polygate::backend::AnyBackend;
use polygate::clock::{Clock, TokioClock};
use polygate::config::{self, Config};
use polygate::engine::Engine;
use polygate::server::{self, ServerOptions};
use polygate::{notify, status_print};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Where `status` looks when neither `--socket`, `$POLYGATE_SOCKET` nor `--config`
/// says otherwise.
const DEFAULT_SOCKET: &str = "/run/polygate/sidecar.sock";
/// Exit status for an invalid configuration (also clap's usage-error status).
const EXIT_CONFIG: u8 = 2;
/// Extra time past `shutdown_grace` before the process stops waiting for itself.
const EXIT_SLACK: Duration = Duration::from_secs(2);
/// How long `status` waits for the sidecar.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// PolyGate per-host admission sidecar.
#[derive(Debug, Parser)]
#[command(name = "polygate-sidecar", version, about, long_about = None)]
struct Cli {
    /// TOML configuration file; without it the embedded example configuration is
    /// used. `{SCOPE}__{KEY}` environment variables override scope keys.
    #[arg(long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,
    /// Validate the configuration, print a one-line summary and exit.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the live state of a running sidecar (every scope and source).
    Status {
        /// The sidecar's socket [default: $POLYGATE_SOCKET, else the --config
        /// file's socket, else /run/polygate/sidecar.sock].
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Status { socket }) => {
            let socket =
                match socket.or_else(|| std::env::var_os("POLYGATE_SOCKET").map(Into::into)) {
                    Some(s) => s,
                    None if cli.config.is_some() => match load_config(cli.config.as_deref()) {
                        Ok(c) => c.sidecar.socket.into(),
                        Err(code) => return code,
                    },
                    None => DEFAULT_SOCKET.into(),
                };
            status(&socket)
        }
        None => {
            let config = match load_config(cli.config.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if cli.check_config {
                println!("{}", summary(&config, cli.config.as_deref()));
                return ExitCode::SUCCESS;
            }
            daemon(config, cli.config)
        }
    }
}

/// The configuration from `path` (or the embedded example) with environment
/// overrides; on error the message goes to stderr and the exit code is returned.
fn load_config(path: Option<&Path>) -> Result<Config, ExitCode> {
    read_config(path).map_err(|e| {
        let origin = path.map_or("embedded example configuration".into(), |p| {
            p.display().to_string()
        });
        eprintln!("polygate-sidecar: invalid configuration ({origin}): {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

/// One line: what `--check-config` validated.
fn summary(c: &Config, path: Option<&Path>) -> String {
    let scopes: Vec<String> = c
        .scopes
        .iter()
        .map(|s| {
            format!(
                "{} ({} source{})",
                s.name,
                s.sources.len(),
                if s.sources.len() == 1 { "" } else { "s" }
            )
        })
        .collect();
    let backend = c.sidecar.backend.as_str();
    format!(
        "configuration OK ({}): {} scope{}: {}; backend {backend}; socket {}",
        path.map_or("embedded example".into(), |p| p.display().to_string()),
        c.scopes.len(),
        if c.scopes.len() == 1 { "" } else { "s" },
        scopes.join(", "),
        c.sidecar.socket,
    )
}

// ---------------------------------------------------------------------------------
// status client

fn status(socket: &Path) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("polygate-sidecar status: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let fetch = async { tokio::time::timeout(STATUS_TIMEOUT, fetch_status(socket)).await };
    match rt.block_on(fetch) {
        Ok(Ok(report)) => {
            print!("{}", status_print::render(&report));
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!("polygate-sidecar status: {}: {e}", socket.display());
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!(
                "polygate-sidecar status: {}: no answer within {STATUS_TIMEOUT:?}",
                socket.display()
            );
            ExitCode::FAILURE
        }
    }
}

async fn fetch_status(socket: &Path) -> Result<ipc_protocol::StatusReport, String> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    // A status report may be larger than a request frame: accept up to the decoder's limit.
    let mut framed = Framed::new(stream, ClientCodec::new(ipc_protocol::codec::DECODE_LIMIT));
    let mut ask = async |id: u64, request: Request| -> Result<Reply, String> {
        framed
            .send(ClientFrame { id, request })
            .await
            .map_err(|e| format!("send failed: {e}"))?;
        loop {
            match framed.next().await {
                Some(Ok(f)) if f.id == id => return Ok(f.reply),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(format!("receive failed: {e}")),
                None => return Err("the sidecar closed the connection".into()),
            }
        }
    };
    let hello = Request::Hello {
        protocol_version: ipc_protocol::PROTOCOL_VERSION,
        client_name: format!("polygate-sidecar-status/{}", env!("CARGO_PKG_VERSION")),
        pid: std::process::id(),
    };
    match ask(1, hello).await? {
        Reply::Welcome { .. } => {}
        Reply::Error(e) => return Err(format!("{:?}: {}", e.kind, e.message)),
        other => return Err(format!("unexpected answer to Hello: {other:?}")),
    }
    match ask(2, Request::Status).await? {
        Reply::Status(report) => Ok(report),
        Reply::Error(e) => Err(format!("{:?}: {}", e.kind, e.message)),
        other => Err(format!("unexpected answer to Status: {other:?}")),
    }
}

// ---------------------------------------------------------------------------------
// daemon

fn daemon(config: Config, path: Option<PathBuf>) -> ExitCode {
    init_tracing();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(serve(config, path));
    // Request tasks still stuck (e.g. on a dead backend) must not hold up the exit.
    rt.shutdown_timeout(Duration::from_millis(200));
    code
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .with_ansi(io::stderr().is_terminal());
    // Under systemd the journal stamps every line itself.
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        fmt.without_time().init();
    } else {
        fmt.init();
    }
}

/// A bound listener, and the socket file to remove on exit when we created it.
struct Bound {
    listener: UnixListener,
    created: Option<PathBuf>,
}

async fn serve(config: Config, path: Option<PathBuf>) -> ExitCode {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
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
    let signals = match spawn_signal_handlers(lifecycle.clone(), reload_tx) {
        Ok(h) => h,
        Err(e) => {
            error!(error = %e, "cannot install signal handlers");
            return ExitCode::FAILURE;
        }
    };
    // The admin listener first: if its address is taken, exit before the worker socket
    // exists, so no worker ever connects to a daemon that is about to go away.
    let admin = match config.sidecar.admin_listen {
        None => None,
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                error!("sidecar.admin_listen = {addr}: cannot bind: {e}");
                signals.abort();
                return ExitCode::FAILURE;
            }
        },
    };
    let bound = match listen(&config) {
        Ok(b) => b,
        Err(e) => {
            error!("{e}");
            signals.abort();
            return ExitCode::FAILURE;
        }
    };
    let reload = Reload {
        requests: reload_rx,
        path,
    };
    let listeners = Listeners {
        worker: bound.listener,
        admin,
    };
    let code = run_engine(&config, lifecycle, reload, backend, clock, listeners).await;
    signals.abort();
    if let Some(p) = bound.created {
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => warn!(socket = %p.display(), error = %e, "cannot remove the socket file"),
        }
    }
    info!("stopped");
    code
}

/// Shutdown as the signals drive it, shared by the signal handler and the reloader.
#[derive(Clone, Default)]
struct Lifecycle {
    /// The first SIGTERM/SIGINT: stop accepting and drain.
    stop: CancellationToken,
    /// A second one while draining: exit now.
    force: CancellationToken,
    /// Held while cancelling `stop` and sending STOPPING=1, and while a reload checks
    /// `stop` and sends READY=1: systemd never hears READY=1 after STOPPING=1.
    notify: Arc<std::sync::Mutex<()>>,
}

impl Lifecycle {
    fn notify_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.notify.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The bound sockets the daemon serves.
struct Listeners {
    worker: UnixListener,
    /// `sidecar.admin_listen`, when set.
    admin: Option<tokio::net::TcpListener>,
}

/// SIGHUP requests and the file to re-read.
struct Reload {
    /// One message per SIGHUP.
    requests: tokio::sync::mpsc::UnboundedReceiver<()>,
    /// The `--config` file (`None`: the embedded example, nothing to reload).
    path: Option<PathBuf>,
}

async fn run_engine(
    config: &Config,
    lifecycle: Lifecycle,
    reload: Reload,
    backend: AnyBackend,
    clock: Arc<dyn Clock>,
    listeners: Listeners,
) -> ExitCode {
    let admin_events = backend.admin_events();
    let engine = Engine::new(config, backend, clock);
    let admin_sync = admin_events.map(|rx| tokio::spawn(apply_admin_events(rx, engine.clone())));
    let opts = ServerOptions::from_config(&config.sidecar);
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
        tokio::spawn(polygate::admin_http::serve(
            l,
            engine.clone(),
            admin_stop.clone().cancelled_owned(),
        ))
    });
    let reloader = {
        let engine = engine.clone();
        let running = config.sidecar.clone();
        let lifecycle = lifecycle.clone();
        let Reload { mut requests, path } = reload;
        tokio::spawn(async move {
            while requests.recv().await.is_some() {
                apply_reload(&engine, path.as_deref(), &running, &lifecycle);
            }
        })
    };
    let watchdog = notify::watchdog_interval().map(|every| {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every / 2);
            loop {
                tick.tick().await;
                sd_notify("WATCHDOG", notify::watchdog());
            }
        })
    });

    info!(
        version = env!("CARGO_PKG_VERSION"),
        backend = engine.backend_name(),
        scopes = config.scopes.len(),
        "polygate-sidecar ready"
    );
    {
        // A SIGTERM during startup already said STOPPING=1.
        let _order = lifecycle.notify_lock();
        if !stop.is_cancelled() {
            sd_notify("READY", notify::ready());
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
    for task in [watchdog, admin_sync, admin_http].into_iter().flatten() {
        task.abort();
    }
    code
}

/// §9: an operator's force_close / reset on any host clears this host's memo entry.
async fn apply_admin_events(
    mut rx: tokio::sync::broadcast::Receiver<AdminEvent>,
    engine: Arc<Engine<AnyBackend>>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        match rx.recv().await {
            Ok(ev) => {
                info!(source = %ev.source, op = ?ev.op, "admin event from the shared backend");
                if matches!(ev.op, AdminOp::ForceClose | AdminOp::Reset) {
                    engine.clear_memo(&ev.source);
                }
            }
            Err(RecvError::Lagged(n)) => warn!(missed = n, "admin events were dropped"),
            Err(RecvError::Closed) => return,
        }
    }
}

/// SIGTERM/SIGINT cancel `stop` (after telling systemd); a second one while draining
/// cancels `force` (exit now). SIGHUP asks for a reload, unless shutdown has begun.
fn spawn_signal_handlers(
    lifecycle: Lifecycle,
    reload: tokio::sync::mpsc::UnboundedSender<()>,
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
                sd_notify("STOPPING", notify::stopping());
                lifecycle.stop.cancel();
            }
        }
    }))
}

/// SIGHUP: re-read the file (with the environment's overrides) and apply it to the
/// running engine. An invalid file, or one that adds/removes scopes or sources, is
/// refused whole and the running configuration stays; `[sidecar]` changes (socket,
/// backend, access lists, …) are reported as needing a restart. Once shutdown has
/// begun nothing is reloaded, and systemd is told nothing.
fn apply_reload(
    engine: &Engine<AnyBackend>,
    path: Option<&Path>,
    running: &config::SidecarConfig,
    lifecycle: &Lifecycle,
) {
    {
        let _order = lifecycle.notify_lock();
        if lifecycle.stop.is_cancelled() {
            info!("SIGHUP: shutting down; not reloading");
            return;
        }
        sd_notify("RELOADING", notify::reloading());
    }
    match path {
        None => info!("SIGHUP: running on the embedded example configuration; nothing to reload"),
        Some(_) => match read_config(path) {
            Err(e) => error!(
                "SIGHUP: the configuration file is invalid, keeping the running configuration: {e}"
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
        sd_notify("READY", notify::ready());
    }
}

/// The configuration from `path` (or the embedded example) with the environment's
/// `{SCOPE}__{KEY}` overrides applied.
fn read_config(path: Option<&Path>) -> Result<Config, config::ConfigError> {
    match path {
        Some(p) => config::load_file(p, std::env::vars()),
        None => config::parse_str(config::EXAMPLE_CONFIG, std::env::vars()),
    }
}

/// Log a failed sd_notify message; systemd integration never stops the daemon.
fn sd_notify(what: &str, r: io::Result<()>) {
    if let Err(e) = r {
        warn!(error = %e, "sd_notify {what} failed");
    }
}

/// The listening socket: the one systemd passed (socket activation), else our own.
fn listen(c: &Config) -> Result<Bound, String> {
    let activated = notify::listen_fds().map_err(|e| format!("socket activation: {e}"))?;
    if let Some(std_listener) = activated {
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
    let fail = |what: &str, e: io::Error| format!("{what} {}: {e}", path.display());
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create socket directory {}: {e}", dir.display()))?;
    }
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
    info!(socket = %path.display(), mode = format_args!("{:o}", c.sidecar.socket_mode), "listening");
    Ok(Bound {
        listener,
        created: Some(path),
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
