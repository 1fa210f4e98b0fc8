//! PolyGate sidecar library: the governance engine (breaker, quota, pacer, memo,
//! admission, calls) and the daemon that serves it over a Unix socket.
//!
//! Layers, each testable alone: [`config`] (model + parsing), [`gate`] (the gates as
//! clock-free state machines), [`backend`] (where breaker and quota state lives), the
//! engine modules (no socket code), the server (wire types ↔ engine), and the process
//! around it: [`daemon`] (sockets, signals, systemd) and [`cli`] (`--check-config`,
//! the `status` client).

pub mod admin_http;
pub mod backend;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod gate;
pub mod metrics;
pub mod peer;
pub mod server;
