//! The command-line side of `polygate-sidecar` that is not the daemon (§12): loading
//! the configuration for the command line, `--check-config`'s summary, the
//! [`status`] client (with [`tenant`]: `status --tenant`, §19) and the [`health`]
//! probe.

pub mod health;
pub mod status;
pub mod tenant;

use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use crate::config::{self, Config};

/// Exit status for an invalid configuration (also clap's usage-error status).
pub const EXIT_CONFIG: u8 = 2;

/// The configuration from `path` (or the embedded example) with the environment's
/// `{SCOPE}__{KEY}` overrides; on error the message goes to stderr and the exit code
/// is returned.
pub fn load_config(path: Option<&Path>) -> Result<Config, ExitCode> {
    config::load(path, std::env::vars()).map_err(|e| {
        match e {
            // `config file X not found` says it all.
            config::ConfigError::Read { .. } => eprintln!("polygate-sidecar: {e}"),
            e => {
                let origin = path.map_or("embedded example configuration".into(), |p| {
                    p.display().to_string()
                });
                eprintln!("polygate-sidecar: invalid configuration ({origin}): {e}");
            }
        }
        ExitCode::from(EXIT_CONFIG)
    })
}

/// Writes `text` to stdout and flushes it. A reader that went away (`status | head
/// -1`: EPIPE, since Rust ignores SIGPIPE) ends the command quietly with success, as
/// a C tool killed by SIGPIPE would end silently; `print!` would panic instead. Any
/// other write error goes to stderr and exits 1.
pub fn print_out(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("polygate-sidecar: cannot write to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One line: what `--check-config` validated.
pub fn summary(c: &Config, path: Option<&Path>) -> String {
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
    format!(
        "configuration OK ({}): {} scope{}: {}; backend {}; socket {}",
        path.map_or("embedded example".into(), |p| p.display().to_string()),
        c.scopes.len(),
        if c.scopes.len() == 1 { "" } else { "s" },
        scopes.join(", "),
        c.sidecar.backend.as_str(),
        c.sidecar.socket,
    )
}
