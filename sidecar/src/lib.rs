//! PolyGate sidecar library: the governance engine (breaker, quota, pacer, memo,
//! admission, calls) and the daemon that serves it over a Unix socket.
//!
//! Layers, each testable alone: [`config`] (model + parsing), [`backend`] (where
//! breaker and quota state lives), the engine modules (no socket code), and the
//! server (wire types ↔ engine).

pub mod backend;
pub mod breaker;
pub mod quota;
pub mod clock;
pub mod config;
pub mod engine;
pub mod notify;
pub mod peer;
pub mod server;
pub mod status_print;
