//! The operations of `gate.lua`, one struct each: which named [`Argv`] slots it
//! fills and what its reply means (§6, §7, §9). The backend builds one of these per
//! call and hands it to [`script::invocation`](super::script::invocation).

use std::time::Duration;

use ::redis::Value;

use super::reach::Seen;
use super::script::{
    admitted_rate_at, applied, bool_at, dur_at, factor_at, int_at, level_at, level_or_none, proto,
    seen_applied, state_at, u64_at, Announce, Argv, Op, TenantSlots,
};
use crate::backend::event::AdminOp;
use crate::backend::{
    Admit, Applied, BResult, BreakerParams, ClassTag, Entry, Held, LastSeen, Observation, Outcome,
    Peek, QuotaParams, Reserve, Settlement, SourceSnapshot, State, Tokens,
};
use crate::gate::quota::{AdmittedRate, Credits, MAX_QUOTA_BLOCK};
use crate::gate::{TenantAdmit, TenantSettle};

/// Gate 4 alone: may a caller enter?
pub(super) struct TryEnterArgs<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
}

impl Op for TryEnterArgs<'_> {
    const NAME: &'static str = "try_enter";
    type Reply = Entry;
    fn argv(&self) -> Argv<'_> {
        Argv {
            breaker: Some(self.p),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Entry> {
        Ok(Entry {
            granted: bool_at(v, 0)?,
            is_probe: bool_at(v, 1)?,
            epoch: u64_at(v, 2)?,
            state: state_at(v, 3)?,
            retry_after: dur_at(v, 4)?,
        })
    }
    fn seen(&self, e: &Entry) -> Seen {
        let breaker = match (e.granted, e.is_probe) {
            (true, false) => (State::Closed, Duration::ZERO),
            (true, true) => (State::HalfOpen, Duration::ZERO),
            (false, _) => (e.state, e.retry_after),
        };
        Seen {
            breaker: Some(breaker),
            quota: None,
        }
    }
}

/// A success under `epoch`.
pub(super) struct RecordSuccessArgs<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
    /// The permit's epoch.
    pub epoch: u64,
    /// `false` keeps the success out of the window.
    pub count_attempt: bool,
}

impl Op for RecordSuccessArgs<'_> {
    const NAME: &'static str = "record_success";
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            breaker: Some(self.p),
            epoch: self.epoch,
            count_attempt: self.count_attempt,
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        seen_applied(a)
    }
}

/// A failure under `epoch`.
pub(super) struct RecordFailureArgs<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
    /// The permit's epoch.
    pub epoch: u64,
}

impl Op for RecordFailureArgs<'_> {
    const NAME: &'static str = "record_failure";
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            breaker: Some(self.p),
            epoch: self.epoch,
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        seen_applied(a)
    }
}

/// Release the probe lease held under `epoch`.
pub(super) struct ReleaseProbeArgs {
    /// The probe's epoch.
    pub epoch: u64,
}

impl Op for ReleaseProbeArgs {
    const NAME: &'static str = "release_probe";
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            epoch: self.epoch,
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        seen_applied(a)
    }
}

/// An outcome that is no verdict (429, cancel) on the breaker alone.
pub(super) struct NeutralArgs {
    /// The permit's epoch.
    pub epoch: u64,
    /// The permit is the probe: its lease is released.
    pub is_probe: bool,
}

impl Op for NeutralArgs {
    const NAME: &'static str = "neutral";
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            epoch: self.epoch,
            is_probe: self.is_probe,
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        seen_applied(a)
    }
}

/// The source's breaker state, epoch and §6 retry-after, read only.
pub(super) struct PeekArgs;

impl Op for PeekArgs {
    const NAME: &'static str = "peek";
    type Reply = Peek;
    fn argv(&self) -> Argv<'_> {
        Argv::default()
    }
    fn read(v: &[Value]) -> BResult<Peek> {
        Ok(Peek {
            state: state_at(v, 0)?,
            epoch: u64_at(v, 1)?,
            retry_after: dur_at(v, 2)?,
        })
    }
    fn seen(&self, p: &Peek) -> Seen {
        Seen {
            breaker: Some((p.state, p.retry_after)),
            quota: None,
        }
    }
}

/// Admin: OPEN for `open_for`, announced.
pub(super) struct ForceOpenArgs<'a> {
    /// How long the breaker stays open.
    pub open_for: Duration,
    /// Where the change is announced.
    pub announce: Announce<'a>,
}

impl Op for ForceOpenArgs<'_> {
    const NAME: &'static str = AdminOp::ForceOpen.wire();
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            open_for: Some(self.open_for),
            announce: Some(self.announce),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        seen_applied(a)
    }
}

/// Admin: CLOSED now, announced.
pub(super) struct ForceCloseArgs<'a> {
    /// Where the change is announced.
    pub announce: Announce<'a>,
}

impl Op for ForceCloseArgs<'_> {
    const NAME: &'static str = AdminOp::ForceClose.wire();
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            announce: Some(self.announce),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        seen_applied(a)
    }
}

/// Admin: forget breaker and quota state (epoch bumped), announced.
pub(super) struct ResetArgs<'a> {
    /// Where the change is announced.
    pub announce: Announce<'a>,
}

impl Op for ResetArgs<'_> {
    const NAME: &'static str = AdminOp::Reset.wire();
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        Argv {
            announce: Some(self.announce),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        Seen {
            quota: Some(Duration::ZERO),
            ..seen_applied(a)
        }
    }
}

/// Gate 3 alone: reserve `tokens` and one request, or take nothing.
pub(super) struct ReserveArgs<'a> {
    /// The source's buckets.
    pub q: &'a QuotaParams,
    /// Tokens to reserve.
    pub tokens: Tokens,
}

impl Op for ReserveArgs<'_> {
    const NAME: &'static str = "reserve";
    type Reply = Reserve;
    fn argv(&self) -> Argv<'_> {
        Argv {
            quota: Some(self.q),
            tokens: self.tokens,
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Reserve> {
        Ok(if bool_at(v, 0)? {
            Reserve::Reserved
        } else {
            Reserve::Denied {
                retry_after: dur_at(v, 1)?,
            }
        })
    }
    fn seen(&self, r: &Reserve) -> Seen {
        Seen {
            breaker: None,
            quota: Some(match r {
                Reserve::Reserved => Duration::ZERO,
                Reserve::Denied { retry_after } => *retry_after,
            }),
        }
    }
}

/// Settle a reservation of `reserved` tokens.
pub(super) struct SettleArgs<'a> {
    /// The source's buckets.
    pub q: &'a QuotaParams,
    /// Tokens the reservation took.
    pub reserved: Tokens,
    /// How it is settled.
    pub how: Settlement,
}

impl Op for SettleArgs<'_> {
    const NAME: &'static str = "settle";
    type Reply = ();
    fn argv(&self) -> Argv<'_> {
        Argv {
            quota: Some(self.q),
            credit: self.q.credits(self.reserved, self.how),
            max_debt: Some(self.q.max_debt),
            // §18: an observing source counts the reservation out of its in-flight.
            tokens: if self.q.tracks() {
                self.reserved
            } else {
                Tokens::default()
            },
            ..Argv::default()
        }
    }
    fn read(_: &[Value]) -> BResult<()> {
        Ok(())
    }
}

/// A 429 with retry-after: block the quota for `block` (only moves forward).
pub(super) struct BlockArgs {
    /// How long.
    pub block: Duration,
}

impl Op for BlockArgs {
    const NAME: &'static str = "block";
    type Reply = ();
    fn argv(&self) -> Argv<'_> {
        Argv {
            block: Some(self.block),
            ..Argv::default()
        }
    }
    fn read(_: &[Value]) -> BResult<()> {
        Ok(())
    }
    fn seen(&self, _: &()) -> Seen {
        Seen {
            breaker: None,
            quota: Some(self.block.min(MAX_QUOTA_BLOCK)),
        }
    }
}

/// Gates 3 and 4 in one step (the hot path).
pub(super) struct AdmitArgs<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
    /// The source's buckets.
    pub q: &'a QuotaParams,
    /// Tokens to reserve.
    pub tokens: Tokens,
    /// §15: the call's priority class (`None`: the scope has none).
    pub class: Option<&'a ClassTag>,
    /// §19: the call's tenant, its ledger the call's third key (one server only).
    pub tenant: Option<TenantAdmit<'a>>,
}

impl Op for AdmitArgs<'_> {
    const NAME: &'static str = "admit";
    type Reply = Admit;
    fn argv(&self) -> Argv<'_> {
        Argv {
            breaker: Some(self.p),
            quota: Some(self.q),
            tokens: self.tokens,
            class: self.class.map(|c| &*c.share().name),
            shares: self.class.map(|c| &*c.shares),
            tenant: self.tenant.map(|t| TenantSlots {
                params: t.params,
                cost: t.charge.cost,
                credit: Credits::default(),
                cost_credit: 0,
                day: None,
            }),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Admit> {
        match int_at(v, 0)? {
            0 => Ok(Admit::Admitted {
                epoch: u64_at(v, 1)?,
                is_probe: bool_at(v, 2)?,
                // -1 (no tenant) or a day number.
                tenant_day: if v.len() > 5 {
                    u32::try_from(int_at(v, 5)?).unwrap_or(0)
                } else {
                    0
                },
                // §18 learn_rate: the factor in force and the last cut's date
                // (elements 7, 8; whole when the source does not learn), carried
                // back by the report.
                rate: admitted_rate_at(v),
            }),
            1 => Ok(Admit::RateLimited {
                retry_after: dur_at(v, 4)?,
            }),
            2 => Ok(Admit::CircuitOpen {
                state: state_at(v, 3)?,
                epoch: u64_at(v, 1)?,
                retry_after: dur_at(v, 4)?,
            }),
            3 => Ok(Admit::ClassHeld {
                why: match int_at(v, 1)? {
                    1 => Held::Limit,
                    2 => Held::Reserve,
                    _ => return Err(proto("admit", v)),
                },
                retry_after: dur_at(v, 4)?,
            }),
            4 => Ok(Admit::TenantLimited {
                limit: super::tenant::limit_of(v, 1)?,
                retry_after: dur_at(v, 4)?,
            }),
            _ => Err(proto("admit", v)),
        }
    }
    fn seen(&self, a: &Admit) -> Seen {
        match *a {
            Admit::Admitted { is_probe, .. } => Seen {
                breaker: Some(if is_probe {
                    (State::HalfOpen, Duration::ZERO)
                } else {
                    (State::Closed, Duration::ZERO)
                }),
                quota: Some(Duration::ZERO),
            },
            // The quota refused first: the breaker was not asked.
            Admit::RateLimited { retry_after } => Seen {
                breaker: None,
                quota: Some(retry_after),
            },
            Admit::CircuitOpen {
                state, retry_after, ..
            } => Seen {
                breaker: Some((state, retry_after)),
                quota: None,
            },
            Admit::ClassHeld { .. } | Admit::TenantLimited { .. } | Admit::TenantsFull => {
                Seen::default()
            }
        }
    }
    fn factor(&self, v: &[Value]) -> Option<u32> {
        factor_at(v)
    }
}

/// Settle the permit's reservation and feed the outcome to the breaker, in one step
/// (the hot path).
pub(super) struct ReportArgs<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
    /// The source's buckets.
    pub q: &'a QuotaParams,
    /// The permit's epoch.
    pub epoch: u64,
    /// The permit is the probe.
    pub is_probe: bool,
    /// Tokens the permit's reservation took.
    pub reserved: Tokens,
    /// What happened.
    pub outcome: Outcome,
    /// §15: the permit's priority class (`None`: the scope has none).
    pub class: Option<&'a str>,
    /// §18: the response's observed limits.
    pub observed: Option<&'a Observation>,
    /// §19: the permit's tenant reservation, its ledger the call's third key (one
    /// server only).
    pub tenant: Option<TenantSettle<'a>>,
    /// §18 `learn_rate`: what the permit's admission saw (slots 55, 56).
    pub admitted: Option<AdmittedRate>,
}

impl Op for ReportArgs<'_> {
    const NAME: &'static str = "report";
    type Reply = Applied;
    fn argv(&self) -> Argv<'_> {
        let (verdict, count_attempt, block) = match self.outcome {
            Outcome::Success { count_attempt, .. } => ("S", count_attempt, None),
            Outcome::Failure { .. } => ("F", false, None),
            Outcome::RateLimited { retry_after } => ("N", false, retry_after),
            Outcome::Cancelled => ("N", false, None),
        };
        Argv {
            breaker: Some(self.p),
            quota: Some(self.q),
            epoch: self.epoch,
            count_attempt,
            is_probe: self.is_probe,
            verdict,
            credit: self
                .q
                .credits(self.reserved, self.outcome.settlement(self.reserved)),
            block,
            class: self.class,
            max_debt: Some(self.q.max_debt),
            // §18: an observing source counts the reservation out of its in-flight.
            tokens: if self.q.tracks() {
                self.reserved
            } else {
                Tokens::default()
            },
            observed: self.observed.filter(|_| self.q.tracks()),
            tenant: self.tenant.map(|t| super::tenant::settle_slots(&t)),
            rate_limited: self.q.learn != 0 && matches!(self.outcome, Outcome::RateLimited { .. }),
            admitted: self.admitted,
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Applied> {
        applied(v)
    }
    fn seen(&self, a: &Applied) -> Seen {
        let quota = match self.outcome {
            Outcome::RateLimited {
                retry_after: Some(d),
            } => Some(d.min(MAX_QUOTA_BLOCK)),
            _ => None,
        };
        Seen {
            quota,
            ..seen_applied(a)
        }
    }
    fn factor(&self, v: &[Value]) -> Option<u32> {
        factor_at(v)
    }
}

/// Everything about the source, for status (reads persist nothing).
pub(super) struct SnapshotArgs<'a> {
    /// The scope's breaker parameters.
    pub p: &'a BreakerParams,
    /// The source's buckets.
    pub q: &'a QuotaParams,
}

impl Op for SnapshotArgs<'_> {
    const NAME: &'static str = "snapshot";
    type Reply = SourceSnapshot;
    fn argv(&self) -> Argv<'_> {
        Argv {
            breaker: Some(self.p),
            quota: Some(self.q),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<SourceSnapshot> {
        Ok(SourceSnapshot {
            state: state_at(v, 0)?,
            epoch: u64_at(v, 1)?,
            retry_after: dur_at(v, 2)?,
            cooldown_level: u32::try_from(u64_at(v, 3)?).unwrap_or(u32::MAX),
            window_successes: u64_at(v, 4)?,
            window_failures: u64_at(v, 5)?,
            streak: u32::try_from(u64_at(v, 6)?).unwrap_or(u32::MAX),
            tokens_available: level_at(v, 7)?,
            requests_available: level_at(v, 8)?,
            levels: [
                level_at(v, 7)?,
                level_at(v, 8)?,
                level_or_none(v, 10)?,
                level_or_none(v, 11)?,
                level_or_none(v, 12)?,
                level_or_none(v, 13)?,
            ],
            quota_blocked: dur_at(v, 9)?,
            seen: seen_at(v, 14)?,
        })
    }
    fn seen(&self, s: &SourceSnapshot) -> Seen {
        Seen {
            breaker: Some((s.state, s.retry_after)),
            quota: Some(s.quota_blocked),
        }
    }
}

/// §18: per bucket (tpm, rpm, itpm, otpm), four integers from slot `at` on:
/// remaining, limit, age µs, removed (`-1` remaining: never observed; absent: the
/// source does not observe).
fn seen_at(v: &[Value], at: usize) -> BResult<[Option<LastSeen>; 4]> {
    let mut out = [None; 4];
    if v.len() < at + 16 {
        return Ok(out);
    }
    for (i, slot) in out.iter_mut().enumerate() {
        let k = at + 4 * i;
        let remaining = int_at(v, k)?;
        if remaining < 0 {
            continue;
        }
        let limit = int_at(v, k + 1)?;
        *slot = Some(LastSeen {
            remaining: remaining as u64,
            limit: (limit > 0).then_some(limit as u64),
            age: dur_at(v, k + 2)?,
            removed: u64_at(v, k + 3)?,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::redis::script::SLOTS;
    use crate::backend::FailureKind;

    /// The slot named `name` of `op`'s ARGV ("" when not sent: trailing neutral).
    fn slot<O: Op>(op: &O, name: &str) -> String {
        let i = SLOTS.iter().position(|s| *s == name).expect("a slot name");
        op.argv()
            .strings(O::NAME)
            .get(i)
            .cloned()
            .unwrap_or_default()
    }

    fn p() -> BreakerParams {
        BreakerParams {
            failure_threshold: 5,
            failure_rate: 0.5,
            min_calls: 20,
            window: Duration::from_secs(60),
            cooldown: Duration::from_secs(60),
            max_cooldown: Duration::from_secs(600),
            probe_ttl: Duration::from_secs(120),
        }
    }

    #[test]
    fn numeric_script_arguments_are_integer_strings() {
        let p = BreakerParams {
            failure_threshold: u32::MAX,
            failure_rate: 0.25,
            min_calls: 7,
            window: Duration::MAX,
            cooldown: Duration::from_nanos(1_500),
            max_cooldown: Duration::from_secs(u64::MAX / 1_000),
            probe_ttl: Duration::from_millis(150),
        };
        let q = QuotaParams {
            tpm: Some(u64::MAX),
            ..QuotaParams::default()
        };
        let report = ReportArgs {
            p: &p,
            q: &q,
            epoch: u64::MAX,
            is_probe: true,
            reserved: u64::MAX.into(),
            outcome: Outcome::Success {
                tokens: Some(3),
                split: None,
                count_attempt: true,
            },
            class: None,
            observed: None,
            tenant: None,
            admitted: None,
        };
        let announce = Announce {
            channel: "chan",
            source: "src",
        };
        let open = ForceOpenArgs {
            open_for: Duration::MAX,
            announce,
        };
        let strings = [
            (report.argv().strings(ReportArgs::NAME), true),
            (open.argv().strings(ForceOpenArgs::NAME), false),
        ];
        for (a, with_params) in &strings {
            assert_eq!(a[2], if *with_params { "0.25" } else { "0" });
            for (v, name) in a.iter().zip(SLOTS) {
                if ["op", "failure_rate", "verdict", "channel", "source"].contains(&name) {
                    continue;
                }
                let n: i128 = v
                    .parse()
                    .unwrap_or_else(|_| panic!("{name} = {v:?} is not an integer"));
                // Epochs are compared, not computed with; everything else stays exact
                // in a double.
                if name != "epoch" {
                    assert!(n.abs() <= 1 << 53, "{name} = {v} too large");
                }
            }
        }
        assert_eq!(slot(&report, "op"), "report");
        assert_eq!(
            slot(&report, "window_us"),
            (1u64 << 52).to_string(),
            "capped"
        );
        assert_eq!(slot(&report, "cooldown_us"), "1", "sub-µs part dropped");
        assert_eq!(slot(&report, "tpm"), (1u64 << 53).to_string(), "tpm capped");
        assert_eq!(slot(&report, "rpm"), "-1", "rpm disabled");
        assert_eq!(
            slot(&report, "token_credit"),
            (1u64 << 53).to_string(),
            "reserved minus charged, capped"
        );
        assert_eq!(slot(&report, "request_credit"), "", "0: trailing, not sent");
        assert_eq!(slot(&report, "count_attempt"), "1");
        assert_eq!(slot(&report, "is_probe"), "1");
        assert_eq!(slot(&report, "verdict"), "S");
        assert_eq!(slot(&report, "block_us"), "", "no block: not sent");
        assert_eq!(report.argv().strings(ReportArgs::NAME).len(), 18);
        assert_eq!(slot(&open, "op"), "force_open");
        assert_eq!(slot(&open, "open_us"), (1u64 << 52).to_string(), "capped");
        assert_eq!(slot(&open, "tokens"), "0");
        assert_eq!(slot(&open, "channel"), "chan");
        assert_eq!(slot(&open, "source"), "src");
    }

    #[test]
    fn each_slot_keeps_its_meaning_across_operations() {
        // A probe's 429 report: the probe flag and the block travel in their own
        // slots, not in ones another operation reads differently.
        let p = p();
        let q = QuotaParams::default();
        let report = ReportArgs {
            p: &p,
            q: &q,
            epoch: 7,
            is_probe: true,
            reserved: 10.into(),
            outcome: Outcome::RateLimited {
                retry_after: Some(Duration::from_secs(2)),
            },
            class: None,
            observed: None,
            tenant: None,
            admitted: None,
        };
        assert_eq!(slot(&report, "is_probe"), "1");
        assert_eq!(slot(&report, "count_attempt"), "0");
        assert_eq!(slot(&report, "block_us"), "2000000");
        assert_eq!(
            slot(&report, "token_credit"),
            "10",
            "a 429 refunds the tokens"
        );
        assert_eq!(slot(&report, "verdict"), "N");
        assert_eq!(slot(&report, "k_max"), "4", "60 s × 2^4 ≥ 10 min");
        assert_eq!(slot(&report, "ttl_basis_us"), "2400000000", "4 × 10 min");
        let neutral = NeutralArgs {
            epoch: 7,
            is_probe: true,
        };
        assert_eq!(slot(&neutral, "is_probe"), "1");
        assert_eq!(slot(&neutral, "count_attempt"), "0");
        assert_eq!(
            neutral.argv().strings(NeutralArgs::NAME).len(),
            16,
            "nothing after is_probe is sent"
        );
        let settle = SettleArgs {
            q: &q,
            reserved: 10.into(),
            how: Settlement::charge(13),
        };
        assert_eq!(slot(&settle, "token_credit"), "-3", "an extra debit");
        assert_eq!(slot(&settle, "verdict"), "");
        let block = BlockArgs {
            block: Duration::from_millis(1),
        };
        assert_eq!(slot(&block, "block_us"), "1000");
        assert_eq!(slot(&block, "open_us"), "");
        let admit = AdmitArgs {
            p: &p,
            q: &q,
            tokens: 12.into(),
            class: None,
            tenant: None,
        };
        assert_eq!(slot(&admit, "tokens"), "12");
        assert_eq!(
            admit.argv().strings(AdmitArgs::NAME).len(),
            13,
            "admit sends 13 slots"
        );
    }

    #[test]
    fn failures_are_charged_or_refunded_by_kind() {
        let p = p();
        let q = QuotaParams::default();
        let report = |kind, tokens| ReportArgs {
            p: &p,
            q: &q,
            epoch: 1,
            is_probe: false,
            reserved: 100.into(),
            outcome: Outcome::Failure {
                kind,
                tokens,
                split: None,
            },
            class: None,
            observed: None,
            tenant: None,
            admitted: None,
        };
        let credit = |r: &ReportArgs| slot(r, "token_credit");
        assert_eq!(credit(&report(FailureKind::Timeout, Some(40))), "100");
        assert_eq!(credit(&report(FailureKind::ServerError, None)), "100");
        assert_eq!(credit(&report(FailureKind::Connection, None)), "100");
        assert_eq!(credit(&report(FailureKind::BadResult, Some(40))), "60");
        assert_eq!(
            credit(&report(FailureKind::Error, None)),
            "",
            "estimate kept: 0, not sent"
        );
        assert_eq!(slot(&report(FailureKind::Error, None), "verdict"), "F");
    }
}
