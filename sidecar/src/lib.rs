//! PolyGate sidecar library: the governance engine (breaker, quota, pacer, memo,
//! admission, calls) and the daemon that serves it over a Unix socket.
//!
//! Layers, each testable alone: [`config`] (model + parsing), [`backend`] (where
//! breaker and quota state lives), the engine modules (no socket code), and the
//! server (wire types ↔ engine).

pub mod admin_http;
pub mod admission;
pub mod backend;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod engine;
pub mod health;
pub mod memo;
pub mod metrics;
pub mod notify;
pub mod pacer;
pub mod peer;
pub mod quota;
pub mod server;
pub mod status_print;
