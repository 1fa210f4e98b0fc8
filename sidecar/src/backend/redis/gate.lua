-- PolyGate breaker (§6) + quota (§7) for one source, atomically, in one script.
--
-- KEYS[1] = {prefix:source}:b  breaker hash     KEYS[2] = {prefix:source}:q  quota hash
--
-- ARGV: one meaning per slot whatever the op (script.rs `Argv` and `SLOTS` build it
-- under the same names); a slot the op does not use holds the neutral value shown.
-- ARGV[1] op : try_enter | record_success | record_failure | release_probe | neutral
--              | peek | force_open | force_close | reset | reserve | settle | block
--              | admit | report | snapshot
-- ARGV[2] failure_threshold : streak channel threshold. Slots 2..8 are the scope's
--              breaker params, all 0 when the op carries none (the TTL basis
--              stored in the hash is then kept)
-- ARGV[3] failure_rate : rate channel threshold, the one fractional argument
-- ARGV[4] min_calls : window samples before the rate channel applies
-- ARGV[5] window_us : the whole breaker window (two buckets of half each)
-- ARGV[6] cooldown_us : base open duration
-- ARGV[7] max_cooldown_us : open-duration cap; decay period of the cooldown level
-- ARGV[8] probe_ttl_us : half-open probe lease
-- ARGV[9] tpm : token bucket capacity (-1 = bucket disabled)
-- ARGV[10] rpm : request bucket capacity (-1 = bucket disabled)
-- ARGV[11] epoch : the epoch the reporting permit was granted under (0)
-- ARGV[12] count_attempt : 0|1, a success counts in the window (0)
-- ARGV[13] is_probe : 0|1, the reporting permit is the probe (0)
-- ARGV[14] tokens : the reservation: to take (reserve, admit) or taken (settle, report)
-- ARGV[15] settlement : settle: charge | refund_tokens | refund_all ('')
-- ARGV[16] outcome : report: S success | F failure | R 429 | C cancelled ('')
-- ARGV[17] charged : tokens actually used (-1 = the reservation)
-- ARGV[18] block_us : block the quota this long (-1 = no block)
-- ARGV[19] open_us : force_open: how long the breaker stays open (-1)
-- ARGV[20] channel : admin ops: the pub/sub channel they announce on ('')
-- ARGV[21] source : admin ops: the source named in the announcement ('')
--
-- Every clock reading is this server's TIME, in microseconds (exact in a double until
-- 2^53 µs ≈ year 2255). Durations cross as integer microseconds (the caller caps them
-- at 2^52 µs, token counts at 2^53, so all arithmetic here stays exact). Floats are
-- returned as strings (a Lua number reply would be truncated to an integer).
--
-- Numbers handed to redis.call are always formatted here first (`int`, `fmt`,
-- `pexpire`): Lua's own number→string conversion writes large values as `1e+15`,
-- which PEXPIRE rejects ("value is not an integer").

local BK, QK = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local op = ARGV[1]

local FTH, FRATE, MINC = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local WIN, CD, MCD, PTTL = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local HAVE_P = WIN > 0
local TPM, RPM = tonumber(ARGV[9]), tonumber(ARGV[10])
local EPOCH = tonumber(ARGV[11])
local COUNT_ATTEMPT, IS_PROBE = ARGV[12] == '1', ARGV[13] == '1'
local TOKENS, SETTLEMENT, OUTCOME = tonumber(ARGV[14]), ARGV[15], ARGV[16]
local CHARGED, BLOCK, OPEN_FOR = tonumber(ARGV[17]), tonumber(ARGV[18]), tonumber(ARGV[19])
local CHANNEL, SOURCE = ARGV[20], ARGV[21]

local MIN = 60000000 -- one minute in µs
-- A 429 block lasts at most this long (the engine refuses retry_after > 1 day).
local QMAX_BLOCK = 7 * 24 * 3600 * 1000000
-- No TTL exceeds this (µs, ≈ 285 years): PEXPIRE stays in range whatever the inputs.
local TTL_CAP = 2 ^ 53
local CLOSED, OPEN, HALF = 0, 1, 2

local function num(v, d)
  if v then return tonumber(v) end
  return d
end

local function fmt(x)
  return string.format('%.17g', x)
end

-- An integer-valued number as a plain integer string (never exponent notation).
local function int(x)
  return string.format('%.0f', x)
end

-- Expire `key` in `us` microseconds (at least 1 ms, at most TTL_CAP), as an integer
-- number of milliseconds. No-op when the key does not exist.
local function pexpire(key, us)
  local ms = math.ceil(math.min(math.max(us, 1000), TTL_CAP) / 1000)
  return redis.call('PEXPIRE', key, int(ms))
end

-- ------------------------------------------------------------------ breaker

local BF = { 'st', 'e', 'u', 'l', 's', 'k', 'cs', 'bi', 'co', 'cf', 'po', 'pf', 'tb' }

local function bload()
  local v = redis.call('HMGET', BK, unpack(BF))
  return {
    st = num(v[1], CLOSED), e = num(v[2], 0), u = num(v[3], 0),
    l = num(v[4], -1),            -- lease_until; -1 = no lease
    s = num(v[5], 0), k = num(v[6], 0),
    cs = num(v[7], now),          -- closed_since
    bi = num(v[8], 0),            -- current window bucket index
    co = num(v[9], 0), cf = num(v[10], 0), -- current bucket ok / fail
    po = num(v[11], 0), pf = num(v[12], 0), -- previous bucket ok / fail
    tb = num(v[13], 0),           -- TTL basis (µs) from the last params seen
    dirty = false,
  }
end

-- Idle breakers expire, but only long after anything that matters: the TTL basis is
-- max(4 × max(window, max_cooldown, 60 s), 4 × probe_ttl), refreshed on EVERY script
-- that touches the source (reads included: peek, snapshot, a quota-refused admit),
-- plus whatever is left of an OPEN period or a lease. The basis is stored in the hash
-- (`tb`) so that operations without breaker params (neutral, release_probe, admin
-- ops) keep the same TTL; 1 h only for a hash that never saw params (so the first
-- script with params writes the hash, even when nothing else changed). Every permit
-- was granted by such a script and lives at most its lease (probe_ttl, after which
-- the engine reclaims it), so the hash — and the epoch in it — cannot expire while a
-- permit carrying that epoch may still report: the epoch never rewinds under a live
-- permit. An expired breaker is a fresh CLOSED one (streak and
-- window would have aged out of relevance; the cooldown level would have decayed).
local function bttl(b)
  local basis = b.tb
  if HAVE_P then
    basis = math.max(4 * math.max(WIN, MCD, MIN), 4 * PTTL)
    if basis ~= b.tb then b.tb = basis; b.dirty = true end
  end
  if basis <= 0 then basis = 3600000000 end
  local ttl = basis
  if b.st == OPEN and b.u > now then ttl = ttl + (b.u - now) end
  if b.st == HALF and b.l > now then ttl = ttl + (b.l - now) end
  return ttl -- µs
end

local function bsave(b)
  -- The TTL first: a new basis marks the hash dirty, so the HSET below persists it.
  local ttl = bttl(b)
  if b.dirty then
    redis.call('HSET', BK, 'st', int(b.st), 'e', int(b.e), 'u', fmt(b.u), 'l', fmt(b.l),
      's', int(b.s), 'k', int(b.k), 'cs', fmt(b.cs), 'bi', fmt(b.bi), 'co', int(b.co),
      'cf', int(b.cf), 'po', int(b.po), 'pf', int(b.pf), 'tb', fmt(b.tb))
  end
  -- Refresh on every touch (no-op when the hash does not exist: nothing to keep).
  pexpire(BK, ttl)
end

-- Reads: refresh the TTL, persist nothing.
local function btouch(b)
  pexpire(BK, bttl(b))
end

local function bra(b)
  if b.st == OPEN and b.u > now then return b.u - now end
  return 0
end

-- k decay: each whole max_cooldown spent CLOSED takes one off k.
local function decay(b)
  if not HAVE_P or b.st ~= CLOSED or b.k == 0 or MCD <= 0 then return end
  local n = math.floor((now - b.cs) / MCD)
  if n > 0 then
    b.k = math.max(0, b.k - n)
    b.cs = b.cs + n * MCD
    b.dirty = true
  end
end

local function half()
  return math.max(WIN / 2, 1)
end

-- Move the window so the current bucket contains now.
local function roll(b)
  local idx = math.floor(now / half())
  if idx == b.bi then return end
  if idx == b.bi + 1 then
    b.po, b.pf = b.co, b.cf
  else
    b.po, b.pf = 0, 0
  end
  b.co, b.cf, b.bi = 0, 0, idx
  b.dirty = true
end

local function clear_counts(b)
  b.s, b.co, b.cf, b.po, b.pf = 0, 0, 0, 0, 0
  b.dirty = true
end

local function bopen(b, grow)
  if grow then b.k = b.k + 1 end
  local d = math.min(CD * (2 ^ math.min(b.k, 64)), MCD)
  b.st, b.e, b.u, b.l = OPEN, b.e + 1, now + d, -1
  clear_counts(b)
end

local function bclose(b)
  b.st, b.e, b.l, b.cs = CLOSED, b.e + 1, -1, now
  clear_counts(b)
end

-- Returns granted, is_probe.
local function try_enter(b)
  decay(b)
  if b.st == CLOSED then return true, false end
  if b.st == OPEN and now < b.u then return false, false end
  if b.st == HALF and b.l >= 0 and now < b.l then return false, false end
  b.st, b.e, b.l = HALF, b.e + 1, now + PTTL
  b.dirty = true
  return true, true
end

-- Returns applied.
local function record_success(b, count)
  decay(b)
  if EPOCH ~= b.e then return false end
  if b.st == CLOSED then
    b.s = 0
    b.dirty = true
    if count then
      roll(b)
      b.co = b.co + 1
    end
    return true
  elseif b.st == HALF then
    bclose(b)
    return true
  end
  return false
end

local function record_failure(b)
  decay(b)
  if EPOCH ~= b.e then return false end
  if b.st == CLOSED then
    b.s = b.s + 1
    roll(b)
    b.cf = b.cf + 1
    b.dirty = true
    local ok, fail = b.co + b.po, b.cf + b.pf
    local samples = ok + fail
    local enough = samples >= MINC
    local rate = 0
    if samples > 0 then rate = fail / samples end
    if enough and rate >= FRATE then
      bopen(b, true)
    elseif b.s >= FTH and not (enough and rate < FRATE) then
      bopen(b, false)
    end
    return true
  elseif b.st == HALF then
    bopen(b, true)
    return true
  end
  return false
end

local function release_probe(b)
  if EPOCH ~= b.e or b.st ~= HALF then return false end
  b.l = -1
  b.dirty = true
  return true
end

local function neutral(b, is_probe)
  if is_probe then return release_probe(b) end
  return EPOCH == b.e
end

local function applied_reply(b, ok)
  local a = 0
  if ok then a = 1 end
  return { a, b.st, b.e, bra(b) }
end

local function publish(what)
  redis.call('PUBLISH', CHANNEL, what .. ' ' .. SOURCE)
end

-- ------------------------------------------------------------------ quota

-- Levels stay within [−capacity, capacity] (§7 / backend/mod.rs: debt is floored at
-- one minute's worth), exactly like quota.rs `credit`.
local function clamp(x, cap)
  return math.max(math.min(x, cap), -cap)
end

local function qload()
  local v = redis.call('HMGET', QK, 't', 'r', 'ts', 'bu')
  local q = { t = num(v[1], nil), r = num(v[2], nil), ts = num(v[3], now), bu = num(v[4], 0) }
  local dt = math.max(now - q.ts, 0)
  if TPM >= 0 then
    q.t = clamp((q.t or TPM) + dt * TPM / MIN, TPM)
  else
    q.t = nil
  end
  if RPM >= 0 then
    q.r = clamp((q.r or RPM) + dt * RPM / MIN, RPM)
  else
    q.r = nil
  end
  q.ts = math.max(q.ts, now)
  return q
end

-- Time (µs) until a bucket of capacity `cap` at `level` is full again.
local function to_full(level, cap)
  if level == nil or cap <= 0 or level >= cap then return 0 end
  return (cap - level) * MIN / cap
end

-- A quota hash expires once it would read as absent anyway: both buckets full again and
-- the 429 block over (plus a minute of slack). Absent = full buckets, no block.
local function qsave(q)
  redis.call('HSET', QK, 'ts', fmt(q.ts), 'bu', fmt(q.bu))
  if q.t then redis.call('HSET', QK, 't', fmt(q.t)) else redis.call('HDEL', QK, 't') end
  if q.r then redis.call('HSET', QK, 'r', fmt(q.r)) else redis.call('HDEL', QK, 'r') end
  -- Debt is floored at −capacity and blocks at QMAX_BLOCK, so this stays below
  -- QMAX_BLOCK + 3 min; the cap only guards hashes written before those floors.
  local ttl = math.max(to_full(q.t, TPM), to_full(q.r, RPM), q.bu - now, 0) + MIN
  pexpire(QK, math.min(ttl, QMAX_BLOCK + 3 * MIN))
end

local function wait_for(level, cap, need)
  if level == nil or level >= need or cap <= 0 then return 0 end
  return (need - level) * MIN / cap
end

-- Returns ok, retry_after_us. Takes nothing.
local function qcheck(q, tokens)
  if now < q.bu then return false, q.bu - now end
  local w = 0
  if TPM >= 0 then w = math.max(w, wait_for(q.t, TPM, math.min(tokens, TPM))) end
  if RPM >= 0 then w = math.max(w, wait_for(q.r, RPM, 1)) end
  if w > 0 then return false, math.max(math.ceil(w), 1) end
  return true, 0
end

local function qdebit(q, tokens)
  if q.t then q.t = clamp(q.t - tokens, TPM) end
  if q.r then q.r = clamp(q.r - 1, RPM) end
end

local function qsettle(q, reserved, kind, charged)
  local tc, rc = 0, 0
  if kind == 'charge' then
    tc = reserved - charged
  elseif kind == 'refund_tokens' then
    tc = reserved
  else
    tc, rc = reserved, 1
  end
  if q.t then q.t = clamp(q.t + tc, TPM) end
  if q.r then q.r = clamp(q.r + rc, RPM) end
end

local function qblock(d)
  local bu = num(redis.call('HGET', QK, 'bu'), 0)
  local nb = math.max(bu, now + math.min(d, QMAX_BLOCK))
  redis.call('HSET', QK, 'bu', fmt(nb))
  local ttl = redis.call('PTTL', QK)
  local want = math.min(nb - now, QMAX_BLOCK) + MIN
  if ttl < math.ceil(want / 1000) then pexpire(QK, want) end
end

-- ------------------------------------------------------------------ dispatch

if op == 'try_enter' then
  local b = bload()
  local g, p = try_enter(b)
  bsave(b)
  return { g and 1 or 0, p and 1 or 0, b.e, b.st, bra(b) }

elseif op == 'record_success' then
  local b = bload()
  local a = record_success(b, COUNT_ATTEMPT)
  bsave(b)
  return applied_reply(b, a)

elseif op == 'record_failure' then
  local b = bload()
  local a = record_failure(b)
  bsave(b)
  return applied_reply(b, a)

elseif op == 'release_probe' then
  local b = bload()
  local a = release_probe(b)
  bsave(b)
  return applied_reply(b, a)

elseif op == 'neutral' then
  local b = bload()
  local a = neutral(b, IS_PROBE)
  bsave(b)
  return applied_reply(b, a)

elseif op == 'peek' then
  local b = bload()
  btouch(b)
  return { bra(b) }

elseif op == 'force_open' then
  local b = bload()
  b.st, b.e, b.u, b.l, b.dirty = OPEN, b.e + 1, now + OPEN_FOR, -1, true
  bsave(b)
  publish('force_open')
  return applied_reply(b, true)

elseif op == 'force_close' then
  local b = bload()
  bclose(b)
  bsave(b)
  publish('force_close')
  return applied_reply(b, true)

elseif op == 'reset' then
  local b = bload()
  -- Everything but the epoch is forgotten; the epoch is bumped, never rewound.
  local e = b.e + 1
  b = { st = CLOSED, e = e, u = 0, l = -1, s = 0, k = 0, cs = now, bi = 0, co = 0, cf = 0,
        po = 0, pf = 0, tb = b.tb, dirty = true }
  bsave(b)
  redis.call('DEL', QK)
  publish('reset')
  return applied_reply(b, true)

elseif op == 'reserve' then
  local q = qload()
  local ok, ra = qcheck(q, TOKENS)
  if ok then
    qdebit(q, TOKENS)
    qsave(q)
    return { 1, 0 }
  end
  return { 0, ra }

elseif op == 'settle' then
  local q = qload()
  qsettle(q, TOKENS, SETTLEMENT, CHARGED)
  qsave(q)
  return { 1 }

elseif op == 'block' then
  qblock(BLOCK)
  return { 1 }

elseif op == 'admit' then
  -- Gate 3 then gate 4; a breaker refusal takes nothing (same as reserve + refund).
  local q = qload()
  local ok, ra = qcheck(q, TOKENS)
  if not ok then
    btouch(bload())
    return { 1, 0, 0, 0, ra }
  end
  local b = bload()
  local g, p = try_enter(b)
  bsave(b)
  if g then
    qdebit(q, TOKENS)
    qsave(q)
    return { 0, b.e, p and 1 or 0, b.st, 0 }
  end
  return { 2, b.e, 0, b.st, bra(b) }

elseif op == 'report' then
  -- Settle, then the verdict (S success, F failure, R 429, C cancelled).
  local q = qload()
  local b = bload()
  local a
  if OUTCOME == 'S' then
    local charged = CHARGED
    if charged < 0 then charged = TOKENS end
    qsettle(q, TOKENS, 'charge', charged)
    qsave(q)
    a = record_success(b, COUNT_ATTEMPT)
  elseif OUTCOME == 'F' then
    qsettle(q, TOKENS, 'refund_tokens', 0)
    qsave(q)
    a = record_failure(b)
  elseif OUTCOME == 'R' then
    qsettle(q, TOKENS, 'refund_tokens', 0)
    qsave(q)
    if BLOCK >= 0 then qblock(BLOCK) end
    a = neutral(b, IS_PROBE)
  else
    qsettle(q, TOKENS, 'refund_all', 0)
    qsave(q)
    a = neutral(b, IS_PROBE)
  end
  bsave(b)
  return applied_reply(b, a)

elseif op == 'snapshot' then
  local b = bload()
  decay(b)
  roll(b)
  -- Status reads persist nothing (decay and roll are recomputed on the next write);
  -- they only refresh the TTL.
  btouch(b)
  local q = qload()
  local ts, rs = '', ''
  if q.t then ts = fmt(q.t) end
  if q.r then rs = fmt(q.r) end
  return { b.st, b.e, bra(b), b.k, b.co + b.po, b.cf + b.pf, b.s, ts, rs, math.max(q.bu - now, 0) }
end

return redis.error_reply('polygate: unknown op ' .. tostring(op))
