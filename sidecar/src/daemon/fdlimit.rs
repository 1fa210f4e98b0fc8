//! The connection cap and the fd limit (§12 "Bounded under abuse": `max_connections`,
//! kept below the fd limit, with room reserved for admin). Past the fd limit new
//! workers would wait in the listen backlog and time out; below it every connection
//! beyond the cap gets a clear refusal instead.
//!
//! At start-up the soft `RLIMIT_NOFILE` is raised to the hard limit (as Go's runtime
//! and most servers do; systemd's default hard limit is 524288), then the cap is
//! either derived from it or checked against it, leaving [`FD_HEADROOM`] descriptors
//! for everything else and [`RESERVED_CONNECTIONS`] for admin and status use.

use tracing::info;

pub use crate::limits::{DEFAULT_MAX_CONNECTIONS, RESERVED_CONNECTIONS};

/// Descriptors kept for everything but worker connections: the listeners, Redis
/// connections, the admin HTTP listener's connections (at most 64), stdio, epoll.
pub const FD_HEADROOM: u64 = 160;

/// The soft limit is raised no higher than this (a huge hard limit is no reason to
/// size anything by it).
const RAISE_UP_TO: u64 = 1 << 20;

/// `max_connections` for a process allowed `nofile` descriptors: `configured`, if
/// the limit holds it with the headroom and the reserve, else an error naming both
/// numbers; unset: as many as fit, at most [`DEFAULT_MAX_CONNECTIONS`].
pub fn connection_cap(configured: Option<u32>, nofile: u64) -> Result<u32, String> {
    let need = |n: u32| u64::from(n) + u64::from(RESERVED_CONNECTIONS) + FD_HEADROOM;
    match configured {
        Some(n) if need(n) <= nofile => Ok(n),
        Some(n) => Err(format!(
            "sidecar.max_connections = {n} needs {} file descriptors ({n} + {RESERVED_CONNECTIONS} \
             reserved for admin/status + {FD_HEADROOM} for everything else), but the fd limit \
             (RLIMIT_NOFILE) is {nofile}: lower max_connections to at most {} or raise the limit \
             (LimitNOFILE= in the systemd unit, ulimit -n)",
            need(n),
            nofile.saturating_sub(need(0)),
        )),
        None => {
            let fit = nofile.saturating_sub(need(0));
            if fit == 0 {
                return Err(format!(
                    "the fd limit (RLIMIT_NOFILE) is {nofile}: too low to serve any connection \
                     (need more than {}); raise it (LimitNOFILE=, ulimit -n)",
                    need(0)
                ));
            }
            Ok(fit.min(u64::from(DEFAULT_MAX_CONNECTIONS)) as u32)
        }
    }
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit (at most 2^20) and return the
/// soft limit now in force.
pub fn raise_nofile() -> Result<u64, String> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)
        .map_err(|e| format!("cannot read RLIMIT_NOFILE: {e}"))?;
    let want = hard.min(RAISE_UP_TO).max(soft);
    if want > soft {
        match setrlimit(Resource::RLIMIT_NOFILE, want, hard) {
            Ok(()) => {
                info!(
                    from = soft,
                    to = want,
                    "raised the fd limit (RLIMIT_NOFILE)"
                );
                return Ok(want);
            }
            Err(e) => info!(soft, hard, error = %e, "cannot raise the fd limit; keeping it"),
        }
    }
    Ok(soft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_fits_below_the_fd_limit() {
        assert_eq!(connection_cap(None, 1 << 20), Ok(DEFAULT_MAX_CONNECTIONS));
        let small = connection_cap(None, 1024).unwrap();
        assert_eq!(
            u64::from(small + RESERVED_CONNECTIONS) + FD_HEADROOM,
            1024,
            "fills the limit"
        );
        assert_eq!(connection_cap(Some(500), 1024), Ok(500));
        let e = connection_cap(Some(5000), 1024).unwrap_err();
        assert!(
            e.contains("max_connections = 5000") && e.contains("1024"),
            "{e}"
        );
        assert!(e.contains(&format!("at most {small}")), "{e}");
        let e = connection_cap(None, 100).unwrap_err();
        assert!(e.contains("100"), "{e}");
    }
}
