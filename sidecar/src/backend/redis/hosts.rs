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
//!
//! §18: a stopped host's in-flight counts go with it. The beat returns the members it
//! removed, and a janitor task drops their shares (`h:<host>`) from every quota hash;
//! every [`RECONCILE_EVERY`] beats it also drops the shares of every host not in the
//! live set (what no beat saw stop), sparing shares younger than [`HEARTBEAT_TTL`].

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
/// ones, and return `{live count, {ids it dropped (at most 64 a beat; the rest go on
/// the next)}, {the live ids when ARGV[3] = 1, else none}}`. The key expires with its
/// last member.
const HEARTBEAT_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 64)
for _, id in ipairs(dead) do redis.call('ZREM', KEYS[1], id) end
redis.call('PEXPIRE', KEYS[1], ttl)
local live = {}
if ARGV[3] == '1' then live = redis.call('ZRANGE', KEYS[1], 0, -1) end
return { redis.call('ZCARD', KEYS[1]), dead, live }
";

/// §18: drop hosts' in-flight counts from the quota hash `KEYS[1]` (`h:<host>` = `t r
/// i o since`, see `gate.lua`'s `qtrack`): subtract them from its totals and delete
/// the hosts' fields. `ARGV[1]` = `drop`: the hosts `ARGV[3..]` (seen to stop);
/// `keep`: every host but `ARGV[3..]` (the live ones), sparing a share first written
/// less than `ARGV[2]` µs ago (its host may not have beaten yet). Reconciling catches
/// what no stop was seen for: a fleet that all stopped, a host that saw a stop and
/// died before dropping it, a host removed by an older version. Idempotent: a field
/// is gone once dropped. Never creates the hash. Returns how many hosts it dropped.
const DROP_HOSTS_LUA: &str = r"
local FL = { 'ft', 'fr', 'fi', 'fo' }
local named = {}
for i = 3, #ARGV do named['h:' .. ARGV[i]] = true end
local fields = {}
local t = redis.call('TIME')
local young = tonumber(t[1]) * 1000000 + tonumber(t[2]) - tonumber(ARGV[2])
if ARGV[1] == 'drop' then
  for f in pairs(named) do fields[#fields + 1] = f end
else
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(f, 1, 2) == 'h:' and not named[f] then fields[#fields + 1] = f end
  end
end
local n = 0
for _, f in ipairs(fields) do
  local v = redis.call('HGET', KEYS[1], f)
  local since = v and tonumber(string.match(v, '(%d+)%s*$')) or 0
  if v and (ARGV[1] == 'drop' or since < young) then
    local i = 0
    for x in string.gmatch(v, '%S+') do
      i = i + 1
      if i <= 4 and (tonumber(x) or 0) > 0 then
        local left = (tonumber(redis.call('HGET', KEYS[1], FL[i])) or 0) - tonumber(x)
        redis.call('HSET', KEYS[1], FL[i], string.format('%d', math.max(0, left)))
      end
    end
    redis.call('HDEL', KEYS[1], f)
    n = n + 1
  end
end
return n
";

/// Every this many beats (and on the first) a host also reconciles: it drops from
/// every quota hash the shares of hosts not in the live set.
pub const RECONCILE_EVERY: u64 = 10;

/// The heartbeat key of a key prefix.
pub fn hosts_key(prefix: &str) -> String {
    format!("{{{prefix}}}:hosts")
}

/// This host's heartbeat, refreshed in the background; the task stops on drop.
pub(super) struct Heartbeat {
    /// Live hosts last counted (at least 1: this one).
    live: Arc<AtomicU64>,
    /// This host's member of the heartbeat set: its calls' in-flight counts are
    /// kept under it in each quota hash (§18, `gate.lua` slot 52).
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
    let cmd = |reconcile: bool| {
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(HEARTBEAT_LUA)
            .arg(1)
            .arg(key.as_str())
            .arg(&*id)
            .arg(ttl_ms)
            .arg(u8::from(reconcile));
        cmd
    };
    let (plain, reconciling) = (cmd(false), cmd(true));
    let conn = Arc::new(conn);
    // Dropping runs apart, so a slow quota key never delays a beat (a late beat
    // would get this host dropped by the others); a job that cannot be queued is
    // left to the next reconcile, which catches whatever a drop missed.
    let (jobs, rx) = tokio::sync::mpsc::channel::<Job>(4);
    tokio::spawn(janitor(conn.clone(), quota_keys, rx));
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for n in 0u64.. {
        tick.tick().await;
        let reconcile = n % RECONCILE_EVERY == 0;
        let answer = conn
            .run_cmd(if reconcile { &reconciling } else { &plain })
            .await;
        let Ok(Value::Array(v)) = answer else {
            // The last count stands; the connection is made again next time.
            if answer.is_err() {
                conn.invalidate();
            }
            continue;
        };
        if let Some(Value::Int(n)) = v.first() {
            live.store((*n).max(1) as u64, Ordering::Relaxed);
        }
        let dead = ids(v.get(1));
        if !dead.is_empty() {
            let _ = jobs.try_send(Job::Drop(dead));
        }
        if reconcile {
            let mut keep = ids(v.get(2));
            if !keep.iter().any(|k| **k == *id) {
                keep.push(id.to_string()); // this host is live whatever the set said
            }
            let _ = jobs.try_send(Job::Keep(keep));
        }
    }
}

/// What the janitor does to every quota hash.
enum Job {
    /// Drop these hosts' shares (their heartbeats expired).
    Drop(Vec<String>),
    /// Drop every share but these hosts' (the live set).
    Keep(Vec<String>),
}

/// The ids in a heartbeat reply's array.
fn ids(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|m| match m {
                Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// §18: run the drop jobs on every quota hash in `keys` (one small script per key: on
/// a Redis Cluster each has its own slot). A key Redis fails on is skipped: the next
/// reconcile covers it. Ends when the heartbeat task (the sender) is gone.
async fn janitor(
    conn: Arc<Connection>,
    keys: Vec<String>,
    mut jobs: tokio::sync::mpsc::Receiver<Job>,
) {
    while let Some(job) = jobs.recv().await {
        let (mode, hosts) = match &job {
            Job::Drop(h) => ("drop", h),
            Job::Keep(h) => ("keep", h),
        };
        for k in &keys {
            let mut cmd = ::redis::cmd("EVAL");
            cmd.arg(DROP_HOSTS_LUA)
                .arg(1)
                .arg(k.as_str())
                .arg(mode)
                .arg(HEARTBEAT_TTL.as_micros() as u64);
            for h in hosts {
                cmd.arg(h.as_str());
            }
            if conn.run_cmd(&cmd).await.is_err() {
                conn.invalidate();
            }
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
