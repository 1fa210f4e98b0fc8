//! §19 on Redis: the tenant ops of `gate.lua` (`treserve`, `tsettle`, `tsnapshot`,
//! `tcal`) and the slots a source's admit and report fill for their call's tenant.
//!
//! A tenant's ledger is one hash, `{<prefix>:t:<scope>:<tenant>}`. On one server it
//! is the third key of the source's `admit` and `report`, so the tenant and the
//! source change together in one script call (no extra round trip). A Redis Cluster
//! cannot run one script over two slots: there the ledger is reserved first
//! (`treserve`, on its key alone), the source admitted next, and a source refusal
//! gives the reservation back (`tsettle` with every credit); a report settles the
//! source and the tenant in two calls sent together. Between the two steps the
//! tenant holds a reservation the source may still refuse: the fleet never admits
//! more than the ledger allows, it may briefly refuse a tenant a call that would
//! have fit.

use ::redis::Value;

use super::script::{dur_at, int_at, level_at, proto, u64_at, Argv, Op, TenantSlots};
use crate::backend::{Admit, BResult};
use crate::gate::quota::Settlement;
use crate::gate::tenant::{Charge, LedgerView, TenantLimit, TenantParams};
use crate::gate::{TenantAdmit, TenantSettle};

/// The refusal code at `v[i]` (`gate.lua`: 1 tpm, 2 rpm, 3 tpd, 4 rpd, 5 usd_per_day,
/// 6 usd_per_month).
pub(super) fn limit_of(v: &[Value], i: usize) -> BResult<TenantLimit> {
    Ok(match int_at(v, i)? {
        1 => TenantLimit::Tpm,
        2 => TenantLimit::Rpm,
        3 => TenantLimit::Tpd,
        4 => TenantLimit::Rpd,
        5 => TenantLimit::UsdPerDay,
        6 => TenantLimit::UsdPerMonth,
        _ => return Err(proto("tenant limit", v)),
    })
}

/// The slots of a settlement of `t` (`with_source`: the ledger is a source report's
/// third key).
pub(super) fn settle_slots<'a>(t: &TenantSettle<'a>, with_source: bool) -> TenantSlots<'a> {
    let (credit, cost_credit) = t.credits();
    TenantSlots {
        with_source,
        params: t.params,
        cost: 0,
        credit,
        cost_credit,
        day: Some(t.day),
    }
}

/// The settlement that gives a reservation back whole: a Redis Cluster's source
/// refused after the tenant's step took it.
pub(super) fn refund<'a>(t: &TenantAdmit<'a>, day: u32) -> TenantSettle<'a> {
    TenantSettle {
        key: t.key,
        params: t.params,
        charge: t.charge,
        how: Settlement::RefundAll,
        cost: 0,
        day,
    }
}

/// `treserve`: check the tenant's ledger and take the charge, or take nothing.
pub(super) struct TReserveArgs<'a> {
    /// The tenant's limits.
    pub params: &'a TenantParams,
    /// What the admission charges.
    pub charge: Charge,
}

impl Op for TReserveArgs<'_> {
    const NAME: &'static str = "treserve";
    type Reply = Admit;
    fn argv(&self) -> Argv<'_> {
        Argv {
            tokens: self.charge.tokens,
            tenant: Some(TenantSlots {
                with_source: false,
                params: self.params,
                cost: self.charge.cost,
                credit: Default::default(),
                cost_credit: 0,
                day: None,
            }),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<Admit> {
        match int_at(v, 0)? {
            1 => Ok(Admit::Admitted {
                epoch: 0,
                is_probe: false,
                tenant_day: u32::try_from(int_at(v, 1)?).map_err(|_| proto("treserve", v))?,
            }),
            0 => Ok(Admit::TenantLimited {
                limit: limit_of(v, 1)?,
                retry_after: dur_at(v, 2)?,
            }),
            _ => Err(proto("treserve", v)),
        }
    }
}

/// `tsettle`: settle one reservation of the tenant's ledger.
pub(super) struct TSettleArgs<'a> {
    /// The settlement.
    pub t: TenantSettle<'a>,
}

impl Op for TSettleArgs<'_> {
    const NAME: &'static str = "tsettle";
    type Reply = ();
    fn argv(&self) -> Argv<'_> {
        Argv {
            max_debt: Some(self.t.params.q.max_debt),
            tenant: Some(settle_slots(&self.t, false)),
            ..Argv::default()
        }
    }
    fn read(_: &[Value]) -> BResult<()> {
        Ok(())
    }
}

/// `tsnapshot`: the ledger for status (reads persist nothing).
pub(super) struct TSnapshotArgs<'a> {
    /// The tenant's limits (which buckets it has).
    pub params: &'a TenantParams,
}

impl Op for TSnapshotArgs<'_> {
    const NAME: &'static str = "tsnapshot";
    type Reply = LedgerView;
    fn argv(&self) -> Argv<'_> {
        Argv {
            tenant: Some(TenantSlots {
                with_source: false,
                params: self.params,
                cost: 0,
                credit: Default::default(),
                cost_credit: 0,
                day: None,
            }),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<LedgerView> {
        if v.len() != 7 {
            return Err(proto("tsnapshot", v));
        }
        Ok(LedgerView {
            levels: [
                level_at(v, 0)?,
                level_at(v, 1)?,
                level_at(v, 2)?,
                level_at(v, 3)?,
            ],
            spent_day: u64_at(v, 4)?,
            spent_month: u64_at(v, 5)?,
            in_flight: u64_at(v, 6)?.min(u32::MAX as u64) as u32,
        })
    }
}

/// `tcal` (tests): the script's calendar for a day number: its month (months since
/// 1970-01) and the µs at which that month ends.
#[doc(hidden)]
pub(super) struct TCalArgs<'a> {
    /// Any limits (the op reads none; the slots carry the day).
    pub params: &'a TenantParams,
    /// The day number (UTC days since 1970-01-01).
    pub day: u32,
}

impl Op for TCalArgs<'_> {
    const NAME: &'static str = "tcal";
    type Reply = (u32, u64);
    fn argv(&self) -> Argv<'_> {
        Argv {
            tenant: Some(TenantSlots {
                with_source: false,
                params: self.params,
                cost: 0,
                credit: Default::default(),
                cost_credit: 0,
                day: Some(self.day),
            }),
            ..Argv::default()
        }
    }
    fn read(v: &[Value]) -> BResult<(u32, u64)> {
        Ok((u64_at(v, 0)? as u32, u64_at(v, 1)?))
    }
}
