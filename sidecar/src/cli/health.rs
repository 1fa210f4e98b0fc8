//! `polygate-sidecar health` (§12): one `GET /ready` (or `--path`) on the admin
//! listener, exit 0 on `200`, 1 otherwise — the probe of a container image that
//! has no curl (the Dockerfile's HEALTHCHECK). Plain HTTP/1.1 over a std TCP
//! stream: a status line is all it reads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// How long the probe waits for connect, and again for the answer.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// The address to probe: `--admin`, else the `--config` file's `admin_listen` (an
/// unspecified IP such as `0.0.0.0` becomes loopback); a missing one exits 2.
pub fn admin_addr(
    admin: Option<SocketAddr>,
    config: Option<&Path>,
) -> Result<SocketAddr, ExitCode> {
    if let Some(a) = admin {
        return Ok(a);
    }
    let c = super::load_config(config)?;
    match c.sidecar.admin_listen {
        Some(mut a) => {
            if a.ip().is_unspecified() {
                a.set_ip(match a {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            Ok(a)
        }
        None => {
            eprintln!(
                "polygate-sidecar health: no admin listener: pass --admin ADDR or set \
                 [sidecar] admin_listen (SIDECAR__ADMIN_LISTEN)"
            );
            Err(ExitCode::from(super::EXIT_CONFIG))
        }
    }
}

/// `GET path` on `addr`: exit 0 on 200, else 1 with the reason on stderr.
pub fn run(addr: SocketAddr, path: &str) -> ExitCode {
    match get(addr, path) {
        Ok(200) => ExitCode::SUCCESS,
        Ok(code) => {
            eprintln!("polygate-sidecar health: GET http://{addr}{path}: {code}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("polygate-sidecar health: GET http://{addr}{path}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The status code of `GET path`.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, HEALTH_TIMEOUT)?;
    s.set_read_timeout(Some(HEALTH_TIMEOUT))?;
    s.set_write_timeout(Some(HEALTH_TIMEOUT))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    // The status line fits in the first read; read until it is complete.
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 256];
    while !head.contains(&b'\n') && head.len() < 4096 {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .filter(|_| line.starts_with("HTTP/1."))
        .ok_or_else(|| {
            std::io::Error::other(format!("not an HTTP answer: {:?}", line.lines().next()))
        })
}
