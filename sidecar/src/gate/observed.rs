//! Limits learned from the provider (DESIGN §18): what a report's rate-limit headers
//! say, and what a source keeps of them. The rule itself (lower a bucket to
//! `remaining − in flight`, block on `remaining = 0`, ignore stale observations,
//! learn an `"auto"` bucket's capacity) is [`crate::gate::quota::Quota::observe`];
//! `gate.lua` implements the same.
//!
//! Dimensions are indexed like the first four [`crate::gate::quota::BUCKETS`]: tokens
//! (`tpm`), requests (`rpm`), input tokens (`itpm`), output tokens (`otpm`).

use std::time::Duration;

/// The number of observed dimensions (the per-minute buckets).
pub const DIMS: usize = 4;

/// One dimension of a response's rate-limit headers.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Dim {
    /// The provider's limit (an `"auto"` bucket's capacity).
    pub limit: Option<u64>,
    /// What the provider says is left.
    pub remaining: Option<u64>,
    /// How long until the provider's counter is whole again, from the response.
    pub reset: Option<Duration>,
}

/// A response's rate-limit headers, as the report carried them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Observation {
    /// Per dimension, in [`crate::gate::quota::BUCKETS`] order (tpm, rpm, itpm, otpm).
    pub dims: [Option<Dim>; DIMS],
    /// Time between the response and the report: the observation is dated
    /// `now − age` on the backend's clock.
    pub age: Duration,
}

/// In-flight reservations of a source (reserved, not yet settled), per dimension:
/// tokens, requests, input, output. Kept only for sources that observe (§18).
pub type InFlight = [u64; DIMS];

/// What a source keeps of the last observation of one dimension (status, metrics).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LastSeen {
    /// The provider's limit, if it said.
    pub limit: Option<u64>,
    /// What the provider said was left.
    pub remaining: u64,
    /// How long ago the observation was made (at the snapshot).
    pub age: Duration,
    /// Units (tokens or requests) the corrections took off this bucket in total:
    /// the traffic PolyGate did not see.
    pub removed: u64,
}

/// Per-source state of §18 in a backend: in-flight counts, the last observation's
/// time, what was seen and learned.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Seen {
    /// Reservations not yet settled.
    pub inflight: InFlight,
    /// The backend time of the last applied observation (a later-dated one is stale
    /// if it is older).
    pub at: Option<Duration>,
    /// An `"auto"` bucket's learned capacity (the provider's `limit`).
    pub learned: [Option<u64>; DIMS],
    /// Last remaining and limit seen, and when (backend time).
    pub last: [Option<(u64, Option<u64>, Duration)>; DIMS],
    /// Units the corrections removed, per dimension.
    pub removed: [u64; DIMS],
}
