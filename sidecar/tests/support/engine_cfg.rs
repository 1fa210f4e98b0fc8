//! Builds engine configurations in code, so engine tests do not depend on the parser.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use polygate::backend::memory::MemoryBackend;
use polygate::clock::{Clock, TokioClock};
use polygate::config::*;
use polygate::engine::Engine;

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

pub fn source(name: &str) -> SourceConfig {
    SourceConfig {
        name: name.into(),
        tpm: None,
        rpm: None,
        est_tokens: None,
        timeout: secs(10),
        burst: polygate::config::DEFAULT_BURST,
        tokens_charged: polygate::config::DEFAULT_TOKENS_CHARGED,
        itpm: None,
        otpm: None,
        rpd: None,
        tpd: None,
        est_output_tokens: None,
        observe_limits: polygate::config::DEFAULT_OBSERVE_LIMITS,
        learn_rate: polygate::config::DEFAULT_LEARN_RATE,
        auto: 0,
        usd_per_1m_input: None,
        usd_per_1m_output: None,
        usd_per_1m_cached_input: None,
    }
}

/// A scope with the §12a defaults and the given sources.
pub fn scope(name: &str, sources: Vec<SourceConfig>) -> ScopeConfig {
    ScopeConfig {
        name: name.into(),
        quota_full: Mode::Wait,
        circuit_open: Mode::FailFast,
        max_attempts: DEFAULT_MAX_ATTEMPTS,
        poll_interval: DEFAULT_POLL_INTERVAL,
        stall_window: DEFAULT_STALL_WINDOW,
        selector: Selector::Priority,
        breaker: BreakerConfig {
            failure_threshold: 3,
            ..BreakerConfig::default()
        },
        pacer: PacerConfig::default(),
        sources,
        priorities: Vec::new(),
        default_priority: 0,
        saturation: polygate::config::DEFAULT_SATURATION,
        tenants: None,
    }
}

pub fn config(scopes: Vec<ScopeConfig>) -> Config {
    Config {
        sidecar: SidecarConfig::default(),
        scopes,
    }
}

/// An engine over the memory backend on tokio's (pausable) clock.
pub fn engine(cfg: &Config) -> Arc<Engine<MemoryBackend>> {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::new());
    engine_with_clock(cfg, clock)
}

pub fn engine_with_clock(cfg: &Config, clock: Arc<dyn Clock>) -> Arc<Engine<MemoryBackend>> {
    let names: Vec<String> = cfg
        .scopes
        .iter()
        .flat_map(|s| s.sources.iter().map(|x| x.name.clone()))
        .collect();
    let backend = MemoryBackend::new(clock.clone(), names);
    Engine::new(cfg, backend, clock)
}
