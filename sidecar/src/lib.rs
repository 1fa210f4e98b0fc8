//! PolyGate sidecar library: the governance engine (gates, admission, calls and
//! permits) and the daemon that serves it over a Unix socket. `ARCHITECTURE.md` at
//! the repository root draws the whole picture.
//!
//! Layers, each testable alone, each depending only on the ones before it:
//! [`clock`] and [`config`] (model + parsing); [`gate`] (the gates as clock-free
//! state machines with their own types); [`backend`] (where breaker and quota state
//! lives: memory or Redis); [`engine`] (calls, permits, admission, report; no socket
//! code); [`server`] (wire types ↔ engine), [`admin_http`] and [`metrics`] (the
//! operator's listener), [`peer`] (who may connect); and the process around it:
//! [`daemon`] (sockets, signals, systemd) and [`cli`] (`--check-config`, the `status`
//! client). [`limits`] holds the bounds every outside input is held to (the
//! connection cap's numbers too, shared by `daemon` and `server`), [`logs`]
//! summarises the log lines a client can trigger (§12), [`histogram`] is the
//! lock-free histogram the engine and the metrics both record into.

pub mod admin_http;
pub mod backend;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod gate;
pub mod histogram;
pub mod limits;
pub mod logs;
pub mod metrics;
pub mod peer;
pub mod server;
