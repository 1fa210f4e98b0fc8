//! The argument layout of `gate.lua`: its named ARGV slots ([`SLOTS`], each slot's
//! neutral value), one slot's wire form ([`Slot`]) and the struct an operation fills
//! by name ([`Argv`]), written out in slot order with the numeric limits the script
//! needs.
//!
//! Its own module because the layout is a contract with `gate.lua`'s header, checked
//! by the tests below; how the script runs is `script/mod.rs`, how its replies are
//! read `script/reply.rs`.
//!
//! # Arguments
//!
//! Each operation is a struct ([`crate::backend::redis::ops`]: `TryEnterArgs`, `AdmitArgs`,
//! `ReportArgs`, …) that fills the named slots of one [`Argv`] and reads its own reply
//! ([`Op`]). Every ARGV slot has one meaning whatever the operation ([`SLOTS`], the
//! header of `gate.lua`); a slot an operation does not use holds a neutral value, and
//! trailing neutral slots are not sent. Numbers cross as integer strings (durations in
//! µs capped at 2^52, counts at 2^53, so the script's double arithmetic is exact)
//! except `failure_rate`, the one fraction; the script writes every number it stores
//! as an integer itself (never Lua's `1e+15`-style conversion, never float text).

use std::time::Duration;

use ::redis::{RedisWrite, ToRedisArgs};

use crate::backend::{BreakerParams, ClassShares, Observation, QuotaParams, Tokens};
use crate::gate::quota::{AdmittedRate, Credits, SeenCut, DEFAULT_MAX_DEBT, MINUTE, PPM_WHOLE};
use crate::gate::tenant::TenantParams;

/// One ARGV slot's value as it goes on the wire. Numbers are written as decimal text
/// straight into the command buffer (no `String` per slot).
#[derive(Debug, Clone, PartialEq)]
pub(in crate::backend::redis) enum Slot<'a> {
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
pub(in crate::backend::redis) const SLOTS: [&str; 56] = [
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
    "host",
    "learn",
    "rate_limited",
    "rate_ppm",
    "cut_at_us",
];

/// §19: the tenant's slots, which a call with its tenant ledger (admit and report with
/// the ledger as a third key, the tenant ops on it alone) sends as its last
/// [`TSLOTS`]`.len()` arguments, after the slots above (trimmed as always), so that no
/// neutral source slot travels only to make room for them; `gate.lua` moves them out
/// of ARGV on entry and its header documents each as `TARGV[k]`.
pub(in crate::backend::redis) const TSLOTS: [&str; 11] = [
    "t_tpm",
    "t_rpm",
    "t_tpd",
    "t_rpd",
    "t_usd_day",
    "t_usd_month",
    "t_cost",
    "t_token_credit",
    "t_request_credit",
    "t_cost_credit",
    "t_day",
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
    "",
    "0",
    "0",
    "1000000",
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
pub(in crate::backend::redis) struct Argv<'a> {
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
    /// [`TSLOTS`] (§19): the call's tenant ledger, sent after the slots by the calls
    /// that carry it ([`Argv::tenant_slots`]).
    pub tenant: Option<TenantSlots<'a>>,
    /// Slot 54 (§18 `learn_rate`, report): the outcome is a 429.
    pub rate_limited: bool,
    /// Slots 55–56 (§18 `learn_rate`, report): what the reservation's admission saw:
    /// the factor it was taken at, ppm (its credits are converted at it), and the
    /// last cut's date then (its 429 cuts only while that cut is the last). `None`:
    /// not known (the whole factor; a 429 cuts as if admitted under the last cut).
    pub admitted: Option<AdmittedRate>,
}

/// [`TSLOTS`] (§19): a tenant's limits and what an op takes from or gives back to its
/// ledger.
#[derive(Clone, Copy)]
pub(in crate::backend::redis) struct TenantSlots<'a> {
    /// `t_tpm` … `t_usd_month`: its limits.
    pub params: &'a TenantParams,
    /// `t_cost`: the reservation's estimated cost, n$ (admit, treserve).
    pub cost: u64,
    /// `t_token_credit`, `t_request_credit`: tokens and requests given back (report,
    /// tsettle); tokens may be negative (an extra debit).
    pub credit: Credits,
    /// `t_cost_credit`: n$ given back to the windows charged (negative: charged more).
    pub cost_credit: i128,
    /// `t_day`: the day number the reservation was charged to (report, tsettle, tcal).
    pub day: Option<u32>,
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
    pub(in crate::backend::redis) fn strings(&self, op: &'static str) -> Vec<String> {
        self.slots(op).iter().map(ToString::to_string).collect()
    }

    /// The slots as `gate.lua` reads them, `op` first, in [`SLOTS`] order, without
    /// the trailing ones that hold their neutral value.
    pub(in crate::backend::redis) fn slots(&self, op: &'static str) -> Vec<Slot<'a>> {
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
        let mut v: Vec<Slot<'a>> = Vec::with_capacity(SLOTS.len());
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
        // Slot 52 (the host) is filled in by `with_host`; slots 53–56 (§18
        // `learn_rate`) are sent only by a source that learns (a report's factor is
        // whole and its cut unknown, the neutrals, on any other). A cut's date is
        // never 0 on Redis's clock: 0 says "admitted with no cut in force".
        let admitted = self
            .admitted
            .filter(|_| self.quota.is_some_and(|q| q.learn != 0));
        let rate_ppm = admitted.map_or(PPM_WHOLE, |a| a.ppm.min(PPM_WHOLE));
        let cut_at = match admitted.map(|a| a.cut) {
            None | Some(SeenCut::Unknown) => -1,
            Some(SeenCut::None) => 0,
            Some(SeenCut::At(c)) => micros(c) as i64,
        };
        v.extend([
            Slot::Text(""),
            Slot::Int(self.quota.map_or(0, |q| i64::from(q.learn))),
            Slot::Int(i64::from(self.rate_limited)),
            Slot::Int(i64::from(rate_ppm)),
            Slot::Int(cut_at),
        ]);
        while v.len() > 1 && v.last().is_some_and(|s| s.is_neutral(v.len() - 1)) {
            v.pop();
        }
        v
    }

    /// The [`TSLOTS`] of [`Argv::tenant`], all of them (neutral when it is `None`):
    /// what a call with its tenant ledger sends after [`Argv::slots`].
    pub(in crate::backend::redis) fn tenant_slots(&self) -> [Slot<'a>; TSLOTS.len()] {
        let Some(t) = self.tenant else {
            return [
                Slot::Int(-1),
                Slot::Int(-1),
                Slot::Int(-1),
                Slot::Int(-1),
                Slot::Int(-1),
                Slot::Int(-1),
                Slot::Int(0),
                Slot::Int(0),
                Slot::Int(0),
                Slot::Int(0),
                Slot::Int(-1),
            ];
        };
        let p = t.params;
        [
            Slot::Int(bucket(p.q.tpm)),
            Slot::Int(bucket(p.q.rpm)),
            Slot::Int(bucket(p.q.tpd)),
            Slot::Int(bucket(p.q.rpd)),
            Slot::Int(bucket(p.usd_per_day)),
            Slot::Int(bucket(p.usd_per_month)),
            Slot::Int(count(t.cost) as i64),
            Slot::Int(credit(t.credit.total)),
            Slot::Int(i64::from(t.credit.requests)),
            Slot::Int(credit(t.cost_credit)),
            Slot::Int(t.day.map_or(-1, i64::from)),
        ]
    }
}

/// §18: with slot 37 set (the source keeps in-flight counts), slot 52 names the
/// host whose call this is, so its counts are kept apart and dropped with its
/// heartbeat (`hosts.rs`). `slots` is what [`Argv::slots`] built; the slots it left
/// out as trailing neutrals are filled in up to slot 52 first.
pub(in crate::backend::redis) fn with_host<'a>(slots: &mut Vec<Slot<'a>>, host: &'a str) {
    let tracks = matches!(slots.get(36), Some(Slot::Int(1)));
    if !tracks || host.is_empty() {
        return;
    }
    while slots.len() < HOST_SLOT + 1 {
        slots.push(Slot::Text(NEUTRAL[slots.len()]));
    }
    slots[HOST_SLOT] = Slot::Text(host);
}

/// Index of slot 52 (`host`) in the slots (`op` at 0).
const HOST_SLOT: usize = 51;

/// Where an admin script publishes `"<op> <source>"` (§9).
#[derive(Clone, Copy)]
pub(in crate::backend::redis) struct Announce<'a> {
    /// The admin channel (`<prefix>:admin`).
    pub channel: &'a str,
    /// The source acted on, as every host names it.
    pub source: &'a str,
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
        assert!(include_str!("../gate.lua").contains("arg(36, 600000000)"));
    }

    #[test]
    fn gate_lua_documents_every_slot_under_its_name() {
        let lua = include_str!("../gate.lua");
        for (i, name) in SLOTS.iter().enumerate() {
            let line = format!("-- ARGV[{}] {name} ", i + 1);
            assert!(lua.contains(&line), "gate.lua header lacks {line:?}");
        }
        assert!(
            !lua.contains(&format!("ARGV[{}]", SLOTS.len() + 1)),
            "gate.lua reads a slot script/argv.rs does not send"
        );
        for (k, name) in TSLOTS.iter().enumerate() {
            let line = format!("-- TARGV[{}] {name} ", k + 1);
            assert!(lua.contains(&line), "gate.lua header lacks {line:?}");
        }
        assert!(
            lua.contains(&format!("local TN = {}", TSLOTS.len())),
            "gate.lua moves as many tenant slots out of ARGV as script/argv.rs sends"
        );
        assert!(!lua.contains(&format!("TARGV[{}]", TSLOTS.len() + 1)));
    }

    #[test]
    fn what_the_admission_saw_travels_only_when_it_is_known() {
        let q = QuotaParams {
            learn: 1_000,
            ..QuotaParams::default()
        };
        let at = |admitted| Argv {
            quota: Some(&q),
            admitted,
            ..Argv::default()
        };
        let rate = SLOTS.iter().position(|s| *s == "rate_ppm").unwrap();
        let cut = SLOTS.iter().position(|s| *s == "cut_at_us").unwrap();
        assert_eq!(cut, rate + 1);
        assert_eq!(NEUTRAL[rate], PPM_WHOLE.to_string());
        assert_eq!(NEUTRAL[cut], "-1");
        assert!(
            at(None).strings("report").len() <= rate,
            "unknown: not sent"
        );
        let never = at(Some(AdmittedRate {
            ppm: 700_000,
            cut: SeenCut::None,
        }))
        .strings("report");
        assert_eq!(never.len(), cut + 1);
        assert_eq!((never[rate].as_str(), never[cut].as_str()), ("700000", "0"));
        let under = at(Some(AdmittedRate {
            ppm: PPM_WHOLE,
            cut: SeenCut::At(Duration::from_secs(5)),
        }))
        .strings("report");
        assert_eq!(
            (under[rate].as_str(), under[cut].as_str()),
            ("1000000", "5000000")
        );
        let foreign = at(Some(AdmittedRate {
            ppm: 700_000,
            cut: SeenCut::Unknown,
        }))
        .strings("report");
        assert_eq!(
            (foreign[rate].as_str(), foreign.get(cut).map(String::as_str)),
            ("700000", None),
            "a cut from another ledger is not sent (the neutral -1)"
        );
        // What the engine sends for every permit of a source that does not learn:
        // the source's report stays as short as before the slots existed.
        let plain = QuotaParams::default();
        let whole = Argv {
            quota: Some(&plain),
            admitted: Some(AdmittedRate::WHOLE),
            ..Argv::default()
        };
        assert!(whole.strings("report").len() <= SLOTS.iter().position(|s| *s == "learn").unwrap());
    }

    #[test]
    fn a_tenant_rides_after_the_trimmed_slots() {
        use crate::gate::tenant::TenantParams;
        let p = TenantParams::default();
        let t = TenantSlots {
            params: &p,
            cost: 7,
            credit: Credits::default(),
            cost_credit: 0,
            day: Some(3),
        };
        let a = Argv {
            tokens: 12.into(),
            tenant: Some(t),
            ..Argv::default()
        };
        // The source's slots are trimmed as without a tenant: the tenant adds its own
        // slots and no neutral source slot.
        let plain = Argv {
            tokens: 12.into(),
            ..Argv::default()
        };
        assert_eq!(a.slots("admit"), plain.slots("admit"));
        let ts: Vec<String> = a.tenant_slots().iter().map(ToString::to_string).collect();
        assert_eq!(ts.len(), TSLOTS.len());
        assert_eq!(ts[6], "7", "t_cost");
        assert_eq!(ts[10], "3", "t_day");
        let none: Vec<String> = plain
            .tenant_slots()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            none,
            ["-1", "-1", "-1", "-1", "-1", "-1", "0", "0", "0", "0", "-1"]
        );
    }
}
