-- PolyGate breaker (§6) + quota (§7, §7a) for one source, and the ledger of the call's
-- tenant (§19), atomically, in one script call.
--
-- KEYS[1] = {prefix:source}:b  breaker hash     KEYS[2] = {prefix:source}:q  quota hash
-- KEYS[3] = {prefix:t:scope:tenant}  the tenant's ledger (admit, report with three keys,
--           on one server: a Redis Cluster routes a call by one slot, so there the engine
--           calls the tenant ops treserve / tsettle on this key alone, KEYS[1]); a scope
--           whose name has ':' is written {prefix:t#<its length>:scope:tenant}
--           (script/mod.rs `tenant_key`)
--
-- ARGV: one meaning per slot whatever the op (script.rs `Argv` and `SLOTS` build it
-- under the same names); a slot the op does not use holds the neutral value shown, and
-- trailing neutral slots are not sent at all (a missing slot reads as its neutral).
-- ARGV[1] op : try_enter | record_success | record_failure | release_probe | neutral
--              | peek | force_open | force_close | reset | reserve | settle | block
--              | admit | report | snapshot
-- ARGV[2] failure_threshold : streak channel threshold. Slots 2..10 are the scope's
--              breaker params, all 0 when the op carries none
-- ARGV[3] failure_rate : rate channel threshold, the one fractional argument
-- ARGV[4] min_calls : window samples before the rate channel applies
-- ARGV[5] window_us : the whole breaker window (two buckets of half each)
-- ARGV[6] cooldown_us : base open duration
-- ARGV[7] max_cooldown_us : open-duration cap; decay period of the cooldown level
-- ARGV[8] probe_ttl_us : half-open probe lease
-- ARGV[9] k_max : the cooldown level never exceeds this
-- ARGV[10] ttl_basis_us : an idle breaker hash lives at least this long (0)
-- ARGV[11] tpm : token bucket capacity (-1 = bucket disabled)
-- ARGV[12] rpm : request bucket capacity (-1 = bucket disabled)
-- ARGV[13] tokens : the reservation to take (reserve, admit) (0)
-- ARGV[14] epoch : the epoch the reporting permit was granted under (0)
-- ARGV[15] count_attempt : 0|1, a success counts in the window (0)
-- ARGV[16] is_probe : 0|1, the reporting permit is the probe (0)
-- ARGV[17] verdict : report: S success | F failure | N none (429, cancel) ('')
-- ARGV[18] token_credit : settle, report: tokens given back; negative = extra debit (0)
-- ARGV[19] request_credit : settle, report: requests given back, 0 or 1 (0)
-- ARGV[20] block_us : block the quota this long (-1 = no block)
-- ARGV[21] open_us : force_open: how long the breaker stays open (-1)
-- ARGV[22] channel : admin ops: the pub/sub channel they announce on ('')
-- ARGV[23] source : admin ops: the source named in the announcement ('')
-- ARGV[24] class : §15 admit, report: the call's priority class name ('' = none)
-- ARGV[25] saturation_ppm : §15 admit: share in use above which reserves apply (0)
-- ARGV[26] classes : §15 admit: every class of the scope, 'name reserve_ppm limit_ppm'
--              triples separated by spaces ('')
-- ARGV[27] burst_us : §7a: a per-minute bucket holds limit x burst / 1 min, at least 1
--              (0 = a minute's worth: exactly §7)
-- ARGV[28] itpm : input token bucket limit per minute (-1 = disabled)
-- ARGV[29] otpm : output token bucket limit per minute (-1 = disabled)
-- ARGV[30] tpd : token bucket limit per day (-1 = disabled)
-- ARGV[31] rpd : request bucket limit per day (-1 = disabled)
-- ARGV[32] in_tokens : the reservation's input tokens (reserve, admit) (0)
-- ARGV[33] out_tokens : the reservation's output tokens (reserve, admit) (0)
-- ARGV[34] in_credit : settle, report: input tokens given back; negative = debit (0)
-- ARGV[35] out_credit : settle, report: output tokens given back; negative = debit (0)
-- ARGV[36] max_debt_us : settle, report: a credit's extra debit takes at most this much
--              refill time from any bucket (§12, max_rate_limit_block) (600000000)
-- ARGV[37] observe : §18 0|1: keep in-flight counts (admit, reserve, settle, report:
--              slots 13, 32, 33 then carry the reservation) and apply observations (0)
-- ARGV[38] auto : §18 bit i-1 set = bucket i (tt, rt, it, ot) is "auto": its limit is
--              the learned field 'l:<bucket>' (0)
-- ARGV[39] obs_age_us : §18 report: the observation was made this long before now
--              (-1 = the report carries none)
-- ARGV[40] tt_limit : §18 report: the provider's token limit (-1 = not said). Slots
--              40..51 are limit, remaining, reset_us of tokens, requests, input, output
-- ARGV[41] tt_remaining : tokens left (-1)
-- ARGV[42] tt_reset_us : until the token counter is whole again (-1)
-- ARGV[43] rt_limit : requests (-1)
-- ARGV[44] rt_remaining : (-1)
-- ARGV[45] rt_reset_us : (-1)
-- ARGV[46] it_limit : input tokens (-1)
-- ARGV[47] it_remaining : (-1)
-- ARGV[48] it_reset_us : (-1)
-- ARGV[49] ot_limit : output tokens (-1)
-- ARGV[50] ot_remaining : (-1)
-- ARGV[51] ot_reset_us : (-1)
-- ARGV[52] host : §18 with slot 37 set: the id of the host whose call this is (its
--              heartbeat member), so its in-flight counts are kept apart ('h:<host>')
--              and dropped when its heartbeat expires (hosts.rs); '' = not kept apart
-- ARGV[53] learn : §18 learn_rate = "aimd": the per-minute limits are scaled by the factor
--              in field 'ar' ("<ppm> <at µs>": ppm of the limit as of the last cut, and
--              when), recovering this many ppm per second from it (0 = off: 'ar' is
--              never read) (0)
-- ARGV[54] rate_limited : report with slot 53 set: the outcome is a 429, which cuts the
--              factor ×0.7 (at least 5 %) unless a 429 block is in force or the last cut
--              is under a second old (gate/quota/learn.rs) (0)
-- ARGV[55] rate_ppm : report with slot 53 set: the factor the reservation was admitted
--              at (the admit reply's element 7): the settlement's credits (slots 18, 19,
--              34, 35) are converted to refill time at the per-minute limits scaled by
--              it, so a refund gives back what the reservation took even when the factor
--              was cut since (1000000 = whole)
-- ARGV[56] cut_at_us : report with slot 53 set: the date of the last cut in force at the
--              call's admission (the admit reply's element 8; 0 = none): a 429 cuts
--              only while that cut is still the last one, since a call sent before a
--              cut says nothing of the rate after it (-1 = not known: it cuts as if
--              admitted under the last cut)
--
-- §19: a call that carries a tenant ledger (admit and report with three keys; the
-- tenant ops treserve, tsettle, tsnapshot, tcal with it as their one key) sends its
-- tenant's slots as the LAST 11 ARGV entries, after the slots above (trimmed as
-- always): a call without a tenant sends none of them, and one with a tenant sends
-- no neutral slot between the source's and the tenant's. `gate` moves them into T
-- on entry, so arg(i) never sees them. T[k]:
-- TARGV[1] t_tpm : the tenant's token bucket limit per minute (-1 = none). T[1..6]
--              are its limits, sent with every tenant op
-- TARGV[2] t_rpm : requests per minute (-1)
-- TARGV[3] t_tpd : tokens per day (-1)
-- TARGV[4] t_rpd : requests per day (-1)
-- TARGV[5] t_usd_day : dollars per UTC day, n$ (-1 = none)
-- TARGV[6] t_usd_month : dollars per UTC month, n$ (-1 = none)
-- TARGV[7] t_cost : admit, treserve: the reservation's estimated cost, n$ (0); its tokens
--              are slot 13 and one request
-- TARGV[8] t_token_credit : report, tsettle: tokens given back to the tenant's token
--              buckets; negative = extra debit (0)
-- TARGV[9] t_request_credit : report, tsettle: requests given back, 0 or 1 (0)
-- TARGV[10] t_cost_credit : report, tsettle: n$ given back to the budget windows the
--              reservation was charged to; negative = charged more (0)
-- TARGV[11] t_day : report, tsettle: the day number (UTC days since 1970) the
--              reservation was charged to (-1); tcal: the day to convert
--
-- Cost (§10, §16): one TIME per call; every stored number is an integer (µs or a
-- count) written with '%d' (never '%.17g' float text, never strtod of one); each hash
-- is read with one HMGET of the fields the op needs and written with one HSET of the
-- fields that changed; expiry is only touched when it must move. The common admission
-- is TIME + HMGET q + HMGET b + HSET q; the common report TIME + HMGET b + HSET b,
-- plus HMGET q + HSET q when the charge differs from the reservation. §19: a tenant
-- adds HMGET t + HSET t to an admission, and HINCRBY t to a report that gives nothing
-- back (HMGET t + HSET t to one that does).
--
-- Times are this server's TIME in µs (exact in a double until 2^53 µs ≈ year 2255);
-- durations cross as integer µs capped at 2^52, counts at 2^53, so the arithmetic here
-- stays exact.
--
-- Expiry (what must persist, and for how long):
-- * The breaker hash holds the epoch and the cooldown level. While its state is one
--   the memory backend would still remember (OPEN, HALF_OPEN, a failure streak) it
--   has no TTL. Once CLOSED without a streak it may expire, but only after its level
--   has decayed to 0 (closed_since + k × max_cooldown) plus ttl_basis (4 × max(window,
--   max_cooldown, probe_ttl): longer than any permit's lease, so the epoch never goes
--   away under a live permit, and longer than the window, whose counts have aged out
--   by then). So an expired breaker reads exactly as the memory backend's would —
--   CLOSED, k = 0, empty window, no streak — with epoch 0, which no live permit
--   carries. The deadline set on the key is kept in field `x` (-1 = persistent), and
--   the key's expiry is moved only when the needed deadline passes it (then to
--   twice the basis ahead): one PEXPIREAT per basis period in steady traffic.
-- * The quota hash reads as full and unblocked once every bucket has refilled and the
--   429 block is over; it expires then (plus a minute, moved a minute at a time).
--   While it holds a limit learned for an "auto" bucket (§18) it is kept at least an
--   hour past its last write (moved an hour at a time): an idle minute must not send a
--   learned source back to one call at a time. Calls in flight alone do not keep it:
--   a report that never arrives (a host killed mid-call) leaves its count behind, and
--   on an unlearned "auto" source that count holds admissions back until the hash
--   expires, so that must stay a minute.

local CLOSED, OPEN, HALF = 0, 1, 2
-- Library functions as locals (a global lookup and a field lookup less per use), set
-- by `gate` on its first call (a Function library sees no globals while it loads).
local max, min, floor, ceil, tonumber, format, unpack
local MIN = 60000000 -- one minute in µs: the refill period of a per-minute bucket
local DAY = 86400000000 -- one day in µs: the refill period of a per-day bucket (§7a)
-- A 429 block lasts at most this long here (the engine caps it at
-- max_rate_limit_block, default 10 min; this only bounds a misbehaving caller).
local QMAX_BLOCK = 7 * 24 * 3600 * 1000000
local QSLACK = MIN -- a quota hash's expiry moves this far past its need at a time
local QKEEP = 60 * MIN -- the same while it holds a learned limit
-- §18 learn_rate (gate/quota/learn.rs): the whole factor, its floor, one cut per this
-- many µs.
local LWHOLE, LFLOOR, LCUT_EVERY = 1000000, 50000, 1000000

-- The call's keys and arguments and its clock reading, set by `gate` on entry (module
-- locals, so the same text also loads as a Redis Function library).
local K, A, now

-- Scratch tables reused across calls (module locals: a call allocates none of them):
-- the breaker's and the quota's changed-field lists (each call loads at most one of
-- each), and the HSET argument list (sent with an explicit length, so stale entries
-- past it are never read).
local BW, QW, HARGS = {}, {}, {}

local function clear(t)
  for k = #t, 1, -1 do t[k] = nil end
  return t
end

local function fmt(x)
  return format('%d', x)
end

-- Slot `i` as a number, `d` when it was not sent.
local function arg(i, d)
  local v = A[i]
  if v == nil or v == '' then return d end
  return tonumber(v)
end

-- ------------------------------------------------------------------ breaker

-- Load the breaker; `window` also loads the window buckets (the ops that count).
local function bload(window)
  local v
  if window then
    v = redis.call('HMGET', K[1], 'st', 'e', 'u', 'l', 's', 'k', 'cs', 'x',
      'bi', 'co', 'cf', 'po', 'pf')
  else
    v = redis.call('HMGET', K[1], 'st', 'e', 'u', 'l', 's', 'k', 'cs', 'x')
  end
  -- (tonumber(false) is nil: an absent field takes the default after `or`.)
  local b = {
    exists = v[2] ~= false or v[8] ~= false, -- an epoch, or an expiry this script set
    st = tonumber(v[1]) or CLOSED, e = tonumber(v[2]) or 0, u = tonumber(v[3]) or 0,
    l = tonumber(v[4]) or -1,     -- lease_until; -1 = no lease
    s = tonumber(v[5]) or 0, k = tonumber(v[6]) or 0,
    cs = tonumber(v[7]) or now,   -- closed_since (absent: now, but written when set)
    fresh_cs = v[7] == false,
    x = tonumber(v[8]),           -- expiry deadline set on the key; -1 = none; nil = unknown
    w = clear(BW),                -- changed fields, in order
  }
  if window then
    b.bi = tonumber(v[9]) or 0    -- current window bucket index
    b.co, b.cf = tonumber(v[10]) or 0, tonumber(v[11]) or 0 -- current bucket ok / fail
    b.po, b.pf = tonumber(v[12]) or 0, tonumber(v[13]) or 0 -- previous bucket ok / fail
  end
  return b
end

-- Set field `f` of `b` to `v`, remembering it for the save when it changed.
local function set(b, f, v)
  if b[f] ~= v or (f == 'cs' and b.fresh_cs) then
    if f == 'cs' then b.fresh_cs = false end
    b[f] = v
    b.w[#b.w + 1] = f
  end
end

-- Where the key's expiry must be: -1 = none (state the memory backend would still
-- remember), else the earliest deadline that is safe. `basis` 0 = unknown (an op
-- without params, which grants nothing): a level that has yet to decay then means no
-- TTL (until an op with params sets one), anything else keeps the expiry as it is
-- (nil).
local function bneed(b, basis, mcd)
  if b.st ~= CLOSED or b.s > 0 then return -1 end
  if basis <= 0 then
    if b.k > 0 then return -1 end
    return nil
  end
  local decayed = now
  if b.k > 0 then decayed = max(now, b.cs + b.k * mcd) end
  return decayed + basis
end

-- Persist the changed fields and move the expiry if it must move. A hash that does
-- not exist and has nothing to write stays absent (absent = fresh, epoch 0).
local function bsave(b, basis, mcd)
  if not b.exists and #b.w == 0 then return end
  local need = bneed(b, basis, mcd)
  local expire
  if need == nil then
    expire = nil
  elseif need < 0 then
    if b.x ~= -1 then set(b, 'x', -1); expire = 'persist' end
  elseif b.x == nil or b.x == -1 or b.x < need then
    set(b, 'x', need + basis); expire = 'at'
  end
  local n = #b.w
  if n > 0 then
    local args = HARGS
    for i = 1, n do
      local f = b.w[i]
      args[2 * i - 1] = f
      args[2 * i] = fmt(b[f])
    end
    redis.call('HSET', K[1], unpack(args, 1, 2 * n))
  end
  if expire == 'persist' then
    redis.call('PERSIST', K[1])
  elseif expire == 'at' then
    redis.call('PEXPIREAT', K[1], fmt(ceil(b.x / 1000)))
  end
end

local function bra(b)
  if b.st == OPEN and b.u > now then return b.u - now end
  return 0
end

-- The scope's breaker params (slots 2..10), each parsed on first use in a call (an
-- admission of a CLOSED source reads two of the nine).
local PSLOT = { fth = 2, frate = 3, minc = 4, win = 5, cd = 6, mcd = 7, pttl = 8, kmax = 9,
  basis = 10 }
local PMETA = { __index = function(t, name)
  local v = arg(PSLOT[name], 0)
  rawset(t, name, v)
  return v
end }
local P
local function params()
  return P
end

-- Level bound and decay: k ≤ k_max, then each whole max_cooldown CLOSED takes one off.
local function decay(b)
  if b.k == 0 then return end
  local p = params()
  if b.k > p.kmax then set(b, 'k', p.kmax) end
  if b.st ~= CLOSED or b.k == 0 or p.mcd <= 0 then return end
  local n = floor((now - b.cs) / p.mcd)
  if n > 0 then
    set(b, 'k', max(0, b.k - n))
    set(b, 'cs', b.cs + n * p.mcd)
  end
end

-- Move the window so the current bucket contains now.
local function roll(b)
  local idx = floor(now / max(params().win / 2, 1))
  if idx == b.bi then return end
  if idx == b.bi + 1 then
    set(b, 'po', b.co); set(b, 'pf', b.cf)
  else
    set(b, 'po', 0); set(b, 'pf', 0)
  end
  set(b, 'co', 0); set(b, 'cf', 0); set(b, 'bi', idx)
end

local function clear_counts(b)
  set(b, 's', 0)
  if b.bi then set(b, 'co', 0); set(b, 'cf', 0); set(b, 'po', 0); set(b, 'pf', 0) end
end

local function bopen(b, grow)
  local p = params()
  if grow then set(b, 'k', min(b.k + 1, p.kmax)) end
  local d = min(p.cd * (2 ^ min(b.k, 64)), p.mcd)
  set(b, 'st', OPEN); set(b, 'e', b.e + 1); set(b, 'u', now + d); set(b, 'l', -1)
  clear_counts(b)
end

local function bclose(b)
  set(b, 'st', CLOSED); set(b, 'e', b.e + 1); set(b, 'l', -1); set(b, 'cs', now)
  clear_counts(b)
end

-- Returns granted, is_probe.
local function try_enter(b)
  decay(b)
  if b.st == CLOSED then return true, false end
  if b.st == OPEN and now < b.u then return false, false end
  if b.st == HALF and b.l >= 0 and now < b.l then return false, false end
  set(b, 'st', HALF); set(b, 'e', b.e + 1); set(b, 'l', now + params().pttl)
  return true, true
end

local function record_success(b, count)
  decay(b)
  if arg(14, 0) ~= b.e then return false end
  if b.st == CLOSED then
    set(b, 's', 0)
    if count then
      roll(b)
      set(b, 'co', b.co + 1)
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
  if arg(14, 0) ~= b.e then return false end
  if b.st == CLOSED then
    local p = params()
    set(b, 's', b.s + 1)
    roll(b)
    set(b, 'cf', b.cf + 1)
    local ok, fail = b.co + b.po, b.cf + b.pf
    local samples = ok + fail
    local enough = samples >= p.minc
    local rate = 0
    if samples > 0 then rate = fail / samples end
    if enough and rate >= p.frate then
      bopen(b, true)
      b.trip = 2 -- failure rate (a plain field: not saved, only replied)
    elseif b.s >= p.fth and not (enough and rate < p.frate) then
      bopen(b, false)
      b.trip = 1 -- streak
    end
    return true
  elseif b.st == HALF then
    bopen(b, true)
    return true
  end
  return false
end

local function release_probe(b)
  if arg(14, 0) ~= b.e or b.st ~= HALF then return false end
  set(b, 'l', -1)
  return true
end

local function neutral(b)
  if arg(16, 0) == 1 then return release_probe(b) end
  return arg(14, 0) == b.e
end

local function applied_reply(b, ok)
  local a = 0
  if ok then a = 1 end
  return { a, b.st, b.e, bra(b), b.k, b.trip or 0 }
end

-- §18 learn_rate (§10): a reply of admit or report on a source that learns ends with the
-- factor in force (ppm, element 7; element 6 filled with -1 where the reply has none),
-- so a host knows it when Redis goes away and its local fallback starts from it, and
-- the last cut's date (µs, element 8; 0 = none), which an admitted call's report sends
-- back (slot 56).
local function with_factor(q, r)
  if q and q.rf then
    if r[6] == nil then r[6] = -1 end
    r[7] = q.rf
    r[8] = q.lat or 0
  end
  return r
end

local function publish(what)
  redis.call('PUBLISH', A[22], what .. ' ' .. A[23])
end

-- Save after an op with params.
local function bsave_p(b)
  local p = params()
  bsave(b, p.basis, p.mcd)
end

-- ------------------------------------------------------------------ quota

-- The buckets, in quota.rs BUCKETS order: field, limit slot, what a reservation
-- takes from it (t total tokens, r one request, i input, o output tokens), refill
-- period, and where HMGET returns it. tt and rt are always read (§7's two); the §7a
-- ones only when some of them is configured.
-- Scratch arrays of the one quota a call loads (module locals reused across calls,
-- so a call allocates no table for them; qload resets what it does not overwrite).
local QCAPS, QLIM, QRAW, QON, QAMT = {}, {}, {}, {}, {}

local QB = {
  { f = 'tt', lim = 11, n = 't', per = MIN, at = 1 },
  { f = 'rt', lim = 12, n = 'r', per = MIN, at = 2 },
  { f = 'it', lim = 28, n = 'i', per = MIN, at = 5 },
  { f = 'ot', lim = 29, n = 'o', per = MIN, at = 6 },
  { f = 'td', lim = 30, n = 't', per = DAY, at = 7 },
  { f = 'rd', lim = 31, n = 'r', per = DAY, at = 8 },
}

-- A bucket is stored as the µs at which it is full again (`full_at`); absent or past
-- = full. Its deficit at now is full_at − now: the refill time of what was taken.
-- Per bucket i: q.lim[i] its limit (what refills per period; -1 = disabled) and
-- q.caps[i] what a full one holds (§7a: a per-minute bucket limit × burst / 1 min,
-- at least 1; a per-day one its limit).
-- §18 (a source with slot 37 set): the in-flight count fields of buckets 1..4, and
-- whether bucket i's limit is "auto" (slot 38).
local FL = { 'ft', 'fr', 'fi', 'fo' }
local function is_auto(i)
  return i <= 4 and floor(arg(38, 0) / 2 ^ (i - 1)) % 2 == 1
end

-- Queue field `f` = `x` for qsave.
local function qput(q, f, x)
  q[f] = x
  q.w[#q.w + 1] = f
end

-- §18 learn_rate: the factor at now from field 'ar' (`text`; absent = whole): q.rf, and
-- the last cut's q.lat. A cut dated ahead of this clock (a failover to a server whose
-- clock is behind) is re-dated now and written so: recovery and the next cut run from
-- here, not from when the clock catches up. Every product stays below 2^53
-- (floor(d × r / 1e6) computed in two parts).
local function qlearn(q, learn, text)
  local ppm, at = LWHOLE, nil
  if text then
    local p, a = string.match(text, '^(%d+) (%d+)$')
    if p then ppm, at = tonumber(p), tonumber(a) end
  end
  local f = ppm
  if at then
    if at > now then
      at = now
      qput(q, 'ar', format('%d %d', ppm, at))
    end
    local d = now - at
    local up = floor(d / 1000000) * learn + floor((d % 1000000) * learn / 1000000)
    f = min(LWHOLE, ppm + up)
  end
  q.rf, q.lat, q.learn = f, at, learn
  -- Until the factor is whole again the hash must not expire (qsave).
  if at and f < LWHOLE then q.lwhole = at + ceil((LWHOLE - ppm) * 1000000 / learn) end
end

-- A per-minute limit `l` scaled by the factor `f` (ppm; at least 1; -1 stays -1;
-- learn.rs `scale`).
local function lscale(l, f)
  if f == nil or f >= LWHOLE or l <= 0 then return l end
  local a = floor(l / 1000000)
  return max(1, a * f + floor((l - a * 1000000) * f / 1000000))
end

-- A per-minute limit `l` scaled by the learned factor in force.
local function qscale(q, l)
  return lscale(l, q.rf)
end

-- Bucket i's limit and capacity from its limit `l` as configured or learned (-1 =
-- disabled; kept in q.rl[i] for a per-minute one, which runs at `l` scaled by the
-- learned factor), a per-minute one holding limit x burst / 1 min (§7a).
local function qshape(q, i, l)
  local b = QB[i]
  if i <= 4 then
    q.rl[i] = l
    l = qscale(q, l)
  end
  local c = l
  local burst = q.burst
  if l > 0 and b.per == MIN and burst > 0 and burst < MIN then
    c = max(1, floor(l * burst / MIN))
  end
  q.lim[i], q.caps[i] = l, c
end

-- §18 learn_rate, a 429 report (slot 54), after the report's own settlement (its
-- refund gives back what its reservation took, at the factor of its admission, slot 55)
-- and before its block: unless a block is in force (the ledger knew), the last cut is
-- under LCUT_EVERY old, or a cut was made since the call's admission (slot 56), the
-- factor is cut ×0.7 (at least LFLOOR), dated now, and the per-minute buckets run at
-- the cut limits from here on.
local function qcut(q)
  if q.learn == nil or arg(54, 0) ~= 1 or q.bu > now then return end
  if q.lat ~= nil then
    if now - q.lat < LCUT_EVERY then return end
    local seen = arg(56, -1)
    if seen >= 0 and seen ~= q.lat then return end
  end
  local ppm = max(LFLOOR, floor(q.rf * 7 / 10))
  q.rf, q.lat = ppm, now
  qput(q, 'ar', format('%d %d', ppm, now))
  q.lwhole = now + ceil((LWHOLE - ppm) * 1000000 / q.learn)
  for i = 1, 4 do
    if q.rl[i] > 0 then qshape(q, i, q.rl[i]) end
  end
end

local function qload()
  -- Slots 28..31 (the §7a buckets) are sent only when some is set (trailing neutral
  -- slots are not sent): without them, buckets 3..6 are disabled (-1).
  local top = 2
  if #A >= 28 then top = #QB end
  local obs = arg(37, 0) == 1
  local extra = top > 2 and (obs or arg(28, -1) > 0 or arg(29, -1) > 0 or arg(30, -1) > 0
    or arg(31, -1) > 0)
  local v
  -- §18 learn_rate: 'ar' is read last, at index ai.
  local learn, ai = arg(53, 0), nil
  if obs then
    local host = A[52] or ''
    v = redis.call('HMGET', K[2], 'tt', 'rt', 'bu', 'x', 'it', 'ot', 'td', 'rd',
      'ft', 'fr', 'fi', 'fo', 'oa', 'l:tt', 'l:rt', 'l:it', 'l:ot', 'h:' .. host, 'ar')
    ai = 19
  elseif learn > 0 then
    v = redis.call('HMGET', K[2], 'tt', 'rt', 'bu', 'x', 'it', 'ot', 'td', 'rd', 'ar')
    ai = 9
  elseif extra then
    v = redis.call('HMGET', K[2], 'tt', 'rt', 'bu', 'x', 'it', 'ot', 'td', 'rd')
  else
    v = redis.call('HMGET', K[2], 'tt', 'rt', 'bu', 'x')
  end
  -- on: the enabled buckets' indices; amt[i]: bucket i's share of the reservation
  -- (slots 13, 32, 33), parsed once.
  local q = { bu = tonumber(v[3]) or 0, x = tonumber(v[4]), w = clear(QW), caps = QCAPS,
    lim = QLIM, rl = QRAW, on = clear(QON), amt = QAMT, burst = arg(27, 0) }
  local tok, tin, tout = arg(13, 0), 0, 0
  if top > 2 then tin, tout = arg(32, 0), arg(33, 0) end
  if learn > 0 then qlearn(q, learn, v[ai]) end
  if obs then
    q.obs, q.oa, q.fl, q.raw = true, tonumber(v[13]), {}, v
    for i = 1, 4 do q.fl[i] = tonumber(v[8 + i]) or 0 end
    -- This host's share of the counts: 'h:<host>' = "t r i o since" (slot 52).
    if (A[52] or '') ~= '' then
      q.host, q.hf = 'h:' .. A[52], { 0, 0, 0, 0, now }
      if v[18] then
        local i = 0
        for x in string.gmatch(v[18], '%S+') do
          i = i + 1
          q.hf[i] = tonumber(x) or 0
        end
      end
    end
  end
  for i = 1, #QB do
    local b = QB[i]
    local l = -1
    if i <= top then l = arg(b.lim, -1) end
    if obs and is_auto(i) then
      l = tonumber(v[13 + i]) or -1
      if l <= 0 then q.unlearned = true else q.learned = true end
    end
    qshape(q, i, l)
    if l > 0 then
      q[b.f] = max(tonumber(v[b.at]) or now, now)
      q.on[#q.on + 1] = i
      local n = b.n
      if n == 't' then
        q.amt[i] = tok
      elseif n == 'r' then
        q.amt[i] = 1
      elseif n == 'i' then
        q.amt[i] = tin
      else
        q.amt[i] = tout
      end
    end
  end
  return q
end

-- Refill time of `n` in bucket `i` (µs, rounded up).
local function refill(q, i, n)
  return ceil(n * QB[i].per / q.lim[i])
end

-- µs until the reservation fits (every bucket holds its share, a share larger than
-- the bucket needing a full one) and the 429 block is over; 0 = now. §7a: the
-- longest wait over all the buckets.
local function qwait(q)
  local w = max(q.bu - now, 0)
  local on = q.on
  for k = 1, #on do
    local i = on[k]
    local cap = q.caps[i]
    local need = min(q.amt[i], cap)
    local room = refill(q, i, cap - need)
    w = max(w, q[QB[i].f] - now - room)
  end
  return w
end

-- §18 learn_rate: the limit at which a settlement's credits on bucket i convert to
-- refill time: the per-minute limit scaled by the factor the reservation was admitted
-- at (slot 55, a report's), not the one in force now; bucket i's limit on a source
-- that does not learn, and for the settle op (which settles at the factor in force).
local function qconv(q, i)
  if q.rf == nil or i > 4 or q.rl[i] <= 0 or A[1] ~= 'report' then return q.lim[i] end
  return lscale(q.rl[i], arg(55, LWHOLE))
end

-- Add `n` to bucket `i` (negative: take, at most `most` µs of refill time when
-- given), converted at the limit `cl` (q.lim[i] when not given), keeping −limit ≤
-- level ≤ capacity.
local function qadd(q, i, n, most, cl)
  local cap = q.caps[i]
  if cap <= 0 or n == 0 then return end
  cl = cl or q.lim[i]
  local f = QB[i].f
  local full_at
  if n < 0 then
    local r = ceil(-n * QB[i].per / cl)
    if most and r > most then r = most end
    full_at = min(q[f] + r, now + refill(q, i, cap + q.lim[i]))
  else
    full_at = max(q[f] - floor(n * QB[i].per / cl), now)
  end
  if full_at ~= q[f] then
    q[f] = full_at
    q.w[#q.w + 1] = f
  end
end

local function qdebit(q)
  local on = q.on
  for k = 1, #on do
    local i = on[k]
    qadd(q, i, -q.amt[i])
  end
end

-- Give back the settlement's credits (computed by the caller): slots 18 (tokens),
-- 19 (requests), 34 (input), 35 (output); an extra debit takes at most slot 36's
-- refill time from each bucket (§12: one report's debt); §18 learn_rate: converted at
-- the limits of the reservation's admission (qconv).
local CREDIT = { t = 18, r = 19, i = 34, o = 35 }
local function qcredit(q)
  local on = q.on
  local most = arg(36, 600000000)
  for k = 1, #on do
    local i = on[k]
    qadd(q, i, arg(CREDIT[QB[i].n], 0), most, qconv(q, i))
  end
end

local function qblock(q, d)
  local nb = max(q.bu, now + min(d, QMAX_BLOCK))
  if nb ~= q.bu then
    q.bu = nb
    q.w[#q.w + 1] = 'bu'
  end
end

-- §18: count the reservation (slots 13, 32, 33 and one request) in (+1) or out (-1)
-- of the in-flight fields, never below 0. With a host (slot 52) the host's own counts
-- ('h:<host>') move too, and a release takes out at most what that host still counts:
-- once its heartbeat expired and its counts were dropped (hosts.rs), a late report
-- of its calls takes nothing more from the totals.
local function qtrack(q, sign)
  if not q.obs then return end
  local amt = { arg(13, 0), 1, arg(32, 0), arg(33, 0) }
  local hf, moved = q.hf, false
  for i = 1, 4 do
    local d = amt[i]
    if hf then
      if sign < 0 then d = min(d, hf[i]) end
      hf[i] = hf[i] + sign * d
      moved = moved or d ~= 0
    end
    local n = max(0, q.fl[i] + sign * d)
    if n ~= q.fl[i] then
      q.fl[i] = n
      q[FL[i]] = n
      q.w[#q.w + 1] = FL[i]
    end
  end
  -- Written by qsave's one HSET (text, not '%d'): the four counts and the µs the
  -- share was first written (a reconcile spares a share younger than a heartbeat's
  -- TTL: its host may not have beaten yet); a live host's share at zero stays until
  -- the host is gone and hosts.rs drops it.
  if moved then
    qput(q, q.host, format('%d %d %d %d %d', hf[1], hf[2], hf[3], hf[4], hf[5]))
  end
end

-- §18: apply the report's observation (slots 39..51), after its settlement. Ignored
-- when dated (now − age) before the last one applied ('oa'). Per dimension: an "auto"
-- bucket learns the limit; a configured bucket's level becomes min(level, remaining −
-- in flight) as of the observation (full again refill(capacity − that) after it,
-- never past the debt floor): it only ever lowers; 'c:<bucket>' adds up what the
-- corrections took; remaining 0 with a reset blocks the quota until then (the engine
-- capped it at max_rate_limit_block).
local function qobserve(q)
  local age = arg(39, -1)
  if not q.obs or age < 0 then return end
  local at = now - age
  if q.oa ~= nil and at < q.oa then return end
  q.oa = at
  q.w[#q.w + 1] = 'oa'
  local blk = 0
  for i = 1, 4 do
    local f = QB[i].f
    local lim, rem, rst = arg(37 + 3 * i, -1), arg(38 + 3 * i, -1), arg(39 + 3 * i, -1)
    -- An "auto" limit is compared as the provider said it (not as scaled by the
    -- learned factor, under which 1000 and 1001 may scale alike).
    if lim > 0 and is_auto(i) and lim ~= q.rl[i] then
      qput(q, 'l:' .. f, lim)
      q.learned = true
      if q.lim[i] <= 0 then q[f] = max(tonumber(q.raw[QB[i].at]) or now, now) end
      qshape(q, i, lim)
    end
    if rem >= 0 then
      qput(q, 'o:' .. f, rem)
      qput(q, 'm:' .. f, lim)
      qput(q, 'a:' .. f, at)
      if rem == 0 and rst >= 0 then blk = max(blk, at + rst - now) end
      local cap = q.caps[i]
      local target = rem - q.fl[i]
      if cap > 0 and target < cap then
        local full_at = min(at + refill(q, i, cap - target), now + refill(q, i, cap + q.lim[i]))
        if full_at > q[f] then
          local removed = floor((full_at - q[f]) * q.lim[i] / QB[i].per)
          if removed > 0 then redis.call('HINCRBY', K[2], 'c:' .. f, fmt(removed)) end
          q[f] = full_at
          q.w[#q.w + 1] = f
        end
      end
    end
  end
  if blk > 0 then qblock(q, blk) end
end

-- Write the changed fields; move the expiry past the moment the hash reads as full
-- and unblocked, when it must move.
local function qsave(q)
  local n = #q.w
  if n == 0 then return end
  local need = max(q.bu, now)
  local on = q.on
  for k = 1, #on do need = max(need, q[QB[on[k]].f]) end
  if q.lwhole then need = max(need, q.lwhole) end
  local slack = QSLACK
  if q.learned then
    need = max(need, now + QKEEP)
    slack = QKEEP
  end
  local expire = false
  if q.x == nil or q.x < need then
    q.x = need + slack
    q.w[n + 1] = 'x'
    n = n + 1
    expire = true
  end
  local args = HARGS
  for i = 1, n do
    local f = q.w[i]
    args[2 * i - 1] = f
    local x = q[f]
    if type(x) ~= 'string' then x = fmt(x) end
    args[2 * i] = x
  end
  redis.call('HSET', K[2], unpack(args, 1, 2 * n))
  if expire then redis.call('PEXPIREAT', K[2], fmt(ceil(q.x / 1000))) end
end

-- A bucket's level at now (a fraction), as text for status; '' when disabled.
local function qlevel(q, i)
  local cap = q.caps[i]
  if cap < 0 then return '' end
  if cap == 0 then return '0' end
  return format('%.17g', cap - (q[QB[i].f] - now) * q.lim[i] / QB[i].per)
end

-- ------------------------------------------------------------------ priority classes
-- §15 reserves and limits (gate/classes.rs holds the same rules). Each class's use of
-- each enabled bucket is a field '<bucket field>:<class>' ('tt:batch') holding the µs at
-- which its share would have drained, like the bucket's own full_at; usage at now is
-- drain_at − now, in the bucket's refill-time unit, and a share s (ppm) of a bucket is s
-- millionths of a full bucket's refill time (a minute for a §7 bucket, `burst` for a
-- §7a one, a day for a per-day one). Scopes without classes never reach this block.

-- The scope's classes from slot 26, and the index of the call's (slot 24) among them.
local function cparse()
  local me = A[24]
  if me == nil or me == '' then return nil end
  local cl, mi = {}, nil
  for n, r, l in string.gmatch(A[26] or '', '(%S+) (%d+) (%d+)') do
    cl[#cl + 1] = { n = n, r = tonumber(r), l = tonumber(l) }
    if n == me then mi = #cl end
  end
  if mi == nil then return nil end
  return cl, mi
end

-- Read every class's drain_at of every enabled bucket (one HMGET).
local function cload(q, cl)
  local f = {}
  for i = 1, #QB do
    if q.caps[i] > 0 then
      for j = 1, #cl do f[#f + 1] = QB[i].f .. ':' .. cl[j].n end
    end
  end
  if #f == 0 then return end
  local v = redis.call('HMGET', K[2], unpack(f))
  local k = 0
  for i = 1, #QB do
    if q.caps[i] > 0 then
      for j = 1, #cl do
        k = k + 1
        cl[j][i] = max(tonumber(v[k]) or now, now)
      end
    end
  end
end

-- `ppm` millionths of bucket i's full refill time (µs).
local function cshare(q, i, ppm)
  return ppm * refill(q, i, q.caps[i]) / 1000000
end

-- µs until class `mi` may take its share of the reservation (0 = now) and the rule that
-- holds it: 1 = its limit, 2 = other classes' unused reserves on a saturated bucket.
local function cwait(q, cl, mi)
  local me = cl[mi]
  local w, why = 0, 0
  for i = 1, #QB do
    local cap = q.caps[i]
    if cap > 0 then
      local whole = refill(q, i, cap)
      local sat = cshare(q, i, arg(25, 0))
      local a = refill(q, i, q.amt[i])
      local used = me[i] - now
      local lim = cshare(q, i, me.l)
      if me.l < 1000000 and used > 0 and used + a > lim then
        local x = used + a - lim
        if x > w then w, why = x, 1 end
      end
      local d = q[QB[i].f] - now
      if d + a > sat then
        local held, reserved = 0, 0
        for j = 1, #cl do
          local o = cl[j]
          if j ~= mi and o.r > 0 then
            local r = cshare(q, i, o.r)
            reserved = reserved + r
            held = held + max(0, r - (o[i] - now))
          end
        end
        if held > 0 and whole - d - a < held then
          local x = max(min(d + a - sat, d + a + reserved - whole), 1)
          if x > w then w, why = x, 2 end
        end
      end
    end
  end
  return ceil(w), why
end

-- Move class `name`'s drain_at of bucket `i` by `n` (negative: take), converted at
-- the limit `cl` (q.lim[i] when not given), within [now, the bucket's debt floor],
-- queued for qsave like a bucket field.
local function cadd(q, name, i, cur, n, cl)
  local cap = q.caps[i]
  if cap <= 0 or n == 0 then return end
  cl = cl or q.lim[i]
  local v
  if n < 0 then
    v = min(cur + ceil(-n * QB[i].per / cl), now + refill(q, i, cap + q.lim[i]))
  else
    v = max(cur - floor(n * QB[i].per / cl), now)
  end
  if v ~= cur then
    local f = QB[i].f .. ':' .. name
    q[f] = v
    q.w[#q.w + 1] = f
  end
end

-- A granted class's usage: its share of the reservation in every bucket.
local function ctake(q, me)
  for i = 1, #QB do
    if q.caps[i] > 0 then cadd(q, me.n, i, me[i], -q.amt[i]) end
  end
end

-- A settlement's credits (slots 18, 19, 34, 35) on the class's usage (report).
local function csettle(q, name)
  local f, at = {}, {}
  for i = 1, #QB do
    if q.caps[i] > 0 and arg(CREDIT[QB[i].n], 0) ~= 0 then
      f[#f + 1] = QB[i].f .. ':' .. name
      at[#at + 1] = i
    end
  end
  if #f == 0 then return end
  local v = redis.call('HMGET', K[2], unpack(f))
  for k = 1, #at do
    local i = at[k]
    cadd(q, name, i, max(tonumber(v[k]) or now, now), arg(CREDIT[QB[i].n], 0), qconv(q, i))
  end
end

-- ------------------------------------------------------------------ tenants (§19)
-- A tenant's ledger in a scope (gate/tenant.rs holds the same rules): up to four
-- buckets stored like a source's (full_at µs in fields tt, rt, td, rd; QB's indices 1,
-- 2, 5, 6 so the quota functions above serve them), and up to two dollar budgets that
-- never refill: spent in the current UTC day (di: day number, ds: n$) and month (mi:
-- months since 1970-01, ms), each kept only while that budget is set. 'f' counts the
-- reservations not yet settled (calls in flight): never read for admission, so a lost
-- report costs nothing but the count. The hash expires once every bucket is full and
-- its budget windows are over (field x, as qsave's). TK is the ledger's key.

local TK
local TQB = { 1, 2, 5, 6 } -- the tenant's buckets, as QB indices; T[k] is QB[TQB[k]]'s limit
local TCODE = { [1] = 1, [2] = 2, [5] = 3, [6] = 4 } -- refusal codes: tpm rpm tpd rpd
-- Scratch tables reused across calls (a call allocates none of them): the tenant's
-- slots, the one ledger a call loads and its parts.
local T, TL, TW, TCAPS, TLIMS, TON, TAMT = {}, {}, {}, {}, {}, {}, {}
local TN = 11 -- the tenant's slots: the last TN ARGV entries of a call that has them

-- Move the tenant's slots (the last TN ARGV entries, every one an integer) into T, as
-- numbers (by arithmetic coercion: half a tonumber's cost here).
local function tsplit()
  local n = #A
  for k = 1, TN do
    local j = n - TN + k
    T[k] = A[j] + 0
    A[j] = nil
  end
end

-- Months since 1970-01 of day number d (Hinnant's civil_from_days).
local function month_of(d)
  local z = d + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return (y - 1970) * 12 + m - 1
end

-- µs at which month `mo` (months since 1970-01) ends (days_from_civil of the next).
local function month_end(mo)
  local n = mo + 1
  local y, m = 1970 + floor(n / 12), n % 12 + 1
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + floor((153 * mp + 2) / 5)
  return (era * 146097 + doe - 719468) * DAY
end

-- The ledger (TL, reset), shaped like a quota for the quota functions above.
local function tload()
  local v = redis.call('HMGET', TK, 'tt', 'rt', 'td', 'rd', 'di', 'ds', 'mi', 'ms', 'f', 'x')
  local t = TL
  t.bu, t.w, t.caps, t.lim, t.on, t.amt = 0, clear(TW), TCAPS, TLIMS, clear(TON), TAMT
  -- Every field holds an integer the script wrote ('%d'); an absent one reads false.
  t.x, t.f = v[10] and v[10] + 0 or nil, v[9] and v[9] + 0 or 0
  t.di, t.ds = v[5] and v[5] + 0 or -1, v[6] and v[6] + 0 or 0
  t.mi, t.ms = v[7] and v[7] + 0 or -1, v[8] and v[8] + 0 or 0
  local tok = arg(13, 0)
  local on = t.on
  for k = 1, 4 do
    local i = TQB[k]
    local l = T[k]
    TLIMS[i], TCAPS[i] = l, l
    if l > 0 then
      local full = v[k] and v[k] + 0 or now
      if full < now then full = now end
      t[QB[i].f] = full
      on[#on + 1] = i
      if k == 1 or k == 3 then TAMT[i] = tok else TAMT[i] = 1 end
    end
  end
  return t
end

-- Refusal of the reservation (slot 13 tokens, one request, T[7] n$): its code (1..4
-- a bucket, 5 usd_per_day, 6 usd_per_month; 0 = it fits) and µs until it certainly fits
-- (a budget: the end of its window; a bucket: its refill, as qwait). A budget refuses
-- when spent + cost passes it.
local function tcheck(t)
  local cost = T[7]
  if cost > 0 then
    local day = floor(now / DAY)
    local bm = T[6]
    if bm >= 0 then
      local mo = month_of(day)
      local spent = 0
      if t.mi == mo then spent = t.ms end
      if spent + cost > bm then return 6, max(month_end(mo) - now, 1) end
    end
    local bd = T[5]
    if bd >= 0 then
      local spent = 0
      if t.di == day then spent = t.ds end
      if spent + cost > bd then return 5, max((day + 1) * DAY - now, 1) end
    end
  end
  local w, code = 0, 0
  local on = t.on
  for k = 1, #on do
    local i = on[k]
    local cap = TCAPS[i]
    local need = min(TAMT[i], cap)
    local x = t[QB[i].f] - now - refill(t, i, cap - need)
    if x > w then w, code = x, TCODE[i] end
  end
  return code, w
end

-- Queue field `f` = `x` for tsave.
local function tput(t, f, x)
  t[f] = x
  t.w[#t.w + 1] = f
end

-- Take the reservation (after tcheck said 0): the buckets, the cost in every budget's
-- window (started afresh when a newer one), one more in flight. Returns the day number.
local function ttake(t)
  qdebit(t)
  local day = floor(now / DAY)
  local cost = T[7]
  if cost > 0 then
    if T[5] >= 0 then
      if t.di ~= day then tput(t, 'di', day); t.ds = 0 end
      tput(t, 'ds', t.ds + cost)
    end
    if T[6] >= 0 then
      local mo = month_of(day)
      if t.mi ~= mo then tput(t, 'mi', mo); t.ms = 0 end
      tput(t, 'ms', t.ms + cost)
    end
  end
  tput(t, 'f', t.f + 1)
  return day
end

-- Write the changed fields; move the expiry past the moment the ledger reads as fresh
-- (every bucket full, every budget window with spend over), when it must move.
local function tsave(t)
  local n = #t.w
  if n == 0 then return end
  local need = now
  local on = t.on
  for k = 1, #on do need = max(need, t[QB[on[k]].f]) end
  if t.ds > 0 and t.di >= 0 then need = max(need, (t.di + 1) * DAY) end
  if t.ms > 0 and t.mi >= 0 then need = max(need, month_end(t.mi)) end
  local expire = false
  if t.x == nil or t.x < need then
    t.x = need + QSLACK
    t.w[n + 1] = 'x'
    n = n + 1
    expire = true
  end
  local args = HARGS
  for i = 1, n do
    local f = t.w[i]
    args[2 * i - 1] = f
    args[2 * i] = fmt(t[f])
  end
  redis.call('HSET', TK, unpack(args, 1, 2 * n))
  if expire then redis.call('PEXPIREAT', TK, fmt(ceil(t.x / 1000))) end
end

-- Settle a reservation charged to day T[11]: the token credits (T[8], T[9]; an extra
-- debit at most slot 36's refill time), the cost credit (T[10]) on each window only
-- while it is the one the reservation was charged to, one less in flight. A
-- settlement with no credit changes the in-flight count alone: one HINCRBY, without
-- loading the ledger (a count below 0 — the ledger expired under the call — is
-- dropped, and with it a hash the HINCRBY made).
local function tsettle()
  local tc, rc, c = T[8], T[9], T[10]
  if tc == 0 and rc == 0 and c == 0 then
    if redis.call('HINCRBY', TK, 'f', -1) < 0 then redis.call('HDEL', TK, 'f') end
    return
  end
  local t = tload()
  local most = arg(36, 600000000)
  local on = t.on
  for k = 1, #on do
    local i = on[k]
    local n
    if QB[i].n == 't' then n = tc else n = rc end
    qadd(t, i, n, most)
  end
  local day = T[11]
  if c ~= 0 and day >= 0 then
    if t.di == day then tput(t, 'ds', max(0, t.ds - c)) end
    if t.mi >= 0 and t.mi == month_of(day) then tput(t, 'ms', max(0, t.ms - c)) end
  end
  if t.f > 0 then tput(t, 'f', t.f - 1) end
  tsave(t)
end

-- A bucket's level at now as text ('' when the tenant has no such limit).
local function tlevel(t, i)
  if t.caps[i] <= 0 then return '' end
  return format('%.17g', t.caps[i] - (t[QB[i].f] - now) * t.lim[i] / QB[i].per)
end

-- ------------------------------------------------------------------ dispatch

local function gate(keys, args)
  if max == nil then
    max, min, floor, ceil = math.max, math.min, math.floor, math.ceil
    tonumber, format, unpack = _G.tonumber, string.format, _G.unpack
  end
  K, A, P = keys, args, setmetatable({}, PMETA)
  TK = K[#K]
  -- §19: the tenant's slots ride last, on a call with its ledger (not two keys).
  if #K ~= 2 then tsplit() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local op = A[1]

  if op == 'admit' then
    -- The tenant's ledger (§19), then gate 3, then gate 4; any refusal takes nothing
    -- (both ledgers, or neither).
    local t
    if #K == 3 then
      t = tload()
      local code, tw = tcheck(t)
      if code > 0 then return { 4, code, 0, 0, tw } end
    end
    local q = qload()
    local wait = qwait(q)
    -- A refusal takes nothing, but writes what qload queued (§18: a learned cut dated
    -- ahead, re-dated now; nothing else, and no write at all on most calls), so a
    -- refused call does not re-date it afresh and the factor recovers meanwhile.
    -- §15: a class held back by its limit or others' reserves takes nothing either.
    local cl, mi = cparse()
    if cl then
      cload(q, cl)
      local cw, why = cwait(q, cl, mi)
      if cw > 0 then
        qsave(q)
        return with_factor(q, { 3, why, 0, 0, max(cw, wait) })
      end
    end
    -- §18: an "auto" bucket not learned yet admits one call at a time.
    if q.unlearned and q.fl[2] > 0 then wait = max(wait, 1000000) end
    if wait > 0 then
      qsave(q)
      return with_factor(q, { 1, 0, 0, 0, wait })
    end
    local b = bload(false)
    local g, p = try_enter(b)
    bsave_p(b)
    if not g then
      qsave(q)
      return with_factor(q, { 2, b.e, 0, b.st, bra(b) })
    end
    qdebit(q)
    qtrack(q, 1)
    if cl then ctake(q, cl[mi]) end
    qsave(q)
    local day = -1
    if t then
      day = ttake(t)
      tsave(t)
    end
    return with_factor(q, { 0, b.e, p and 1 or 0, b.st, 0, day })

  elseif op == 'report' then
    -- Settle (the caller computed the credits), then the verdict.
    local block = arg(20, -1)
    local q
    if arg(18, 0) ~= 0 or arg(19, 0) ~= 0 or block >= 0 or arg(34, 0) ~= 0
        or arg(35, 0) ~= 0 or arg(37, 0) == 1 or arg(54, 0) == 1 then
      q = qload()
      qcredit(q)
      qtrack(q, -1)
      local class = A[24]
      if class ~= nil and class ~= '' then csettle(q, class) end
      qcut(q)
      if block >= 0 then qblock(q, block) end
      qobserve(q)
      qsave(q)
    end
    if #K == 3 then tsettle() end
    local verdict = A[17]
    local b = bload(verdict ~= 'N')
    local a
    if verdict == 'S' then
      a = record_success(b, arg(15, 0) == 1)
    elseif verdict == 'F' then
      a = record_failure(b)
    else
      a = neutral(b)
    end
    bsave_p(b)
    return with_factor(q, applied_reply(b, a))

  elseif op == 'try_enter' then
    local b = bload(false)
    local g, p = try_enter(b)
    bsave_p(b)
    return { g and 1 or 0, p and 1 or 0, b.e, b.st, bra(b) }

  elseif op == 'record_success' then
    local b = bload(true)
    local a = record_success(b, arg(15, 0) == 1)
    bsave_p(b)
    return applied_reply(b, a)

  elseif op == 'record_failure' then
    local b = bload(true)
    local a = record_failure(b)
    bsave_p(b)
    return applied_reply(b, a)

  elseif op == 'release_probe' then
    local b = bload(false)
    local a = release_probe(b)
    bsave(b, 0, 0)
    return applied_reply(b, a)

  elseif op == 'neutral' then
    local b = bload(false)
    local a = neutral(b)
    bsave(b, 0, 0)
    return applied_reply(b, a)

  elseif op == 'peek' then
    local b = bload(false)
    return { b.st, b.e, bra(b) }

  elseif op == 'force_open' then
    local b = bload(false)
    set(b, 'st', OPEN); set(b, 'e', b.e + 1); set(b, 'u', now + arg(21, 0)); set(b, 'l', -1)
    bsave(b, 0, 0)
    publish('force_open')
    return applied_reply(b, true)

  elseif op == 'force_close' then
    local b = bload(true)
    bclose(b)
    bsave(b, 0, 0)
    publish('force_close')
    return applied_reply(b, true)

  elseif op == 'reset' then
    -- Everything but the epoch is forgotten; the epoch is bumped, never rewound.
    local b = bload(true)
    bclose(b)
    set(b, 'k', 0); set(b, 'u', 0); set(b, 'bi', 0)
    bsave(b, 0, 0)
    redis.call('DEL', K[2])
    publish('reset')
    return applied_reply(b, true)

  elseif op == 'reserve' then
    local q = qload()
    local wait = qwait(q)
    if q.unlearned and q.fl[2] > 0 then wait = max(wait, 1000000) end
    if wait > 0 then return { 0, wait } end
    qdebit(q)
    qtrack(q, 1)
    qsave(q)
    return { 1, 0 }

  elseif op == 'settle' then
    local q = qload()
    qcredit(q)
    qtrack(q, -1)
    qsave(q)
    return { 1 }

  elseif op == 'block' then
    local q = qload()
    qblock(q, arg(20, 0))
    qsave(q)
    return { 1 }

  elseif op == 'treserve' then
    -- §19 on a Redis Cluster: the tenant's ledger alone (KEYS[1]); the source's admit
    -- follows, and a refusal there gives this back (tsettle with every credit).
    local t = tload()
    local code, tw = tcheck(t)
    if code > 0 then return { 0, code, tw } end
    local day = ttake(t)
    tsave(t)
    return { 1, day, 0 }

  elseif op == 'tsettle' then
    tsettle()
    return { 1 }

  elseif op == 'tsnapshot' then
    -- Status: levels of tpm, rpm, tpd, rpd ('' = no such limit), spent today and this
    -- month (n$, 0 outside their windows), in flight.
    local t = tload()
    local day = floor(now / DAY)
    local ds, ms = 0, 0
    if t.di == day then ds = t.ds end
    if t.mi == month_of(day) then ms = t.ms end
    return { tlevel(t, 1), tlevel(t, 2), tlevel(t, 5), tlevel(t, 6), ds, ms, t.f }

  elseif op == 'tcal' then
    -- The calendar of T[11]'s day, for the tests that hold it to gate/tenant.rs.
    local d = T[11]
    local mo = month_of(d)
    return { mo, month_end(mo) }

  elseif op == 'snapshot' then
    -- Status reads persist nothing (decay and roll are recomputed on the next write).
    local b = bload(true)
    decay(b)
    roll(b)
    local q = qload()
    local r = { b.st, b.e, bra(b), b.k, b.co + b.po, b.cf + b.pf, b.s, qlevel(q, 1), qlevel(q, 2),
      max(q.bu - now, 0), qlevel(q, 3), qlevel(q, 4), qlevel(q, 5), qlevel(q, 6) }
    if q.obs then
      -- §18: per bucket 1..4, the last observation: remaining, limit, age (µs), what
      -- the corrections removed (-1: never observed).
      local v = redis.call('HMGET', K[2], 'o:tt', 'm:tt', 'a:tt', 'c:tt', 'o:rt', 'm:rt',
        'a:rt', 'c:rt', 'o:it', 'm:it', 'a:it', 'c:it', 'o:ot', 'm:ot', 'a:ot', 'c:ot')
      for i = 0, 3 do
        local o = tonumber(v[4 * i + 1])
        if o == nil then
          r[#r + 1], r[#r + 2], r[#r + 3], r[#r + 4] = -1, -1, -1, -1
        else
          r[#r + 1] = o
          r[#r + 1] = tonumber(v[4 * i + 2]) or -1
          r[#r + 1] = max(0, now - (tonumber(v[4 * i + 3]) or now))
          r[#r + 1] = tonumber(v[4 * i + 4]) or 0
        end
      end
    end
    return r
  end

  return redis.error_reply('polygate: unknown op ' .. tostring(op))
end

return gate(KEYS, ARGV)
