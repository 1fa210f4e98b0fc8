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
/// ones, and return how many are live, then the ids of those it dropped (at most
/// 64 a beat; the rest go on the next). The key expires with its last member.
const HEARTBEAT_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 64)
for _, id in ipairs(dead) do redis.call('ZREM', KEYS[1], id) end
redis.call('PEXPIRE', KEYS[1], ttl)
local out = { redis.call('ZCARD', KEYS[1]) }
for _, id in ipairs(dead) do out[#out + 1] = id end
return out
";

/// §18: drop the in-flight counts the hosts `ARGV` kept in the quota hash `KEYS[1]`
/// (`h:<host>` = `t r i o`, see `gate.lua`'s `qtrack`) from its totals, and the
/// hosts' fields. Idempotent: a host's field is gone once dropped, so every host that
/// saw the heartbeat expire may run it. Returns how many hosts had counts there.
const DROP_HOSTS_LUA: &str = r"
local FL = { 'ft', 'fr', 'fi', 'fo' }
local n = 0
for _, id in ipairs(ARGV) do
  local f = 'h:' .. id
  local v = redis.call('HGET', KEYS[1], f)
  if v then
    local i = 0
    for x in string.gmatch(v, '%S+') do
      i = i + 1
      if FL[i] then
        local left = (tonumber(redis.call('HGET', KEYS[1], FL[i])) or 0) - (tonumber(x) or 0)
        redis.call('HSET', KEYS[1], FL[i], string.format('%d', math.max(0, left)))
      end
    end
    redis.call('HDEL', KEYS[1], f)
    n = n + 1
  end
end
return n
";

/// The heartbeat key of a key prefix.
pub fn hosts_key(prefix: &str) -> String {
    format!("{{{prefix}}}:hosts")
}

/// This host's heartbeat, refreshed in the background; the task stops on drop.
pub(super) struct Heartbeat {
    /// Live hosts last counted (at least 1: this one).
    live: Arc<AtomicU64>,
    /// This host's member of the heartbeat set: its calls' in-flight counts are
    /// kept under it in each quota hash (§18, `gate.lua` slot 64).
    id: Arc<str>,
    /// The refreshing task.
    task: tokio::task::AbortHandle,
}

impl Heartbeat {
    /// Start beating on `conn` under `prefix`. Must be called inside a Tokio runtime;
    /// never waits for Redis.
    /// `quota_keys`: the quota hashes a stopped host's in-flight counts are dropped
    /// from when its heartbeat expires.
    pub(super) fn start(conn: Connection, prefix: &str, quota_keys: Vec<String>) -> Self {
        let live = Arc::new(AtomicU64::new(1));
        // Unique per process and per backend (two backends in one test process are
        // two hosts).
        let id = format!(
            "{}-{}-{:016x}",
            hostname(),
            std::process::id(),
            rand::random::<u64>()
        );
        let id: Arc<str> = id.into();
        let task = tokio::spawn(beat(
            conn,
            hosts_key(prefix),
            id.clone(),
            live.clone(),
            quota_keys,
        ))
        .abort_handle();
        Heartbeat { live, id, task }
    }

    /// This host's heartbeat member.
    pub(super) fn id(&self) -> &str {
        &self.id
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

async fn beat(
    conn: Connection,
    key: String,
    id: Arc<str>,
    live: Arc<AtomicU64>,
    quota_keys: Vec<String>,
) {
    let ttl_ms = HEARTBEAT_TTL.as_millis() as u64;
    let mut cmd = ::redis::cmd("EVAL");
    cmd.arg(HEARTBEAT_LUA)
        .arg(1)
        .arg(key.as_str())
        .arg(&*id)
        .arg(ttl_ms);
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Hosts seen to stop whose counts are not dropped everywhere yet (Redis failed
    // half way): tried again on the next beats.
    let mut dead: Vec<String> = Vec::new();
    loop {
        tick.tick().await;
        match conn.run_cmd(&cmd).await {
            Ok(Value::Array(v)) => {
                if let Some(Value::Int(n)) = v.first() {
                    live.store((*n).max(1) as u64, Ordering::Relaxed);
                }
                dead.extend(v.iter().skip(1).filter_map(|m| match m {
                    Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
                    _ => None,
                }));
                dead.sort_unstable();
                dead.dedup();
            }
            Ok(_) => {}
            // The last count stands; the connection is made again next time.
            Err(_) => {
                conn.invalidate();
                continue;
            }
        }
        if !dead.is_empty() && drop_hosts(&conn, &quota_keys, &dead).await {
            dead.clear();
        }
    }
}

/// §18: drop the stopped hosts `dead`'s in-flight counts from every quota hash in
/// `keys` (one small script per key: on a Redis Cluster each has its own slot).
/// `false`: Redis failed on some key; the caller tries them all again.
async fn drop_hosts(conn: &Connection, keys: &[String], dead: &[String]) -> bool {
    for k in keys {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(DROP_HOSTS_LUA).arg(1).arg(k.as_str());
        for d in dead {
            cmd.arg(d.as_str());
        }
        if conn.run_cmd(&cmd).await.is_err() {
            conn.invalidate();
            return false;
        }
    }
    true
}

/// This machine's name, for a readable heartbeat member (`unknown` if unset).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
