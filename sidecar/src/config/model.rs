//! The validated configuration model (§12a). Everything the engine and daemon read
//! comes from here; parsing and validation live in [`super::parse`].

use std::time::Duration;

/// What a scope does when its gate says "not now" (§5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Sleep on the sidecar and try again.
    Wait,
    /// Return the error at once.
    FailFast,
}

impl Mode {
    /// The config spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Wait => "wait",
            Mode::FailFast => "fail_fast",
        }
    }
}

/// Candidate ordering (§4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector {
    /// Config order.
    Priority,
    /// Recent success rate, then latency.
    Health,
}

/// Which backend holds breaker and quota state (§10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// In-process, one host.
    Memory,
    /// Redis (single node or cluster), many hosts.
    Redis,
}

/// What to do when Redis cannot be reached (§10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnBackendError {
    /// Serve the affected sources from local memory state.
    Local,
    /// Refuse admission with `BackendUnavailable`.
    FailClosed,
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
}

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
}

impl ScopeConfig {
    /// §6: probe lease TTL = 2 × the slowest source timeout of the scope.
    pub fn probe_ttl(&self) -> Duration {
        2 * self
            .sources
            .iter()
            .map(|s| s.timeout)
            .max()
            .unwrap_or(Duration::from_secs(60))
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
}

impl SourceConfig {
    /// §7: the estimate used when the Acquire gives none: the source's own, else
    /// `ceil(tpm / rpm)`, else `ceil(tpm / 60)`, else 0 (no token bucket).
    pub fn default_est_tokens(&self) -> u64 {
        if let Some(e) = self.est_tokens {
            return e;
        }
        match (self.tpm, self.rpm) {
            (Some(t), Some(r)) if r > 0 => t.div_ceil(r),
            (Some(t), _) => t.div_ceil(60),
            _ => 0,
        }
    }

    /// §12: a permit never reported is reclaimed after 2 × the source timeout.
    pub fn permit_lease(&self) -> Duration {
        2 * self.timeout
    }
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            socket: "/run/polygate/sidecar.sock".into(),
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

/// Scope-level defaults (everything but `sources`).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Default `poll_interval`.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Default `stall_window`.
pub const DEFAULT_STALL_WINDOW: Duration = Duration::from_secs(300);
/// Default source `timeout`.
pub const DEFAULT_SOURCE_TIMEOUT: Duration = Duration::from_secs(60);
