//! The validated configuration model (§12a): every type the engine and daemon read,
//! every default, and the one spelling table of each enumeration ([`Spelling`]).
//! Reading a file into it lives in the sibling modules (`raw`, `env`, `validate`).

use std::time::Duration;

use super::tenants::{TenantsConfig, DEFAULT_TENANT_METRICS_TOP};

/// A configuration enumeration whose spellings come from one table: parsing reads
/// it, and status, metrics and log lines print [`as_str`](Mode::as_str), which the
/// same table generates.
pub trait Spelling: Copy + 'static {
    /// Every value with its spelling, in the order messages list them.
    const SPELLINGS: &'static [(&'static str, Self)];

    /// The value spelled exactly `s`.
    fn parse(s: &str) -> Option<Self> {
        Self::SPELLINGS
            .iter()
            .find(|(name, _)| *name == s)
            .map(|(_, v)| *v)
    }

    /// Every spelling, comma-separated (`wait, fail_fast`), for error messages.
    fn allowed() -> String {
        let names: Vec<&str> = Self::SPELLINGS.iter().map(|(n, _)| *n).collect();
        names.join(", ")
    }
}

/// Declares a config enum and its one spelling table: the [`Spelling`] table and
/// the inherent `as_str` both come from the `Variant = "spelling"` list.
macro_rules! spelled {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $spelling:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// The config spelling (also what status, metrics and logs print).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $spelling, )+
                }
            }
        }

        impl Spelling for $name {
            const SPELLINGS: &'static [(&'static str, Self)] =
                &[ $( ($spelling, $name::$variant), )+ ];
        }
    };
}

spelled! {
    /// What a scope does when its gate says "not now" (§5).
    pub enum Mode {
        /// Sleep on the sidecar and try again.
        Wait = "wait",
        /// Return the error at once.
        FailFast = "fail_fast",
    }
}

spelled! {
    /// Candidate ordering (§4).
    pub enum Selector {
        /// Config order.
        Priority = "priority",
        /// Recent success rate, then latency.
        Health = "health",
    }
}

spelled! {
    /// Which backend holds breaker and quota state (§10).
    pub enum BackendKind {
        /// In-process, one host.
        Memory = "memory",
        /// Redis (single node or cluster), many hosts.
        Redis = "redis",
    }
}

spelled! {
    /// What to do when Redis cannot be reached (§10).
    pub enum OnBackendError {
        /// Serve the affected sources from local memory state.
        Local = "local",
        /// Refuse admission with `BackendUnavailable`.
        FailClosed = "fail_closed",
    }
}

/// `sidecar.degraded_share` (§10): how much of every shared quota a degraded host
/// uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DegradedShare {
    /// 1 / the number of live hosts last seen (per-host heartbeats in Redis).
    Auto,
    /// This fraction, in (0, 1].
    Fraction(f64),
}

impl DegradedShare {
    /// The share in force with `live_hosts` hosts last seen (at least one: this).
    pub fn of(self, live_hosts: u64) -> f64 {
        match self {
            DegradedShare::Auto => 1.0 / live_hosts.max(1) as f64,
            DegradedShare::Fraction(f) => f,
        }
    }

    /// As written in the config (`"auto"`, or the fraction).
    pub fn spelled(self) -> String {
        match self {
            DegradedShare::Auto => "auto".into(),
            DegradedShare::Fraction(f) => f.to_string(),
        }
    }
}

spelled! {
    /// What a source's token buckets are finally charged (§7a `tokens_charged`).
    pub enum TokensCharged {
        /// The reported usage (§7): the reservation is settled to it.
        Actual = "actual",
        /// The reservation itself, whatever is reported (Azure OpenAI charges each
        /// request's estimated maximum on arrival).
        Estimate = "estimate",
    }
}

spelled! {
    /// Whether a source applies the provider's rate-limit headers (§18
    /// `observe_limits`).
    pub enum ObserveLimits {
        /// Reports' observed limits lower the buckets; in-flight reservations are
        /// counted per source in the shared state.
        On = "on",
        /// Observed limits are ignored; a report costs what it did before §18.
        Off = "off",
    }
}

spelled! {
    /// Whether a source learns its rate from the 429s (§18 `learn_rate`).
    pub enum LearnRate {
        /// A 429 nothing predicted cuts the per-minute limits ×0.7 (at most once a
        /// second, shared by every host); they recover +0.5 % of the limit a second.
        Aimd = "aimd",
        /// The configured (or `"auto"`) limits as they are.
        Off = "off",
    }
}

spelled! {
    /// How a scope with tenants orders its waiting calls within a priority class
    /// (§19 fair turns).
    pub enum Fairness {
        /// Token-weighted virtual time (VTC): the waiting tenant that has received the
        /// least service (tokens settled ÷ weight) on this host goes next.
        Vtc = "vtc",
        /// Arrival order, as a scope without tenants (the control of the bench).
        Fifo = "fifo",
    }
}

spelled! {
    /// How log lines are written (§12).
    pub enum LogFormat {
        /// One human-readable line per event.
        Text = "text",
        /// One JSON object per line (`timestamp`, `level`, `fields`, `target`), for
        /// log shippers.
        Json = "json",
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Process-level settings.
    pub sidecar: SidecarConfig,
    /// Scopes in config order (order matters for status output).
    pub scopes: Vec<ScopeConfig>,
}

/// `[sidecar]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SidecarConfig {
    /// Unix socket path to bind (ignored when socket-activated).
    pub socket: String,
    /// File mode of the socket (default 0o660).
    pub socket_mode: u32,
    /// If non-empty, only these peer uids may connect.
    pub allowed_uids: Vec<u32>,
    /// If non-empty, only peers in these gids may connect (either list admits).
    pub allowed_gids: Vec<u32>,
    /// Peer uids allowed to send admin requests (ForceOpen/ForceClose/Reset).
    pub admin_uids: Vec<u32>,
    /// Memory or Redis.
    pub backend: BackendKind,
    /// Redis URL for a single node (`redis://host:port/db`).
    pub redis_url: String,
    /// If non-empty, Redis Cluster seed nodes; takes precedence over `redis_url`.
    pub redis_cluster_nodes: Vec<String>,
    /// Key prefix inside the hash tag (`{prefix:source}`).
    pub key_prefix: String,
    /// Degrade or refuse when Redis is unreachable.
    pub on_backend_error: OnBackendError,
    /// Per-command Redis timeout: an admission never blocks longer on Redis.
    pub redis_timeout: Duration,
    /// Largest accepted frame payload in bytes.
    pub max_frame: u32,
    /// How long SIGTERM waits for connections to drain before exiting.
    pub shutdown_grace: Duration,
    /// Optional HTTP admin listener (`/live`, `/ready`, `/metrics`), kept apart from
    /// the worker socket; `None` serves none.
    pub admin_listen: Option<std::net::SocketAddr>,
    /// Human or JSON log lines.
    pub log_format: LogFormat,
    /// How often the admin listener's `/metrics` re-reads the shared backend's view
    /// of every source (breaker, quota) in the background: scrapes never touch the
    /// backend, so this bounds both the staleness of those gauges and their cost.
    pub metrics_refresh: Duration,
    /// §7: a 429's `retry_after` blocks a source's quota for every host for at most
    /// this long (longer values are cut to it), so one buggy worker or a provider's
    /// daily `Retry-After` cannot block a source for a day.
    pub max_rate_limit_block: Duration,
    /// §10: the share of every shared quota this host uses while degraded (Redis
    /// unreachable, `on_backend_error = "local"`), so N hosts do not admit N × the
    /// limit during an outage.
    pub degraded_share: DegradedShare,
    /// Most worker connections served at once (§12 "Bounded under abuse"); `None`
    /// derives it at start-up from the fd limit (`RLIMIT_NOFILE`), which an explicit
    /// value must also stay below.
    pub max_connections: Option<u32>,
    /// How long a connection holding no call and no request may stay open.
    pub idle_timeout: Duration,
    /// Sidecar-wide bytes of unsent replies plus requests in progress, over every
    /// connection: past it no connection's frames are read until replies drain.
    pub max_buffered: u64,
    /// §12: most requests (Acquire, Start, Retry) waiting at once over every
    /// connection; one more that would wait is refused `Overloaded`. Each waiter
    /// holds a few KiB, and the per-connection caps alone allowed ~245 GB. `None`
    /// derives it at start-up from the host's memory
    /// ([`crate::limits::default_max_waiters`]).
    pub max_waiters: Option<u32>,
    /// Threads that run connections, requests and timers (§16): `Some(1)` (the
    /// default) is a single-threaded runtime — no work stealing, no cross-thread
    /// wake-ups, the least CPU per request and the most calls per second measured
    /// (docs/benchmarks.md), and it leaves the host's other cores to the workers it
    /// serves; `Some(n)` a work-stealing runtime of n workers; `None` (written `0`)
    /// one worker per available core.
    pub worker_threads: Option<usize>,
    /// §20: exit after this long without a connection, removing the socket (and an
    /// autostarted sidecar's lock file): a sidecar a client started for itself must
    /// not outlive its users forever, while a configured daemon keeps running.
    pub idle_exit: IdleExit,
    /// §19: `/metrics` carries per-tenant families for this many tenants per scope
    /// (the top by spend), plus totals, so cardinality stays bounded.
    pub tenant_metrics_top: u32,
}

/// `sidecar.idle_exit` (§20) as configured; [`IdleExit::resolve`] gives the bound a
/// process uses, which for an unset key depends on how it was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleExit {
    /// Unset: off for a configured daemon, [`AUTOSTART_IDLE_EXIT`] for one a client
    /// autostarted (`--autostarted`).
    Default,
    /// `"off"`: never exit for want of connections.
    Off,
    /// Exit once no connection has been open for this long.
    After(Duration),
}

impl IdleExit {
    /// The idle bound of a process started `autostarted` or not; `None` = never.
    pub fn resolve(self, autostarted: bool) -> Option<Duration> {
        match self {
            IdleExit::Default if autostarted => Some(AUTOSTART_IDLE_EXIT),
            IdleExit::Default | IdleExit::Off => None,
            IdleExit::After(d) => Some(d),
        }
    }
}

/// §20: `sidecar.idle_exit` of an autostarted sidecar when the key is unset.
pub const AUTOSTART_IDLE_EXIT: Duration = Duration::from_secs(600);

/// `[scopes.NAME]`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScopeConfig {
    /// Scope name (the TOML table key).
    pub name: String,
    /// Behaviour when quota or pacer refuse.
    pub quota_full: Mode,
    /// Behaviour when every source is refused for circuit reasons.
    pub circuit_open: Mode,
    /// Attempts per call (≥ 1).
    pub max_attempts: u32,
    /// Base of the nap jitter; the longest gap between admission passes.
    pub poll_interval: Duration,
    /// Stalled time after which a call ends `stalled`.
    pub stall_window: Duration,
    /// Candidate ordering.
    pub selector: Selector,
    /// Breaker parameters for this scope's sources.
    pub breaker: BreakerConfig,
    /// Pacer parameters for this scope's sources.
    pub pacer: PacerConfig,
    /// Sources in config (priority) order; never empty.
    pub sources: Vec<SourceConfig>,
    /// §15 priority classes, config order; empty = no classes (first come, first
    /// served, no reserves: the behaviour of a scope that never heard of them).
    pub priorities: Vec<PriorityConfig>,
    /// §15: index into `priorities` of the class a call naming none belongs to
    /// (`default_priority`; unset: the last class listed, so unlabelled traffic
    /// never jumps ahead of a class someone declared first). 0 without classes.
    pub default_priority: usize,
    /// §15: above this share of a source's tpm/rpm (or pacer slots) in use,
    /// reserves apply; below it any class may use idle capacity.
    pub saturation: f64,
    /// §19: `[scopes.NAME.tenants]`: per-tenant limits, budgets and fair turns;
    /// `None` = the scope has no tenants (a tenant id on its calls is ignored).
    pub tenants: Option<TenantsConfig>,
}

/// `[[scopes.NAME.priorities]]`: one priority class (§15).
#[derive(Debug, Clone, PartialEq)]
pub struct PriorityConfig {
    /// Class name, as calls name it (`priority=`); `[A-Za-z0-9_-]`, at most
    /// [`MAX_PRIORITY_NAME`] bytes, because it is also a Redis hash field.
    pub name: String,
    /// Share of freed capacity among the classes that are waiting (> 0).
    pub weight: f64,
    /// Share of each source's tpm/rpm (and pacer slots) kept for this class when
    /// the source is saturated; 0 = none.
    pub reserve: f64,
    /// Never more than this share of a source's tpm/rpm (and pacer slots); 1 = no cap.
    pub limit: f64,
}

impl ScopeConfig {
    /// §6: probe lease TTL = 2 × the slowest source timeout of the scope.
    pub fn probe_ttl(&self) -> Duration {
        2 * self
            .sources
            .iter()
            .map(|s| s.timeout)
            .max()
            .unwrap_or(DEFAULT_SOURCE_TIMEOUT)
    }
}

/// `[scopes.NAME.breaker]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Streak channel: consecutive failures that open the breaker.
    pub failure_threshold: u32,
    /// Rate channel: failure fraction (0, 1] that opens it.
    pub failure_rate: f64,
    /// Samples the window needs before the rate channel (and the healthy-window
    /// streak veto) applies.
    pub min_calls: u32,
    /// Whole window; two buckets of `window / 2`.
    pub window: Duration,
    /// Base open duration.
    pub cooldown: Duration,
    /// Cap of the doubled open duration; also the decay period of the level.
    pub max_cooldown: Duration,
}

/// `[scopes.NAME.pacer]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacerConfig {
    /// Starting ceiling.
    pub initial: f64,
    /// Lowest ceiling.
    pub min: f64,
    /// Highest ceiling.
    pub max: f64,
    /// Additive increase numerator (ceiling += increase / ceiling per success).
    pub increase: f64,
    /// Multiplicative decrease factor on 429 / timeout.
    pub decrease: f64,
}

/// `[[scopes.NAME.sources]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceConfig {
    /// Source name; its breaker and quota are global by this name.
    pub name: String,
    /// Tokens per minute; `None` = no token bucket.
    pub tpm: Option<u64>,
    /// Requests per minute; `None` = no request bucket.
    pub rpm: Option<u64>,
    /// Explicit per-attempt token estimate.
    pub est_tokens: Option<u64>,
    /// Upstream timeout; probe lease and permit lease derive from it.
    pub timeout: Duration,
    /// §7a: each per-minute bucket holds `limit × burst / 60 s` (a provider that
    /// evaluates over 1- or 10-second periods needs `1s` / `10s`); at most 60 s.
    pub burst: Duration,
    /// §7a: settle to the reported usage, or charge the reservation (Azure).
    pub tokens_charged: TokensCharged,
    /// §7a: input tokens per minute (Anthropic ITPM); `None` = no such bucket.
    pub itpm: Option<u64>,
    /// §7a: output tokens per minute (Anthropic OTPM); `None` = no such bucket.
    pub otpm: Option<u64>,
    /// §7a: requests per day (OpenAI RPD); `None` = no such bucket.
    pub rpd: Option<u64>,
    /// §7a: tokens per day (OpenAI TPD); `None` = no such bucket.
    pub tpd: Option<u64>,
    /// §7a: explicit output estimate of a call that gives none.
    pub est_output_tokens: Option<u64>,
    /// §18: apply the provider's rate-limit headers reported with the outcomes.
    pub observe_limits: ObserveLimits,
    /// §18: learn the rate from the 429s (`learn_rate`).
    pub learn_rate: LearnRate,
    /// §18: bit `i` set = the `i`-th per-minute bucket (tpm, rpm, itpm, otpm) is
    /// `"auto"`: its limit is learned from the provider's `limit` header.
    pub auto: u8,
    /// §19: dollars per million input tokens (input excluding cached reads), for
    /// tenants' dollar budgets and spend; `None` = free.
    pub usd_per_1m_input: Option<f64>,
    /// §19: dollars per million output tokens.
    pub usd_per_1m_output: Option<f64>,
    /// §19: dollars per million cached input reads; `None` = the input price.
    pub usd_per_1m_cached_input: Option<f64>,
}

impl SourceConfig {
    /// §7: the estimate used when the Acquire gives none: the source's own, else
    /// `ceil(tpm / rpm)`, else `ceil(tpm / 60)`, else 0 (no token bucket).
    pub fn default_est_tokens(&self) -> u64 {
        if let Some(e) = self.est_tokens {
            return e;
        }
        if self.tpm.is_none() && (self.itpm.is_some() || self.otpm.is_some()) {
            // §7a: only split limits: the total is the sum of the split's defaults.
            return per_request(self.itpm, self.rpm) + self.default_est_output_tokens();
        }
        per_request(self.tpm, self.rpm)
    }

    /// §7a: the output estimate used when a call gives none: the source's own, else
    /// `ceil(otpm / rpm)`, else `ceil(otpm / 60)`, else 0 (no output bucket).
    pub fn default_est_output_tokens(&self) -> u64 {
        if let Some(e) = self.est_output_tokens {
            return e;
        }
        per_request(self.otpm, self.rpm)
    }

    /// §7a: the input estimate of a call that gives none: `ceil(itpm / rpm)`, else
    /// `ceil(itpm / 60)` with an input bucket; otherwise what the total estimate
    /// leaves beside the output estimate.
    pub fn default_est_input_tokens(&self) -> u64 {
        match self.itpm {
            Some(_) => per_request(self.itpm, self.rpm),
            None => self
                .default_est_tokens()
                .saturating_sub(self.default_est_output_tokens()),
        }
    }

    /// §12: a permit never reported is reclaimed after 2 × the source timeout.
    pub fn permit_lease(&self) -> Duration {
        2 * self.timeout
    }
}

/// `ceil(limit / rpm)`, else `ceil(limit / 60)`, else 0: one request's share of a
/// per-minute limit.
fn per_request(limit: Option<u64>, rpm: Option<u64>) -> u64 {
    match (limit, rpm) {
        (Some(t), Some(r)) if r > 0 => t.div_ceil(r),
        (Some(t), _) => t.div_ceil(60),
        _ => 0,
    }
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            socket: DEFAULT_SOCKET.into(),
            socket_mode: 0o660,
            allowed_uids: vec![],
            allowed_gids: vec![],
            admin_uids: vec![0],
            backend: BackendKind::Memory,
            redis_url: "redis://127.0.0.1:6379/0".into(),
            redis_cluster_nodes: vec![],
            key_prefix: "polygate".into(),
            on_backend_error: OnBackendError::Local,
            redis_timeout: Duration::from_millis(250),
            max_frame: 65536,
            shutdown_grace: Duration::from_secs(5),
            admin_listen: None,
            log_format: LogFormat::Text,
            metrics_refresh: Duration::from_secs(5),
            max_rate_limit_block: DEFAULT_MAX_RATE_LIMIT_BLOCK,
            degraded_share: DegradedShare::Auto,
            max_connections: None,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_buffered: DEFAULT_MAX_BUFFERED,
            max_waiters: None,
            worker_threads: DEFAULT_WORKER_THREADS,
            idle_exit: IdleExit::Default,
            tenant_metrics_top: DEFAULT_TENANT_METRICS_TOP,
        }
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 5,
            failure_rate: 0.5,
            min_calls: 20,
            window: Duration::from_secs(60),
            cooldown: Duration::from_secs(60),
            max_cooldown: Duration::from_secs(600),
        }
    }
}

impl Default for PacerConfig {
    fn default() -> Self {
        PacerConfig {
            initial: 8.0,
            min: 1.0,
            max: 64.0,
            increase: 1.0,
            decrease: 0.5,
        }
    }
}

// ---------------------------------------------------------------------------------
// Defaults: every key but `scopes.*.sources` has one (§12a). `[sidecar]`, breaker and
// pacer defaults are the `Default` impls above.

/// Default `sidecar.socket` for root (uid 0); see [`default_socket`] for any other
/// user.
pub const DEFAULT_SOCKET: &str = "/run/polygate/sidecar.sock";
/// A non-root user's default socket, under `$XDG_RUNTIME_DIR`.
pub const USER_SOCKET: &str = "polygate/sidecar.sock";

/// §12: the default socket of `uid` — root: [`DEFAULT_SOCKET`]; anyone else:
/// `$XDG_RUNTIME_DIR/polygate/sidecar.sock` (a directory only that user can write,
/// which `/run/polygate` is not). `Err` says what to set when a non-root user has no
/// (absolute) `XDG_RUNTIME_DIR`. The sidecar, `status` and every binding compute the
/// same path, so both ends meet without configuration.
pub fn default_socket_for(uid: u32, xdg_runtime_dir: Option<&str>) -> Result<String, String> {
    if uid == 0 {
        return Ok(DEFAULT_SOCKET.into());
    }
    match xdg_runtime_dir {
        Some(d) if d.starts_with('/') => Ok(format!("{}/{USER_SOCKET}", d.trim_end_matches('/'))),
        _ => Err(format!(
            "no default socket for uid {uid}: XDG_RUNTIME_DIR is not set (or not an \
             absolute path); set [sidecar] socket in the config file (or SIDECAR__SOCKET) \
             and point workers at it with POLYGATE_SOCKET, or set XDG_RUNTIME_DIR \
             (the root default {DEFAULT_SOCKET} is for uid 0)"
        )),
    }
}

/// [`default_socket_for`] this process: its effective uid and `$XDG_RUNTIME_DIR`.
pub fn default_socket() -> Result<String, String> {
    let xdg = std::env::var("XDG_RUNTIME_DIR").ok();
    default_socket_for(nix::unistd::geteuid().as_raw(), xdg.as_deref())
}
/// Default `sidecar.idle_timeout`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Default `sidecar.worker_threads`: one thread (a current-thread runtime).
pub const DEFAULT_WORKER_THREADS: Option<usize> = Some(1);
/// Default `sidecar.max_buffered` (64 MiB).
pub const DEFAULT_MAX_BUFFERED: u64 = 64 * 1024 * 1024;
/// Default `max_attempts` of a scope.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Default `poll_interval` of a scope.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Default `stall_window` of a scope.
pub const DEFAULT_STALL_WINDOW: Duration = Duration::from_secs(300);
/// Default `quota_full` of a scope.
pub const DEFAULT_QUOTA_FULL: Mode = Mode::Wait;
/// Default `circuit_open` of a scope.
pub const DEFAULT_CIRCUIT_OPEN: Mode = Mode::FailFast;
/// Default `selector` of a scope.
pub const DEFAULT_SELECTOR: Selector = Selector::Priority;
/// Default `sidecar.max_rate_limit_block` (§7).
pub const DEFAULT_MAX_RATE_LIMIT_BLOCK: Duration = Duration::from_secs(600);
/// Default `saturation` of a scope with priority classes (§15).
pub const DEFAULT_SATURATION: f64 = 0.8;
/// Most priority classes a scope may declare (the Redis script gets each as
/// arguments of every admission).
pub const MAX_PRIORITIES: usize = 16;
/// Longest priority class name in bytes.
pub const MAX_PRIORITY_NAME: usize = 64;
/// Default source `timeout`.
pub const DEFAULT_SOURCE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default (and largest) source `burst` (§7a): a minute's worth.
pub const DEFAULT_BURST: Duration = Duration::from_secs(60);
/// Default source `tokens_charged` (§7a).
pub const DEFAULT_TOKENS_CHARGED: TokensCharged = TokensCharged::Actual;
/// Default source `observe_limits` (§18): off, so a report without observed limits
/// costs exactly what it did (no in-flight counting on the hot path).
pub const DEFAULT_OBSERVE_LIMITS: ObserveLimits = ObserveLimits::Off;
/// Default source `learn_rate` (§18): off, so a source keeps its limits as
/// configured and its quota state and script calls are what they were.
pub const DEFAULT_LEARN_RATE: LearnRate = LearnRate::Off;

#[cfg(test)]
mod tests {
    use super::*;

    /// Each table lists every variant once, and `as_str` agrees with it.
    fn round_trips<T: Spelling + PartialEq + std::fmt::Debug>(as_str: fn(T) -> &'static str) {
        for (name, v) in T::SPELLINGS {
            assert_eq!(as_str(*v), *name);
            assert_eq!(T::parse(name), Some(*v));
        }
        assert_eq!(T::parse("no such value"), None);
    }

    #[test]
    fn every_enum_spells_from_its_one_table() {
        round_trips(Mode::as_str);
        round_trips(Selector::as_str);
        round_trips(BackendKind::as_str);
        round_trips(OnBackendError::as_str);
        round_trips(TokensCharged::as_str);
        round_trips(LearnRate::as_str);
        assert_eq!(Mode::allowed(), "wait, fail_fast");
        assert_eq!(OnBackendError::allowed(), "local, fail_closed");
    }
}
