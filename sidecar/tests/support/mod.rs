//! Test support shared by the integration-test crates; each one that needs it says
//! `mod support;` and uses the parts it wants (so every part allows dead code):
//! - [`daemon`]: the real binary on a temp config, its log, RSS and fds, a raw client;
//! - [`engine_cfg`]: engine configurations built in code, without the parser;
//! - [`redis_server`]: throwaway Redis servers and clusters (§10 contract runs);
//! - [`server`]: the socket server started in-process, and a raw client;
//! - [`test_backend`]: the memory backend with the knobs engine and server tests need.

pub mod daemon;
pub mod engine_cfg;
pub mod redis_server;
pub mod server;
pub mod test_backend;
