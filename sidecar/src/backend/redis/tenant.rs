//! §19 on Redis: the tenant ops of `gate.lua` (`treserve`, `tsettle`, `tsnapshot`,
//! `tcal`) and the slots a source's admit and report fill for their call's tenant.
//!
//! A tenant's ledger is one hash, `{<prefix>:t:<scope>:<tenant>}` (`t#<length of the
//! scope>:` for a scope whose name has `:`, [`script::tenant_key`]). On one server it
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

use super::fault::Fault;
use super::ops::AdmitArgs;
use super::reach::Route;
use super::script::{self, dur_at, int_at, level_at, proto, u64_at, Argv, Op, TenantSlots};
use super::RedisBackend;
use crate::backend::{Admit, AdmitRequest, BResult, Backend, BackendError};
use crate::config::OnBackendError;
use crate::gate::quota::Settlement;
use crate::gate::tenant::{Charge, LedgerView, TenantLimit, TenantParams};
use crate::gate::{TenantAdmit, TenantKey, TenantSettle};

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

/// The slots of a settlement of `t`.
pub(super) fn settle_slots<'a>(t: &TenantSettle<'a>) -> TenantSlots<'a> {
    let (credit, cost_credit) = t.credits();
    TenantSlots {
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

impl RedisBackend {
    /// A tenant op on the ledger `key` alone (§19). `Ok(None)`: Redis cannot be
    /// reached and the local fallback serves it (`on_backend_error = "local"`). The
    /// sources' reachability is not touched: a tenant op names no source.
    pub(super) async fn exec_tenant<O: Op>(&self, key: &str, op: O) -> BResult<Option<O::Reply>> {
        let inv = script::tenant_invocation(key, &op);
        match self.conn.run(&inv).await {
            Ok(v) => O::read(&v).map(Some),
            Err(Fault::Rejected(msg)) => Err(BackendError::Protocol(format!(
                "redis {} rejected `{}` for tenant ledger {key:?}: {msg}",
                self.conn.describe(),
                O::NAME
            ))),
            Err(Fault::Unreachable(msg)) => {
                self.conn.invalidate();
                match self.on_error {
                    OnBackendError::Local => Ok(None),
                    _ => Err(BackendError::Unavailable(format!(
                        "tenant ledger unreachable on redis {}: {msg}",
                        self.conn.describe()
                    ))),
                }
            }
        }
    }

    /// The ledger key of `key`.
    pub(super) fn tenant_key(&self, key: TenantKey<'_>) -> String {
        script::tenant_key(&self.prefix, key.scope, key.tenant)
    }

    /// §10: a tenant's limits as the local fallback applies them (this host's share).
    pub(super) fn local_tenant(&self, p: &TenantParams) -> TenantParams {
        p.share(self.local_share())
    }

    /// The local fallback's admission, every limit (the tenant's too) cut to this
    /// host's share.
    pub(super) async fn admit_locally(&self, source: &str, r: AdmitRequest<'_>) -> BResult<Admit> {
        let q = self.local_q(r.q);
        let tp = r.tenant.map(|t| self.local_tenant(t.params));
        let tenant = r
            .tenant
            .zip(tp.as_ref())
            .map(|(t, params)| TenantAdmit { params, ..t });
        self.local
            .admit_no_probe(source, AdmitRequest { q: &q, tenant, ..r })
            .await
    }

    /// §19 on a Redis Cluster: the tenant's ledger first (its own slot), then the
    /// source; a source refusal gives the tenant's reservation back.
    pub(super) async fn admit_two_step(
        &self,
        source: &str,
        t: TenantAdmit<'_>,
        r: AdmitRequest<'_>,
    ) -> BResult<Admit> {
        if let Route::Local = self.reach.route(source, false)? {
            return self.admit_locally(source, r).await;
        }
        let key = self.tenant_key(t.key);
        let op = TReserveArgs {
            params: t.params,
            charge: t.charge,
        };
        let day = match self.exec_tenant(&key, op).await? {
            None => return self.admit_locally(source, r).await,
            Some(Admit::Admitted { tenant_day, .. }) => tenant_day,
            Some(refused) => return Ok(refused),
        };
        let op = AdmitArgs {
            p: r.p,
            q: r.q,
            tokens: r.tokens,
            class: r.class,
            tenant: None,
        };
        let answer = self.exec(source, op).await;
        let give_back = || self.exec_tenant(&key, TSettleArgs { t: refund(&t, day) });
        match answer {
            Ok(Some(Admit::Admitted {
                epoch,
                is_probe,
                rate,
                ..
            })) => Ok(Admit::Admitted {
                epoch,
                is_probe,
                tenant_day: day,
                rate,
            }),
            Ok(Some(refused)) => {
                give_back().await?;
                Ok(refused)
            }
            Ok(None) => {
                // The source went local meanwhile: so does the whole admission.
                let _ = give_back().await;
                self.admit_locally(source, r).await
            }
            Err(e) => {
                let _ = give_back().await;
                Err(e)
            }
        }
    }

    /// [`Backend::tenant_reserve`].
    pub(super) async fn reserve_tenant(&self, t: TenantAdmit<'_>) -> BResult<Admit> {
        let op = TReserveArgs {
            params: t.params,
            charge: t.charge,
        };
        match self.exec_tenant(&self.tenant_key(t.key), op).await? {
            Some(a) => Ok(a),
            None => {
                let p = self.local_tenant(t.params);
                self.local
                    .tenant_reserve(TenantAdmit { params: &p, ..t })
                    .await
            }
        }
    }

    /// [`Backend::tenant_settle`].
    pub(super) async fn settle_tenant(&self, t: TenantSettle<'_>) -> BResult<()> {
        match self
            .exec_tenant(&self.tenant_key(t.key), TSettleArgs { t })
            .await?
        {
            Some(()) => Ok(()),
            None => {
                let p = self.local_tenant(t.params);
                self.local
                    .tenant_settle(TenantSettle { params: &p, ..t })
                    .await
            }
        }
    }

    /// [`Backend::tenant_snapshot`].
    pub(super) async fn snapshot_tenant(
        &self,
        key: TenantKey<'_>,
        p: &TenantParams,
    ) -> BResult<Option<LedgerView>> {
        match self
            .exec_tenant(&self.tenant_key(key), TSnapshotArgs { params: p })
            .await?
        {
            Some(v) => Ok(Some(v)),
            None => self.local.tenant_snapshot(key, &self.local_tenant(p)).await,
        }
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
                rate: crate::gate::quota::AdmittedRate::WHOLE,
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
            tenant: Some(settle_slots(&self.t)),
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
