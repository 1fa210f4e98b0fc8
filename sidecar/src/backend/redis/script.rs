//! The one Lua script (`gate.lua`) and its operations, each with named arguments
//! (§6, §7, §10).
//!
//! # How it runs
//!
//! Every operation is one call of `gate.lua` (dispatching on its op name). The same
//! text serves two ways ([`Gate`]):
//! - as a **Redis Function** (Redis ≥ 7): the library `polygate_<hash>` registering
//!   the function of the same name, called with `FCALL`. The hash is the script's
//!   SHA-1 prefix, so two sidecar versions sharing a Redis (a rolling upgrade) each
//!   call their own code. On `Function not found` (a restart without persistence, a
//!   `FUNCTION FLUSH`, a new cluster node) the library is loaded (`FUNCTION LOAD
//!   REPLACE`, to every primary of a cluster) and the call retried once. Functions
//!   were measured cheaper than `EVALSHA` of the same text on Redis 7.0 (a script
//!   chunk rebuilds its closures on every call; a library builds them once).
//! - as a **script** (`EVALSHA`, with `SCRIPT LOAD` + retry on `NOSCRIPT`), when the
//!   server does not know `FCALL` (Redis < 7): the connection then stays on scripts.
//!
//! The combined hot-path operations are one call each: `AdmitArgs` = reserve +
//! try_enter (a breaker refusal takes nothing), `ReportArgs` = settle + verdict (+ the
//! 429 block). Every clock reading inside is one `redis.call('TIME')` per call (never
//! a host clock; Redis ≥ 5 replicates effects, so TIME followed by writes is fine).
//!
//! A source has two keys, both passed as keys and hash-tagged into one slot so Redis
//! Cluster routes the call by its first key: `{<prefix>:<source>}:b` (breaker hash)
//! and `{<prefix>:<source>}:q` (quota hash).
//!
//! # Expiry and the epoch
//!
//! `gate.lua`'s header ("Expiry") is the rule: the breaker hash keeps no TTL while it
//! holds state the memory backend would still remember (OPEN, HALF_OPEN, a streak),
//! and once it reads as fresh it expires no sooner than [`ttl_basis`] after its level
//! has decayed and after its last grant — so it comes back as the memory backend's
//! would (k = 0), with epoch 0, which no live permit carries. The quota hash expires
//! once it reads as full and unblocked. Neither expiry is refreshed per call: the
//! script keeps the deadline it set in the hash and moves it only when it must.
//! `reset` bumps the epoch in place (it never deletes the breaker hash).
//!
//! # Arguments
//!
//! Each operation is a struct ([`super::ops`]: `TryEnterArgs`, `AdmitArgs`,
//! `ReportArgs`, …) that fills the named slots of one [`Argv`] and reads its own reply
//! ([`Op`]). Every ARGV slot has one meaning whatever the operation ([`SLOTS`], the
//! header of `gate.lua`); a slot an operation does not use holds a neutral value, and
//! trailing neutral slots are not sent. Numbers cross as integer strings (durations in
//! µs capped at 2^52, counts at 2^53, so the script's double arithmetic is exact)
//! except `failure_rate`, the one fraction; the script writes every number it stores
//! as an integer itself (never Lua's `1e+15`-style conversion, never float text).

use std::sync::LazyLock;
use std::time::Duration;

use ::redis::{Cmd, RedisWrite, Script, ToRedisArgs, Value};

use super::reach::Seen;
use crate::backend::{
    Applied, BResult, BackendError, BreakerParams, ClassShares, Observation, QuotaParams, State,
    Tokens, Trip,
};
use crate::gate::quota::{Credits, DEFAULT_MAX_DEBT, MINUTE};

/// `gate.lua`, ready to run either way.
pub(super) struct Gate {
    /// The script form (EVALSHA, with NOSCRIPT reload), for Redis < 7.
    pub script: Script,
    /// The function's (and its library's) name: `polygate_<SHA-1 prefix>`.
    pub function: String,
    /// `FUNCTION LOAD REPLACE` text of the library registering [`Gate::function`].
    pub library: String,
}

/// The last line of `gate.lua`: the script form's entry point.
const SCRIPT_ENTRY: &str = "return gate(KEYS, ARGV)\n";

impl Gate {
    fn new(text: &str) -> Gate {
        let script = Script::new(text);
        let function = format!("polygate_{}", &script.get_hash()[..16]);
        let body = text
            .strip_suffix(SCRIPT_ENTRY)
            .expect("gate.lua ends with its script entry point");
        let library =
            format!("#!lua name={function}\n{body}redis.register_function('{function}', gate)\n");
        Gate {
            script,
            function,
            library,
        }
    }
}

/// The one script; every operation dispatches on its op name (`ARGV[1]`).
pub(super) static GATE: LazyLock<Gate> = LazyLock::new(|| Gate::new(include_str!("gate.lua")));

/// The breaker key of `source`.
pub(super) fn breaker_key(prefix: &str, source: &str) -> String {
    format!("{{{prefix}:{source}}}:b")
}

/// The quota key of `source`.
pub(super) fn quota_key(prefix: &str, source: &str) -> String {
    format!("{{{prefix}:{source}}}:q")
}

/// A source's two keys (breaker, quota), built once per configured source: a call
/// borrows them instead of formatting them again.
pub(super) fn keys(prefix: &str, source: &str) -> [String; 2] {
    [breaker_key(prefix, source), quota_key(prefix, source)]
}

/// One call of `gate.lua`: its two keys and its arguments.
pub(super) struct Call<'a> {
    /// Breaker key, then quota key (one slot).
    pub keys: &'a [String; 2],
    /// ARGV, `op` first, written into the command as they are (integers as decimal
    /// text, with no string of their own).
    pub args: Vec<Slot<'a>>,
}

impl Call<'_> {
    /// `FCALL polygate_<hash> 2 <keys> <args>`, in one buffer sized up front.
    pub(super) fn fcall(&self) -> Cmd {
        let mut c = Cmd::with_capacity(5 + self.args.len(), 128 + 12 * self.args.len());
        c.arg("FCALL")
            .arg(GATE.function.as_str())
            .arg(2)
            .arg(self.keys[0].as_str())
            .arg(self.keys[1].as_str());
        for a in &self.args {
            c.arg(a);
        }
        c
    }

    /// The same as an `EVALSHA` invocation.
    pub(super) fn script(&self) -> ::redis::ScriptInvocation<'static> {
        let mut inv = GATE.script.prepare_invoke();
        inv.key(self.keys[0].as_str()).key(self.keys[1].as_str());
        for a in &self.args {
            inv.arg(a);
        }
        inv
    }
}

/// One call of `op` on a source whose keys are `keys`, ready to send.
pub(super) fn invocation<'a, O: Op>(keys: &'a [String; 2], op: &'a O) -> Call<'a> {
    Call {
        keys,
        args: op.argv().slots(O::NAME),
    }
}

/// One ARGV slot's value as it goes on the wire. Numbers are written as decimal text
/// straight into the command buffer (no `String` per slot).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Slot<'a> {
    /// A signed integer (µs, counts, credits, `-1` = none).
    Int(i64),
    /// An epoch (compared, never computed with: the whole `u64` range).
    Epoch(u64),
    /// `failure_rate`, the one fraction (Rust's shortest round-trip text).
    Rate(f64),
    /// Text borrowed from the operation (op name, verdict, channel, source, class).
    Text(&'a str),
    /// Text built for the call (§15: the class list).
    Owned(String),
}

impl ToRedisArgs for Slot<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        match self {
            Slot::Int(n) => n.write_redis_args(out),
            Slot::Epoch(n) => n.write_redis_args(out),
            Slot::Rate(f) => out.write_arg_fmt(f),
            Slot::Text(t) => out.write_arg(t.as_bytes()),
            Slot::Owned(t) => out.write_arg(t.as_bytes()),
        }
    }
}

impl std::fmt::Display for Slot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Slot::Int(n) => n.fmt(f),
            Slot::Epoch(n) => n.fmt(f),
            Slot::Rate(r) => r.fmt(f),
            Slot::Text(t) => t.fmt(f),
            Slot::Owned(t) => t.fmt(f),
        }
    }
}

impl Slot<'_> {
    /// Whether this is slot `i`'s neutral value (the text the script reads as it).
    fn is_neutral(&self, i: usize) -> bool {
        let n = NEUTRAL[i];
        match self {
            Slot::Int(v) => n.parse::<i64>() == Ok(*v),
            Slot::Epoch(v) => n.parse::<u64>() == Ok(*v),
            Slot::Rate(r) => *r == 0.0 && n == "0",
            Slot::Text(t) => *t == n,
            Slot::Owned(t) => t == n,
        }
    }
}

// ------------------------------------------------------------------ the ARGV slots

/// The names of `gate.lua`'s ARGV slots, `ARGV[1]` first; its header documents each
/// under the same name.
pub(super) const SLOTS: [&str; 51] = [
    "op",
    "failure_threshold",
    "failure_rate",
    "min_calls",
    "window_us",
    "cooldown_us",
    "max_cooldown_us",
    "probe_ttl_us",
    "k_max",
    "ttl_basis_us",
    "tpm",
    "rpm",
    "tokens",
    "epoch",
    "count_attempt",
    "is_probe",
    "verdict",
    "token_credit",
    "request_credit",
    "block_us",
    "open_us",
    "channel",
    "source",
    "class",
    "saturation_ppm",
    "classes",
    "burst_us",
    "itpm",
    "otpm",
    "tpd",
    "rpd",
    "in_tokens",
    "out_tokens",
    "in_credit",
    "out_credit",
    "max_debt_us",
    "observe",
    "auto",
    "obs_age_us",
    "tt_limit",
    "tt_remaining",
    "tt_reset_us",
    "rt_limit",
    "rt_remaining",
    "rt_reset_us",
    "it_limit",
    "it_remaining",
    "it_reset_us",
    "ot_limit",
    "ot_remaining",
    "ot_reset_us",
];

/// The value each slot holds when an operation does not use it, in [`SLOTS`] order
/// (`op` has none). Trailing neutral slots are not sent; the script reads a missing
/// slot as its neutral value.
const NEUTRAL: [&str; SLOTS.len()] = [
    "",
    "0",
    "0",
    "0",
    "0",
    "0",
    "0",
    "0",
    "0",
    "0",
    "-1",
    "-1",
    "0",
    "0",
    "0",
    "0",
    "",
    "0",
    "0",
    "-1",
    "-1",
    "",
    "",
    "",
    "0",
    "",
    "0",
    "-1",
    "-1",
    "-1",
    "-1",
    "0",
    "0",
    "0",
    "0",
    "600000000",
    "0",
    "0",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
    "-1",
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

/// How long an idle breaker hash must outlive its last grant and its level's decay
/// (`gate.lua` header, "Expiry"): 4 × max(window, max_cooldown, probe_ttl), so no
/// permit (whose lease is at most probe_ttl) and no window count can outlive it.
pub(super) fn ttl_basis(p: &BreakerParams) -> Duration {
    let longest = p.window.max(p.max_cooldown).max(p.probe_ttl);
    longest.checked_mul(4).unwrap_or(Duration::MAX)
}

/// Every ARGV slot but `op`, by name. The default is the neutral value of each.
#[derive(Default)]
pub(super) struct Argv<'a> {
    /// Slots 2–10: the scope's breaker parameters (all 0 when absent).
    pub breaker: Option<&'a BreakerParams>,
    /// Slots 11–12 and 27–31: the source's buckets (`-1` = bucket disabled, also
    /// when absent) and its burst (`0` = a minute's worth, §7a).
    pub quota: Option<&'a QuotaParams>,
    /// Slots 13, 32–33: the reservation to take (reserve, admit): its total, input
    /// and output tokens.
    pub tokens: Tokens,
    /// Slot 14: the epoch the reporting permit was granted under.
    pub epoch: u64,
    /// Slot 15: a success counts in the breaker window.
    pub count_attempt: bool,
    /// Slot 16: the reporting permit is the half-open probe.
    pub is_probe: bool,
    /// Slot 17: the report's verdict (`S` success, `F` failure, `N` none: a 429 or a
    /// cancellation).
    pub verdict: &'static str,
    /// Slots 18–19, 34–35: what a settlement gives back to the buckets (tokens,
    /// may be negative: an extra debit; requests, 0 or 1; input and output tokens),
    /// from [`QuotaParams::credits`].
    pub credit: Credits,
    /// Slot 20: block the quota this long (`-1` = no block).
    pub block: Option<Duration>,
    /// Slot 36 (§12): a settlement's extra debit takes at most this much refill
    /// time from any bucket (`None`: the default, [`DEFAULT_MAX_DEBT`], not sent).
    pub max_debt: Option<Duration>,
    /// Slot 21: force the breaker open this long.
    pub open_for: Option<Duration>,
    /// Slots 22–23: where an admin script announces itself (empty otherwise).
    pub announce: Option<Announce<'a>>,
    /// Slot 24 (§15): the call's priority class (admit, report).
    pub class: Option<&'a str>,
    /// Slots 25–26 (§15): the scope's classes (admit only).
    pub shares: Option<&'a ClassShares>,
    /// Slots 39–51 (§18, report): the response's observed limits.
    pub observed: Option<&'a Observation>,
}

/// Slot 26: every class as `name reserve_ppm limit_ppm`, space-separated.
fn class_spec(c: &ClassShares) -> String {
    let mut s = String::new();
    for (i, x) in c.classes.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&format!("{} {} {}", x.name, x.reserve_ppm, x.limit_ppm));
    }
    s
}

/// A credit as the script takes it: within ±2^53 (exact in a double).
fn credit(n: i128) -> i64 {
    n.clamp(-(MAX_ARG_COUNT as i128), MAX_ARG_COUNT as i128) as i64
}

/// The burst slot: 0 for the default (a minute's worth: §7 exactly), else whole µs.
fn burst_us(q: &QuotaParams) -> u64 {
    if q.burst >= MINUTE {
        0
    } else {
        micros(q.burst).max(1)
    }
}

impl<'a> Argv<'a> {
    /// The slots as text (what [`Argv::slots`] writes), for tests and messages.
    #[cfg(test)]
    pub(super) fn strings(&self, op: &'static str) -> Vec<String> {
        self.slots(op).iter().map(ToString::to_string).collect()
    }

    /// The slots as `gate.lua` reads them, `op` first, in [`SLOTS`] order, without
    /// the trailing ones that hold their neutral value.
    pub(super) fn slots(&self, op: &'static str) -> Vec<Slot<'a>> {
        let (fth, frate, minc, win, cd, mcd, pttl, kmax, basis) = match self.breaker {
            Some(p) => (
                p.failure_threshold,
                p.failure_rate,
                p.min_calls,
                micros(p.window),
                micros(p.cooldown),
                micros(p.max_cooldown),
                micros(p.probe_ttl),
                p.k_max(),
                micros(ttl_basis(p)),
            ),
            None => (0, 0.0, 0, 0, 0, 0, 0, 0, 0),
        };
        let (tpm, rpm) = self
            .quota
            .map_or((-1, -1), |q| (bucket(q.tpm), bucket(q.rpm)));
        // The split travels only to a source with a bucket that counts it, so a
        // source without §7a keys sends exactly the slots it did before.
        let (has_in, has_out) = self.quota.map_or((false, false), |q| {
            (
                q.itpm.is_some() || q.is_auto(2),
                q.otpm.is_some() || q.is_auto(3),
            )
        });
        let part = |on: bool, n: u64| if on { count(n) } else { 0 };
        let part_credit = |on: bool, n: i128| if on { credit(n) } else { 0 };
        let (burst, itpm, otpm, tpd, rpd) = self.quota.map_or((0, -1, -1, -1, -1), |q| {
            (
                burst_us(q),
                bucket(q.itpm),
                bucket(q.otpm),
                bucket(q.tpd),
                bucket(q.rpd),
            )
        });
        // A NaN or infinite rate would not parse as a Lua number; configs never hold one.
        let frate = if frate.is_finite() { frate } else { 1.0 };
        let (channel, source) = self.announce.map_or(("", ""), |a| (a.channel, a.source));
        let mut v = Vec::with_capacity(SLOTS.len());
        let int = |n: u64| Slot::Int(n as i64);
        v.extend([
            Slot::Text(op),
            int(u64::from(fth)),
            Slot::Rate(frate),
            int(u64::from(minc)),
            int(win),
            int(cd),
            int(mcd),
            int(pttl),
            int(u64::from(kmax)),
            int(basis),
            Slot::Int(tpm),
            Slot::Int(rpm),
            int(count(self.tokens.total)),
            Slot::Epoch(self.epoch),
            Slot::Int(i64::from(self.count_attempt)),
            Slot::Int(i64::from(self.is_probe)),
            Slot::Text(self.verdict),
            Slot::Int(credit(self.credit.total)),
            Slot::Int(i64::from(self.credit.requests)),
            Slot::Int(micros_or_none(self.block)),
            Slot::Int(micros_or_none(self.open_for)),
            Slot::Text(channel),
            Slot::Text(source),
            Slot::Text(self.class.unwrap_or("")),
            Slot::Int(
                self.shares
                    .map_or(0, |c| i64::try_from(c.saturation_ppm).unwrap_or(i64::MAX)),
            ),
            match self.shares {
                Some(c) => Slot::Owned(class_spec(c)),
                None => Slot::Text(""),
            },
            int(burst),
            Slot::Int(itpm),
            Slot::Int(otpm),
            Slot::Int(tpd),
            Slot::Int(rpd),
            int(part(has_in, self.tokens.input)),
            int(part(has_out, self.tokens.output)),
            Slot::Int(part_credit(has_in, self.credit.input)),
            Slot::Int(part_credit(has_out, self.credit.output)),
            int(micros(self.max_debt.unwrap_or(DEFAULT_MAX_DEBT))),
            // §18: slot 37 is the one flag a source that does not observe never
            // sends (a neutral trailing slot).
            Slot::Int(self.quota.map_or(0, |q| i64::from(q.tracks()))),
            Slot::Int(self.quota.map_or(0, |q| i64::from(q.auto))),
        ]);
        match self.observed {
            Some(o) => {
                v.push(Slot::Int(micros(o.age) as i64));
                for d in &o.dims {
                    let d = d.unwrap_or_default();
                    v.extend([
                        Slot::Int(bucket(d.limit)),
                        Slot::Int(bucket(d.remaining)),
                        Slot::Int(micros_or_none(d.reset)),
                    ]);
                }
            }
            None => v.extend((0..13).map(|_| Slot::Int(-1))),
        }
        while v.len() > 1 && v.last().is_some_and(|s| s.is_neutral(v.len() - 1)) {
            v.pop();
        }
        v
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
    /// What the reply says of the source's shared state (§10: remembered for the
    /// local fallback). Nothing by default.
    fn seen(&self, _reply: &Self::Reply) -> Seen {
        Seen::default()
    }
}

/// What an [`Applied`] says of the breaker.
pub(super) fn seen_applied(a: &Applied) -> Seen {
    Seen {
        breaker: Some((a.state, a.retry_after)),
        quota: None,
    }
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

/// A level the script may not send (an older reply shape has fewer): `None`.
pub(super) fn level_or_none(v: &[Value], i: usize) -> BResult<Option<f64>> {
    if v.len() <= i {
        return Ok(None);
    }
    level_at(v, i)
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
/// retry_after_us, level, trip}` (trip: 0 none, 1 streak, 2 failure rate).
pub(super) fn applied(v: &[Value]) -> BResult<Applied> {
    Ok(Applied {
        applied: bool_at(v, 0)?,
        state: state_at(v, 1)?,
        epoch: u64_at(v, 2)?,
        retry_after: dur_at(v, 3)?,
        level: u64_at(v, 4)?.min(u32::MAX as u64) as u32,
        trip: match int_at(v, 5)? {
            0 => None,
            1 => Some(Trip::Streak),
            2 => Some(Trip::FailureRate),
            _ => return Err(proto("trip", v)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_max_debt_slot_is_neutral_at_its_default() {
        assert_eq!(
            NEUTRAL[SLOTS.iter().position(|s| *s == "max_debt_us").unwrap()],
            DEFAULT_MAX_DEBT.as_micros().to_string()
        );
        assert!(include_str!("gate.lua").contains("arg(36, 600000000)"));
    }

    #[test]
    fn gate_lua_caps_a_block_like_the_memory_backend() {
        let us = crate::gate::quota::MAX_QUOTA_BLOCK.as_micros();
        assert_eq!(us, 7 * 24 * 3600 * 1_000_000);
        assert!(include_str!("gate.lua").contains("local QMAX_BLOCK = 7 * 24 * 3600 * 1000000"));
    }

    #[test]
    fn the_function_library_is_the_script_registered_under_a_versioned_name() {
        let g = &*GATE;
        assert!(g.function.starts_with("polygate_") && g.function.len() == 25);
        assert!(g
            .library
            .starts_with(&format!("#!lua name={}\n", g.function)));
        assert!(g.library.ends_with(&format!(
            "redis.register_function('{}', gate)\n",
            g.function
        )));
        assert!(!g.library.contains(SCRIPT_ENTRY));
    }

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
