//! The one Lua script (`gate.lua`) and its operations, each with named arguments
//! (§6, §7, §10).
//!
//! # Scripts and keys
//!
//! Every operation is one call of `gate.lua` (dispatching on its op name) through
//! [`::redis::Script`], i.e. `EVALSHA` with an automatic `SCRIPT LOAD` + retry on
//! `NOSCRIPT` (after a Redis restart or `SCRIPT FLUSH`). The combined hot-path
//! operations are one script call each: `AdmitArgs` = reserve + try_enter (a breaker
//! refusal takes nothing), `ReportArgs` = settle + verdict (+ the 429 block). Every
//! clock reading inside the script is `redis.call('TIME')` (never a host clock; Redis
//! ≥ 5 replicates effects, so TIME followed by writes is fine).
//!
//! A source has two keys, both passed with `.key()` and hash-tagged into one slot so
//! Redis Cluster routes the script by its first key: `{<prefix>:<source>}:b` (breaker
//! hash) and `{<prefix>:<source>}:q` (quota hash).
//!
//! # Expiry and the epoch
//!
//! Idle sources vanish. The quota hash expires once it would read as absent anyway
//! (both buckets refilled, the 429 block over, plus a minute); since levels never fall
//! below −capacity and a 429 block is capped at 7 days (the engine already refuses
//! more than a day), that TTL is bounded whatever token count is reported. The breaker
//! hash — which holds the epoch — gets a TTL of `max(4 × max(window, max_cooldown,
//! 60 s), 4 × probe_ttl)` plus any remaining OPEN period or probe lease, **refreshed by
//! every script that touches the source**, reads included (peek, snapshot, a
//! quota-refused admit). That basis is stored in the hash, so operations that carry no
//! breaker params (neutral, release_probe, admin ops) keep it. A permit is granted by
//! such a script and lives at most its lease (probe_ttl; the engine reclaims it after
//! that), so the epoch cannot expire, and hence cannot rewind, while a permit that
//! carries it may still report. `reset` bumps the epoch in place (it never deletes the
//! breaker hash).
//!
//! # Arguments
//!
//! Each operation is a struct ([`super::ops`]: `TryEnterArgs`, `AdmitArgs`,
//! `ReportArgs`, …) that fills the named slots of one [`Argv`] and reads its own reply
//! ([`Op`]). Every ARGV
//! slot has one meaning whatever the operation ([`SLOTS`], the header of `gate.lua`);
//! a slot an operation does not use holds a neutral value. Numbers cross as integer
//! strings (durations in µs capped at 2^52, counts at 2^53, so the script's double
//! arithmetic is exact) except `failure_rate`, the one fraction; the script formats
//! every number it hands to a Redis command itself (never Lua's `1e+15`-style
//! conversion).

use std::sync::LazyLock;
use std::time::Duration;

use ::redis::{Script, ScriptInvocation, Value};

use crate::backend::{Applied, BResult, BackendError, BreakerParams, QuotaParams, State};

/// The one script; every operation dispatches on its op name (`ARGV[1]`).
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("gate.lua")));

/// The breaker key of `source`.
pub(super) fn breaker_key(prefix: &str, source: &str) -> String {
    format!("{{{prefix}:{source}}}:b")
}

/// The quota key of `source`.
pub(super) fn quota_key(prefix: &str, source: &str) -> String {
    format!("{{{prefix}:{source}}}:q")
}

/// One call of `op` on `source`'s keys, ready to send.
pub(super) fn invocation<O: Op>(prefix: &str, source: &str, op: &O) -> ScriptInvocation<'static> {
    let mut inv = SCRIPT.prepare_invoke();
    inv.key(breaker_key(prefix, source))
        .key(quota_key(prefix, source));
    for a in op.argv().strings(O::NAME) {
        inv.arg(a);
    }
    inv
}

// ------------------------------------------------------------------ the ARGV slots

/// The names of `gate.lua`'s ARGV slots, `ARGV[1]` first; its header documents each
/// under the same name.
pub(super) const SLOTS: [&str; 21] = [
    "op",
    "failure_threshold",
    "failure_rate",
    "min_calls",
    "window_us",
    "cooldown_us",
    "max_cooldown_us",
    "probe_ttl_us",
    "tpm",
    "rpm",
    "epoch",
    "count_attempt",
    "is_probe",
    "tokens",
    "settlement",
    "outcome",
    "charged",
    "block_us",
    "open_us",
    "channel",
    "source",
];

/// Largest duration handed to the script, in µs (2^52 µs ≈ 142 years): `TIME` + it
/// stays below 2^53, so every sum the script makes is an exact integer in a double.
const MAX_ARG_MICROS: u64 = 1 << 52;

/// Largest token count / bucket capacity handed to the script (exact in a double).
const MAX_ARG_COUNT: u64 = 1 << 53;

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).map_or(MAX_ARG_MICROS, |m| m.min(MAX_ARG_MICROS))
}

fn count(n: u64) -> u64 {
    n.min(MAX_ARG_COUNT)
}

fn bucket(v: Option<u64>) -> i64 {
    v.map_or(-1, |x| count(x) as i64)
}

fn micros_or_none(d: Option<Duration>) -> i64 {
    d.map_or(-1, |d| micros(d) as i64)
}

/// Every ARGV slot but `op`, by name. The default is the neutral value of each.
#[derive(Default)]
pub(super) struct Argv<'a> {
    /// Slots 2–8: the scope's breaker parameters (all 0 when absent; the script
    /// then keeps the TTL basis stored in the hash).
    pub breaker: Option<&'a BreakerParams>,
    /// Slots 9–10: the source's buckets (`-1` = bucket disabled, also when absent).
    pub quota: Option<&'a QuotaParams>,
    /// Slot 11: the epoch the reporting permit was granted under.
    pub epoch: u64,
    /// Slot 12: a success counts in the breaker window.
    pub count_attempt: bool,
    /// Slot 13: the reporting permit is the half-open probe.
    pub is_probe: bool,
    /// Slot 14: the reservation in tokens: to take (reserve, admit) or taken
    /// (settle, report).
    pub tokens: u64,
    /// Slot 15: how a reservation is settled (`charge` | `refund_tokens` |
    /// `refund_all`).
    pub settlement: &'static str,
    /// Slot 16: the reported outcome (`S` success, `F` failure, `R` 429, `C`
    /// cancelled).
    pub outcome: &'static str,
    /// Slot 17: tokens actually used (`-1` = the reservation).
    pub charged: Option<u64>,
    /// Slot 18: block the quota this long (`-1` = no block).
    pub block: Option<Duration>,
    /// Slot 19: force the breaker open this long.
    pub open_for: Option<Duration>,
    /// Slots 20–21: where an admin script announces itself (empty otherwise).
    pub announce: Option<Announce<'a>>,
}

impl Argv<'_> {
    /// All slots as `gate.lua` reads them, `op` first, in [`SLOTS`] order.
    pub(super) fn strings(&self, op: &str) -> [String; SLOTS.len()] {
        let (fth, frate, minc, win, cd, mcd, pttl) = match self.breaker {
            Some(p) => (
                p.failure_threshold,
                p.failure_rate,
                p.min_calls,
                micros(p.window),
                micros(p.cooldown),
                micros(p.max_cooldown),
                micros(p.probe_ttl),
            ),
            None => (0, 0.0, 0, 0, 0, 0, 0),
        };
        let (tpm, rpm) = self
            .quota
            .map_or((-1, -1), |q| (bucket(q.tpm), bucket(q.rpm)));
        // A NaN or infinite rate would not parse as a Lua number; configs never hold one.
        let frate = if frate.is_finite() { frate } else { 1.0 };
        let (channel, source) = self.announce.map_or(("", ""), |a| (a.channel, a.source));
        [
            op.to_string(),
            fth.to_string(),
            frate.to_string(),
            minc.to_string(),
            win.to_string(),
            cd.to_string(),
            mcd.to_string(),
            pttl.to_string(),
            tpm.to_string(),
            rpm.to_string(),
            self.epoch.to_string(),
            u8::from(self.count_attempt).to_string(),
            u8::from(self.is_probe).to_string(),
            count(self.tokens).to_string(),
            self.settlement.to_string(),
            self.outcome.to_string(),
            self.charged.map_or(-1, |n| count(n) as i64).to_string(),
            micros_or_none(self.block).to_string(),
            micros_or_none(self.open_for).to_string(),
            channel.to_string(),
            source.to_string(),
        ]
    }
}

/// Where an admin script publishes `"<op> <source>"` (§9).
#[derive(Clone, Copy)]
pub(super) struct Announce<'a> {
    /// The admin channel (`<prefix>:admin`).
    pub channel: &'a str,
    /// The source acted on, as every host names it.
    pub source: &'a str,
}

/// One operation of `gate.lua`: its name, its arguments, and what its reply means.
pub(super) trait Op {
    /// The op name the script dispatches on (`ARGV[1]`).
    const NAME: &'static str;
    /// The reply, read.
    type Reply;
    /// The slots this operation fills.
    fn argv(&self) -> Argv<'_>;
    /// Read the script's reply.
    fn read(v: &[Value]) -> BResult<Self::Reply>;
}

// ------------------------------------------------------------------ reply values

pub(super) fn proto(what: &str, v: &[Value]) -> BackendError {
    BackendError::Protocol(format!("unexpected script reply ({what}): {v:?}"))
}

pub(super) fn int_at(v: &[Value], i: usize) -> BResult<i64> {
    match v.get(i) {
        Some(Value::Int(n)) => Ok(*n),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(|f| f as i64)
            .ok_or_else(|| proto("integer", v)),
        _ => Err(proto("integer", v)),
    }
}

pub(super) fn u64_at(v: &[Value], i: usize) -> BResult<u64> {
    Ok(int_at(v, i)?.max(0) as u64)
}

pub(super) fn dur_at(v: &[Value], i: usize) -> BResult<Duration> {
    Ok(Duration::from_micros(u64_at(v, i)?))
}

pub(super) fn bool_at(v: &[Value], i: usize) -> BResult<bool> {
    Ok(int_at(v, i)? != 0)
}

pub(super) fn state_at(v: &[Value], i: usize) -> BResult<State> {
    match int_at(v, i)? {
        0 => Ok(State::Closed),
        1 => Ok(State::Open),
        2 => Ok(State::HalfOpen),
        _ => Err(proto("state", v)),
    }
}

pub(super) fn level_at(v: &[Value], i: usize) -> BResult<Option<f64>> {
    match v.get(i) {
        Some(Value::BulkString(b)) if b.is_empty() => Ok(None),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(Some)
            .ok_or_else(|| proto("level", v)),
        Some(Value::Int(n)) => Ok(Some(*n as f64)),
        _ => Err(proto("level", v)),
    }
}

/// The reply of every outcome and admin operation: `{applied, state, epoch,
/// retry_after_us}`.
pub(super) fn applied(v: &[Value]) -> BResult<Applied> {
    Ok(Applied {
        applied: bool_at(v, 0)?,
        state: state_at(v, 1)?,
        epoch: u64_at(v, 2)?,
        retry_after: dur_at(v, 3)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_lua_documents_every_slot_under_its_name() {
        let lua = include_str!("gate.lua");
        for (i, name) in SLOTS.iter().enumerate() {
            let line = format!("-- ARGV[{}] {name} ", i + 1);
            assert!(lua.contains(&line), "gate.lua header lacks {line:?}");
        }
        assert!(
            !lua.contains(&format!("ARGV[{}]", SLOTS.len() + 1)),
            "gate.lua reads a slot script.rs does not send"
        );
    }
}
