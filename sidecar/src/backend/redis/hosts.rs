//! Host heartbeats (§10): how many sidecars share this key prefix right now, so a
//! degraded host uses only its share of every shared quota (`degraded_share =
//! "auto"`: 1 / the live hosts last seen).
//!
//! Each sidecar keeps one heartbeat per key prefix: a member of the sorted set
//! `{<prefix>}:hosts` whose score is the moment it expires ([`HEARTBEAT_TTL`] after
//! its last refresh, on Redis's `TIME`). A background task refreshes it every
//! [`HEARTBEAT_EVERY`] with one small script that also drops the expired members and
//! counts the live ones, so the count is read with no round trip of its own on any
//! call's path: admissions read the last count from memory. It goes as a plain
//! `EVAL` (a few hundred bytes once a second), which nothing else sends: `gate.lua`
//! runs as `FCALL` (or `EVALSHA` before Redis 7), so the heartbeat's cost is told
//! apart in `INFO commandstats`. One key (one slot) per
//! prefix makes the count a single call on Redis Cluster too; a host that stops
//! (crash, SIGKILL, network loss) falls out of the count within the TTL.
//! While Redis cannot be read the last count stands (that is what "last seen"
//! means: the share a degraded host uses is fixed by the fleet it last saw).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::redis::Value;

use super::conn::Connection;

/// How often a host refreshes its heartbeat and reads the live count.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// A heartbeat not refreshed for this long no longer counts.
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(3);

/// Refresh `ARGV[1]`'s heartbeat (expiring `ARGV[2]` ms from now), drop the expired
/// ones, and return how many are live. The key expires with its last member.
const HEARTBEAT_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
";

/// The heartbeat key of a key prefix.
pub fn hosts_key(prefix: &str) -> String {
    format!("{{{prefix}}}:hosts")
}

/// This host's heartbeat, refreshed in the background; the task stops on drop.
pub(super) struct Heartbeat {
    /// Live hosts last counted (at least 1: this one).
    live: Arc<AtomicU64>,
    /// The refreshing task.
    task: tokio::task::AbortHandle,
}

impl Heartbeat {
    /// Start beating on `conn` under `prefix`. Must be called inside a Tokio runtime;
    /// never waits for Redis.
    pub(super) fn start(conn: Connection, prefix: &str) -> Self {
        let live = Arc::new(AtomicU64::new(1));
        // Unique per process and per backend (two backends in one test process are
        // two hosts).
        let id = format!(
            "{}-{}-{:016x}",
            hostname(),
            std::process::id(),
            rand::random::<u64>()
        );
        let task = tokio::spawn(beat(conn, hosts_key(prefix), id, live.clone())).abort_handle();
        Heartbeat { live, task }
    }

    /// Live hosts last seen (1 before the first count).
    pub(super) fn live_hosts(&self) -> u64 {
        self.live.load(Ordering::Relaxed).max(1)
    }
}

impl Heartbeat {
    /// Stop beating.
    pub(super) fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn beat(conn: Connection, key: String, id: String, live: Arc<AtomicU64>) {
    let ttl_ms = HEARTBEAT_TTL.as_millis() as u64;
    let mut cmd = ::redis::cmd("EVAL");
    cmd.arg(HEARTBEAT_LUA)
        .arg(1)
        .arg(key.as_str())
        .arg(id.as_str())
        .arg(ttl_ms);
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match conn.run_cmd(&cmd).await {
            Ok(Value::Int(n)) => live.store(n.max(1) as u64, Ordering::Relaxed),
            Ok(_) => {}
            // The last count stands; the connection is made again next time.
            Err(_) => conn.invalidate(),
        }
    }
}

/// This machine's name, for a readable heartbeat member (`unknown` if unset).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
