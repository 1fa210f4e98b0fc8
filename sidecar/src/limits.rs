//! The bounds every outside input is held to before any arithmetic or echo (§12
//! "Bounded under abuse"): one place for the numeric caps (admin durations, config
//! durations, counts) and for how much of a client's string a reply or a log line may
//! repeat. README "Operating it" lists these with what a client sees at each.

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
}
