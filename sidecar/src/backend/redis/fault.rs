//! Sorting a failed Redis call into an outage or a refusal (§10).
//!
//! Only *reachability* failures degrade a source: I/O errors, timeouts, refused or
//! reset connections, redirects the cluster client could not follow, and transient
//! server states (`LOADING`, `BUSY`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`,
//! `READONLY`, `NOREPLICAS`, `OOM`). Any other error reply (a script runtime error,
//! `ERR …`, `WRONGTYPE`, `NOPERM`) means Redis answered and retrying will not help:
//! the caller reports it as [`BackendError::Protocol`](crate::backend::BackendError)
//! with the server's message, in both `on_backend_error` modes, and leaves the
//! source's [reachability](super::reach) alone.

use ::redis::RedisError;

/// How a failed script call is treated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fault {
    /// Redis cannot serve us right now (I/O, timeout, connection refused/reset, a
    /// transient server state): the source degrades (`local`) or refuses
    /// (`fail_closed`), and Redis is retried later.
    Unreachable(String),
    /// Redis answered with an error that retrying will not fix (a script runtime
    /// error, `ERR …`, `WRONGTYPE`, `NOPERM`, …): reported as
    /// [`BackendError::Protocol`](crate::backend::BackendError::Protocol), the
    /// source's reachability is untouched.
    Rejected(String),
}

/// Error codes of transient server states: the server is there but cannot serve now.
const TRANSIENT_CODES: [&str; 8] = [
    "LOADING",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "READONLY",
    "NOREPLICAS",
    "OOM",
];

/// Sort a Redis error into [`Fault::Unreachable`] or [`Fault::Rejected`].
pub(super) fn classify(e: &RedisError) -> Fault {
    use ::redis::ErrorKind as K;
    // A server reply verbatim (`ERR value is not an integer …`), else the client's text.
    let msg = match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => e.to_string(),
    };
    let transient_code = e
        .code()
        .is_some_and(|c| TRANSIENT_CODES.iter().any(|t| c.eq_ignore_ascii_case(t)))
        || nested_transient(&msg);
    match e.kind() {
        K::Server(_) | K::Extension if transient_code => Fault::Unreachable(msg),
        // Redirects the cluster client could not follow: topology in flux.
        K::Server(::redis::ServerErrorKind::Moved | ::redis::ServerErrorKind::Ask) => {
            Fault::Unreachable(msg)
        }
        K::Server(_) | K::Extension | K::Parse | K::UnexpectedReturnType => Fault::Rejected(msg),
        // I/O, connection refused/reset/dropped, no connection to a cluster node,
        // authentication, client-side connection trouble.
        _ => Fault::Unreachable(msg),
    }
}

/// Redis 5/6 wrap an error raised inside a script as `ERR Error running script …:
/// -READONLY You can't write …` (7.x keeps the code): look for a transient code after
/// the `-` so a failover still counts as an outage there too.
fn nested_transient(msg: &str) -> bool {
    msg.contains("Error running script")
        && TRANSIENT_CODES
            .iter()
            .any(|t| msg.contains(&format!("-{t} ")) || msg.contains(&format!("-{t}:")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_codes_wrapped_by_older_redis_script_errors_are_outages() {
        assert!(nested_transient(
            "ERR Error running script (call to f_abc): @user_script:12: -READONLY You can't write against a read only replica."
        ));
        assert!(nested_transient(
            "ERR Error running script (call to f_abc): @user_script:3: -OOM command not allowed"
        ));
        assert!(!nested_transient(
            "ERR Error running script (call to f_abc): @user_script:3: -WRONGTYPE Operation against a key"
        ));
        assert!(!nested_transient(
            "READONLY plain reply handled by its code"
        ));
    }

    /// A server error reply as the client would surface it.
    fn server_error(reply: &str) -> RedisError {
        ::redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .expect("parsable error reply")
            .extract_error()
            .expect_err("an error reply")
    }

    #[test]
    fn script_and_command_errors_are_rejections_not_outages() {
        for reply in [
            "ERR user_script:1: Script attempted to access nonexistent global variable 'x'",
            "ERR value is not an integer or out of range script: abc, on @user_script:256.",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "NOPERM this user has no permissions to run the 'evalsha' command",
            "CROSSSLOT Keys in request don't hash to the same slot",
            "polygate: unknown op bogus",
        ] {
            let e = server_error(reply);
            assert!(
                classify(&e) == Fault::Rejected(reply.to_string()),
                "{reply}: {:?}",
                classify(&e)
            );
        }
        let e = RedisError::from((::redis::ErrorKind::Parse, "bad reply"));
        assert!(matches!(classify(&e), Fault::Rejected(_)));
    }

    #[test]
    fn transport_and_transient_errors_are_outages() {
        for reply in [
            "LOADING Redis is loading the dataset in memory",
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "READONLY You can't write against a read only replica.",
            "NOREPLICAS Not enough good replicas to write.",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            let e = server_error(reply);
            assert!(
                matches!(classify(&e), Fault::Unreachable(_)),
                "{reply}: {:?}",
                classify(&e)
            );
        }
        for kind in [
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let e = RedisError::from(std::io::Error::from(kind));
            assert!(matches!(classify(&e), Fault::Unreachable(_)), "{kind:?}");
        }
        let e = RedisError::from((::redis::ErrorKind::ClusterConnectionNotFound, "no node"));
        assert!(matches!(classify(&e), Fault::Unreachable(_)));
    }
}
