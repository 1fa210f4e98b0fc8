//! §19's configuration: a scope's `[scopes.NAME.tenants]` table as the engine reads
//! it (limits, overrides, fair turns, bounds), and the units tenants are counted in.
//! Its own module beside `model.rs` (the rest of the configuration's shape); parsing
//! and checking are `raw.rs` and `validate/tenants.rs`.

use super::Fairness;

/// `[scopes.NAME.tenants]` (§19): what every tenant of the scope may use, and how
/// the scope's waiters take turns among tenants.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantsConfig {
    /// Order among waiters of one priority class.
    pub fairness: Fairness,
    /// Limits of a tenant no override names (`default = {…}`; empty = none).
    pub default: TenantLimits,
    /// Limits of the anonymous tenant, the calls that name none (`anonymous = {…}`;
    /// unset = none: "no tenant limit applies to it unless configured").
    pub anonymous: TenantLimits,
    /// `[[scopes.NAME.tenants.override]]`, config order: named tenants' limits, each
    /// key it leaves unset taken from `default`.
    pub overrides: Vec<TenantOverride>,
    /// Most tenants this host tracks in the scope at once (ledgers in memory, fair
    /// turn counters): a worker inventing tenant ids cannot grow the sidecar without
    /// bound; past it, a call of a new tenant is refused `Overloaded`.
    pub max_tenants: u32,
}

/// One tenant's limits in a scope (§19); every limit optional.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TenantLimits {
    /// Tokens per minute (continuous refill, a minute's worth: §7).
    pub tpm: Option<u64>,
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// Tokens per day (continuous refill, a day's worth: §7a).
    pub tpd: Option<u64>,
    /// Requests per day.
    pub rpd: Option<u64>,
    /// Dollars per calendar day (UTC), in nano-dollars: spent, never refilled until
    /// the day ends.
    pub usd_per_day: Option<u64>,
    /// Dollars per calendar month (UTC), in nano-dollars.
    pub usd_per_month: Option<u64>,
    /// Share of the fair turns among waiting tenants (> 0; `None` = 1).
    pub weight: Option<f64>,
}

impl TenantLimits {
    /// `self`'s keys, each unset one taken from `base` (an override over `default`).
    pub fn or(self, base: TenantLimits) -> TenantLimits {
        TenantLimits {
            tpm: self.tpm.or(base.tpm),
            rpm: self.rpm.or(base.rpm),
            tpd: self.tpd.or(base.tpd),
            rpd: self.rpd.or(base.rpd),
            usd_per_day: self.usd_per_day.or(base.usd_per_day),
            usd_per_month: self.usd_per_month.or(base.usd_per_month),
            weight: self.weight.or(base.weight),
        }
    }

    /// `true` when no limit is set (the tenant is tracked, never refused).
    pub fn unlimited(&self) -> bool {
        self.tpm.is_none()
            && self.rpm.is_none()
            && self.tpd.is_none()
            && self.rpd.is_none()
            && self.usd_per_day.is_none()
            && self.usd_per_month.is_none()
    }
}

/// `[[scopes.NAME.tenants.override]]`: one named tenant's limits.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantOverride {
    /// The tenant id, as calls name it.
    pub name: String,
    /// Its limits (unset keys already filled from `default`).
    pub limits: TenantLimits,
}

/// A tenant id is at most this many bytes of UTF-8 (§19).
pub const MAX_TENANT_ID: usize = 128;

/// Default [`TenantsConfig::max_tenants`].
pub const DEFAULT_MAX_TENANTS: u32 = 100_000;

/// Default `sidecar.tenant_metrics_top`: per-tenant metric families for this many
/// tenants (by spend) per scope.
pub const DEFAULT_TENANT_METRICS_TOP: u32 = 20;

/// Nano-dollars in a dollar: money is kept as integers of this unit everywhere (a
/// Redis script's numbers are doubles, exact below 2^53 n$ ≈ $9 million).
pub const NANOS_PER_USD: f64 = 1e9;
