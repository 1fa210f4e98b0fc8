//! What the scenarios of one invocation share: the context ([`Ctx`]), scratch
//! directories, and starting (or naming) the sidecar and Redis server to measure.
//! Both the Rust-side scenarios (`scenarios.rs`) and the binding drivers
//! (`drivers.rs`) use these; neither imports the other's helpers.

use std::path::{Path, PathBuf};

use tempfile::TempDir;

use crate::procs;
use crate::target::{Backend, Redis, Sidecar};
use crate::Opts;

/// State shared by the scenarios of one invocation.
pub struct Ctx<'a> {
    pub opts: &'a Opts,
    pub rt: tokio::runtime::Runtime,
    /// The Python asyncio figure, once measured (node and go compare to it).
    pub python_asyncio: Option<f64>,
}

impl<'a> Ctx<'a> {
    pub fn new(opts: &'a Opts, rt: tokio::runtime::Runtime) -> Self {
        Ctx {
            opts,
            rt,
            python_asyncio: None,
        }
    }
}

/// A fresh temp dir, removed when dropped.
pub fn tempdir() -> Result<TempDir, String> {
    tempfile::Builder::new()
        .prefix("polygate-bench-")
        .tempdir()
        .map_err(|e| e.to_string())
}

/// The sidecar to measure: `--socket`, else a fresh one on `backend` in `dir`.
pub fn sidecar(opts: &Opts, dir: &Path, backend: &Backend) -> Result<Sidecar, String> {
    match &opts.socket {
        Some(s) => Sidecar::external(s),
        None => Sidecar::start(&opts.sidecar_bin, dir, backend),
    }
}

/// The Redis server of a run: `--redis-url`, else a throwaway one in `dir`.
pub fn redis_server(opts: &Opts, dir: &Path) -> Result<Redis, String> {
    match &opts.redis_url {
        Some(u) => Redis::external(u),
        None => Redis::start(dir),
    }
}

/// A temp dir for the driver scenarios (kept by the caller).
pub fn scratch() -> Result<TempDir, String> {
    tempdir()
}

/// Where a driver's files are, for messages.
pub fn rel(p: &Path) -> PathBuf {
    p.strip_prefix(procs::repo_root())
        .map(Path::to_path_buf)
        .unwrap_or_else(|_| p.to_path_buf())
}
