//! `polygate-sidecar`: parse the command line and call into the library — the daemon
//! ([`polygate::daemon`]), `--check-config`, the `status` client and the `health`
//! probe ([`polygate::cli`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::LazyLock;

use clap::{Parser, Subcommand};
use polygate::{cli, daemon};

/// `--version`: the software version and the wire protocol versions it speaks, so
/// an operator can tell which bindings fit without starting it.
static VERSION: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} (protocol versions {}-{})",
        env!("CARGO_PKG_VERSION"),
        ipc_protocol::MIN_PROTOCOL_VERSION,
        ipc_protocol::PROTOCOL_VERSION
    )
});

/// PolyGate per-host admission sidecar.
#[derive(Debug, Parser)]
#[command(name = "polygate-sidecar", version = VERSION.as_str(), about, long_about = None)]
struct Cli {
    /// TOML configuration file; without it the embedded example configuration is
    /// used. `{SCOPE}__{KEY}` environment variables override scope keys.
    #[arg(long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,
    /// Validate the configuration, print a one-line summary and exit.
    #[arg(long)]
    check_config: bool,
    /// Started by a client's autostart (DESIGN §20; the bindings pass it): an unset
    /// `sidecar.idle_exit` means 10 minutes instead of never, and the process holds
    /// the lock file SOCKET.lock for its life (exit status 75 when another process
    /// holds it) and removes it with the socket on exit.
    #[arg(long)]
    autostarted: bool,
    /// With --autostarted: the inherited descriptor of SOCKET.lock, which the
    /// starting client has locked (the lock passes to this process).
    #[arg(long, value_name = "FD", requires = "autostarted")]
    lock_fd: Option<i32>,
    /// A subcommand; none runs the daemon.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the live state of a running sidecar (every scope and source).
    Status {
        /// The sidecar's socket [default: $POLYGATE_SOCKET, else the --config
        /// file's socket, else /run/polygate/sidecar.sock for root and
        /// $XDG_RUNTIME_DIR/polygate/sidecar.sock for anyone else].
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Print the state as one JSON document (bindings/PROTOCOL.md §14.4) instead
        /// of tables, for scripts and dashboards.
        #[arg(long)]
        json: bool,
        /// Print one tenant instead (DESIGN §19): its limits, bucket levels, spend
        /// today and this month (UTC), calls in flight and waiting, per scope with
        /// tenants. `--tenant ""` is the anonymous tenant (calls that name none).
        #[arg(long, value_name = "NAME")]
        tenant: Option<String>,
        /// With --tenant: only this scope.
        #[arg(long, value_name = "SCOPE", requires = "tenant")]
        scope: Option<String>,
    },
    /// Probe the admin listener: GET /ready, exit 0 on 200 and 1 otherwise (a
    /// container HEALTHCHECK without curl).
    Health {
        /// The admin listener [default: the --config file's admin_listen].
        #[arg(long, value_name = "ADDR")]
        admin: Option<std::net::SocketAddr>,
        /// The path to GET (/ready, or /live for liveness only).
        #[arg(long, default_value = "/ready")]
        path: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Status {
            socket,
            json,
            tenant,
            scope,
        }) => match cli::status::socket_path(socket, cli.config.as_deref()) {
            Ok(socket) => match tenant {
                Some(t) => cli::tenant::run(&socket, &t, scope.as_deref(), json),
                None => cli::status::run(&socket, json),
            },
            Err(code) => code,
        },
        Some(Command::Health { admin, path }) => {
            match cli::health::admin_addr(admin, cli.config.as_deref()) {
                Ok(addr) => cli::health::run(addr, &path),
                Err(code) => code,
            }
        }
        None => {
            if cli.autostarted {
                // §20: nothing of the starting client's but the lock stays open here.
                daemon::autostart::close_inherited(cli.lock_fd);
            }
            let config = match cli::load_config(cli.config.as_deref()) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if cli.check_config {
                let line = cli::summary(&config, cli.config.as_deref());
                return cli::print_out(&format!("{line}\n"));
            }
            let autostart = cli.autostarted.then_some(daemon::autostart::Autostart {
                lock_fd: cli.lock_fd,
            });
            daemon::run(config, cli.config, autostart)
        }
    }
}
