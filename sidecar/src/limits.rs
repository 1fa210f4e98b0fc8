//! The bounds every outside input is held to before any arithmetic or echo (§12
//! "Bounded under abuse"): one place for the numeric caps (admin durations, config
//! durations, counts) and for how much of a client's string a reply or a log line may
//! repeat. README "Operating it" lists these with what a client sees at each.
//!
//! The connection cap's numbers live here too ([`RESERVED_CONNECTIONS`],
//! [`DEFAULT_MAX_CONNECTIONS`]): the daemon sizes the cap against the fd limit
//! (`daemon/fdlimit.rs`) and the server enforces it, so they sit below both.

use std::borrow::Cow;
use std::time::Duration;

/// Longest `ForceOpen.seconds`: a year. Longer is a typo or an attack (a value near
/// 2^64 s overflowed the deadline arithmetic), and `force_close` ends any open early.
pub const MAX_FORCE_OPEN: Duration = Duration::from_secs(365 * 86_400);

/// Longest duration any configuration key accepts: a year. Every configured duration
/// is added to clock readings or doubled (leases are 2 × timeout), so it must stay far
/// from `Duration::MAX`.
pub const MAX_CONFIG_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// Largest token count on the wire (`est_tokens`, `Success.tokens`, every v2 estimate
/// and usage count) and in a source's `est_tokens`: far above any real request, low
/// enough that a client bug cannot poison a quota every host shares.
pub const MAX_TOKENS: u64 = 1_000_000_000;

/// Largest `tpm` / `rpm` a source may configure: far beyond any provider, small
/// enough that bucket arithmetic in `f64` (here and in Redis) stays exact.
pub const MAX_RATE: u64 = 1_000_000_000_000;

/// Largest pacer ceiling (`pacer.max`) and step (`pacer.increase`): the in-flight
/// count it is compared with is a `u32`, and a host never runs more concurrent calls.
pub const MAX_PACER: f64 = 1_000_000.0;

/// Longest scope or source name in the configuration: names travel in every grant,
/// status and error reply, and in Redis keys.
pub const MAX_NAME: usize = 200;

/// Bytes of a client-supplied string (scope, source, client name) that an error reply
/// or a log line repeats; the rest is replaced by `…`. Keeps every reply to a request
/// of any size small, and one bad request from being kilobytes of log.
pub const MAX_ECHO: usize = 128;

/// Connections accepted beyond `max_connections`, for peers in `admin_uids` only
/// (bindings/PROTOCOL.md §1, "Connection limit").
pub const RESERVED_CONNECTIONS: u32 = 8;

/// The cap when `max_connections` is unset and the fd limit allows more.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10_000;

/// Memory one waiting request may be assumed to hold (its future, its place in a
/// line, its connection's share): measured ~2.5 KiB per waiting `Start` (issue 21),
/// rounded up.
pub const WAITER_BYTES: u64 = 4096;

/// Share of the host's memory (or the cgroup's limit, whichever is smaller) that the
/// default `sidecar.max_waiters` lets waiters take: one sixteenth.
const WAITERS_MEMORY_SHARE: u64 = 16;

/// Bounds of the derived `sidecar.max_waiters`: never fewer than §16's 10,000
/// waiters, never more than a million.
const DEFAULT_WAITERS_RANGE: (u64, u64) = (10_000, 1_000_000);

/// The default `sidecar.max_waiters`: a sixteenth of the memory this process may
/// use (the smaller of `MemTotal` and a cgroup v2 `memory.max`) at [`WAITER_BYTES`]
/// each, within 10,000 ..= 1,000,000 (10,000 when neither can be read).
pub fn default_max_waiters() -> u32 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let total = meminfo.as_deref().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    waiters_for_memory([total, cgroup].into_iter().flatten().min())
}

/// [`default_max_waiters`] for `bytes` of memory (`None`: unknown).
pub fn waiters_for_memory(bytes: Option<u64>) -> u32 {
    let (lo, hi) = DEFAULT_WAITERS_RANGE;
    let n = bytes.map_or(lo, |b| b / WAITERS_MEMORY_SHARE / WAITER_BYTES);
    n.clamp(lo, hi) as u32
}

/// `s` cut to at most [`MAX_ECHO`] bytes on a character boundary, with `…` appended
/// when something was cut.
pub fn echo(s: &str) -> Cow<'_, str> {
    truncate(s, MAX_ECHO)
}

/// `s` cut to at most `max` bytes on a character boundary, with `…` appended (and
/// `(N bytes)` so the reader knows how long it was) when something was cut.
pub fn truncate(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…({} bytes)", &s[..end], s.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_strings_are_kept_and_long_ones_cut_on_a_char_boundary() {
        assert_eq!(echo("chat"), "chat");
        let long = "ä".repeat(200); // 400 bytes
        let cut = echo(&long);
        assert!(cut.len() < MAX_ECHO + 20, "{}", cut.len());
        assert!(cut.ends_with("…(400 bytes)"), "{cut}");
        assert!(cut.starts_with("ää"));
        assert_eq!(truncate("abcdef", 3), "abc…(6 bytes)");
        assert_eq!(truncate("🚀🚀", 5), "🚀…(8 bytes)");
    }

    #[test]
    fn the_default_waiter_cap_follows_memory_within_its_bounds() {
        assert_eq!(waiters_for_memory(None), 10_000, "unknown memory");
        assert_eq!(waiters_for_memory(Some(512 << 20)), 10_000, "a small host");
        // 16 GiB: a sixteenth (1 GiB) at 4 KiB each.
        assert_eq!(waiters_for_memory(Some(16 << 30)), 262_144);
        assert_eq!(waiters_for_memory(Some(u64::MAX)), 1_000_000);
        let here = default_max_waiters();
        assert!((10_000..=1_000_000).contains(&here), "{here}");
    }
}
