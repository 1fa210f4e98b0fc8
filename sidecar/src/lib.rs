//! PolyGate sidecar library: the governance engine (breaker, quota, pacer, memo,
//! admission, calls) and the daemon that serves it over a Unix socket.
//!
//! Layers, each testable alone: [`config`] (model + parsing), [`backend`] (where
//! breaker and quota state lives), the engine modules (no socket code), the
//! server (wire types ↔ engine), and the process around it: [`daemon`] (sockets,
//! signals, systemd) and [`cli`] (`--check-config`, the `status` client).

pub mod admin_http;
pub mod admission;
pub mod backend;
pub mod breaker;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod health;
pub mod memo;
pub mod metrics;
pub mod pacer;
pub mod peer;
pub mod quota;
pub mod server;
