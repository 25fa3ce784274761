-- Helpers shared by the keyed-queue scripts (celery_fair/keys/scripts.py puts
-- this file after its header and before each script that uses it).
--
-- N.<NAME> stands for a Redis name or constant of celery_fair.keys.layout
-- (N.ACTIVE for 'fair.keys', ...): scripts.py writes each as a literal when it
-- builds the text.  The header declares the locals SEP (Kombu's separator
-- between a queue name and its suffixes) and DFLT (the default key weight),
-- which each script sets from its ARGV before calling anything here.
--
-- The order is start-time fair queuing (Goyal, Vin and Cheng, SIGCOMM 1996):
-- each key with messages waiting has a start tag; the fetch serves the lowest,
-- sets the queue's virtual time to it and moves the key's tag on by
-- charge / weight.  A key that starts waiting joins at max(virtual time, its
-- last finish tag), so it neither banks credit while idle nor skips ahead by
-- emptying and refilling.
--
-- Priority levels: a message published with a Celery priority waits in the
-- level of Kombu's list for that priority (the queue's own name for the first
-- level, then <queue><SEP><step>, as Kombu's _q_for_pri).  A level is named by
-- that suffix ('' for the first) and has its own key lists, line of keys
-- (N.ACTIVE), finish tags (N.LAST) and virtual time; weights, limits, leases
-- and the keys set aside are the queue's, shared by its levels.
local function kname(base, suffix) return base .. SEP .. suffix end

-- Two-level keys (fair_keys with a (tenant, user) pair): a first-level key
-- (the tenant) has no list of its own; in each level lb its users with
-- messages waiting are a sorted set scored by their start tags within the
-- tenant (N.USERS .. key), each with its list (the key's list name, SEP, the
-- user).  The users' virtual time is the tenant's field of N.USER_VT, their
-- recent finish tags N.USER_LAST .. key; both go when the tenant has no user
-- left in the level.  A user's weight is the key weight of "<tenant>/<user>".
local function users_name(lb, key) return kname(lb, N.USERS) .. key end
local function user_list(lb, key, user) return kname(lb, N.KEY_LIST) .. key .. SEP .. user end
local function user_weight_name(key, user) return key .. '/' .. user end

-- Whether ``key`` has messages waiting in level ``lb`` (its list, or its users').
local function waiting_in(lb, key)
  if key == N.UNKEYED then return redis.call('LLEN', lb) > 0 end
  return redis.call('EXISTS', kname(lb, N.KEY_LIST) .. key, users_name(lb, key)) > 0
end

-- Take the oldest message of ``key``'s first user in level ``lb``, outside the
-- fair order (a purge or a move back to plain lists); nil when it has none.
local function take_user_message(lb, key)
  local users = users_name(lb, key)
  while true do
    local top = redis.call('ZRANGE', users, 0, 0)
    if #top == 0 then
      redis.call('DEL', kname(lb, N.USER_LAST) .. key)
      redis.call('HDEL', kname(lb, N.USER_VT), key)
      return nil
    end
    local list = user_list(lb, key, top[1])
    local item = redis.call('RPOP', list)
    if redis.call('LLEN', list) == 0 then redis.call('ZREM', users, top[1]) end
    if item then return item end
  end
end

-- Delete ``key``'s users' lists in level ``lb``: the messages deleted.
local function drop_users(lb, key)
  local users, n = users_name(lb, key), 0
  for _, user in ipairs(redis.call('ZRANGE', users, 0, -1)) do
    local list = user_list(lb, key, user)
    n = n + redis.call('LLEN', list)
    redis.call('DEL', list)
  end
  redis.call('DEL', users, kname(lb, N.USER_LAST) .. key)
  redis.call('HDEL', kname(lb, N.USER_VT), key)
  return n
end

-- A level's order: '' first, then by Kombu's priority step (0 is served first on Redis).
local function level_rank(suffix)
  if suffix == '' then return -1 end
  return tonumber(string.sub(suffix, #SEP + 1)) or 1000
end

local function by_rank(a, b) return level_rank(a) < level_rank(b) end

-- The levels of a queue in order: the first, ``extra`` (the priority lists the
-- caller knows of) and the levels that keyed messages were published to.
local function level_suffixes(base, extra)
  local out, seen = {''}, {[''] = true}
  for _, s in ipairs(extra or {}) do
    if not seen[s] then seen[s] = true; out[#out + 1] = s end
  end
  for _, s in ipairs(redis.call('SMEMBERS', kname(base, N.LEVELS))) do
    if not seen[s] then seen[s] = true; out[#out + 1] = s end
  end
  if #out > 1 then table.sort(out, by_rank) end
  return out
end

-- Hashes found missing in this script call, by name.  Live weights and
-- limits, and the seconds owed to telemetry, are missing most of the time:
-- each is looked for once per call, not once per message a batch serves.  A
-- helper that writes such a hash in the call marks it present (``written``).
local MISSING = {}
local function missing(hash)
  local known = MISSING[hash]
  if known == nil then
    known = redis.call('EXISTS', hash) == 0
    MISSING[hash] = known
  end
  return known
end
local function written(hash) MISSING[hash] = false end

-- A field of ``hash``, nil without one (and without a read when it is missing).
local function field(hash, name)
  if missing(hash) then return nil end
  return redis.call('HGET', hash, name)
end

local function weight(base, key)
  local w = field(kname(base, N.WEIGHTS_LIVE), key)
  if not w then w = field(kname(base, N.WEIGHTS_CONF), key) end
  w = tonumber(w)
  if not w or w <= 0 then return DFLT end
  return w
end

local function vtime(base)
  return tonumber(redis.call('HGET', kname(base, N.STATE), 'vt')) or 0
end

-- A key that starts waiting joins at max(virtual time, its last finish tag).
local function start_tag(base, key)
  local vt = vtime(base)
  local last = tonumber(redis.call('ZSCORE', kname(base, N.LAST), key))
  if last and last > vt then return last end
  return vt
end

-- The same within a tenant, for its user (level lb).
local function user_start_tag(lb, key, user)
  local vt = tonumber(redis.call('HGET', kname(lb, N.USER_VT), key)) or 0
  local last = tonumber(redis.call('ZSCORE', kname(lb, N.USER_LAST) .. key, user))
  if last and last > vt then return last end
  return vt
end

-- Per-key limits of each kind asked ('c' concurrency, 'r' rate), in order: the
-- live value, else the configured one, for the key or '*'.  One HMGET per hash
-- whatever the kinds: the fetch asks for both at every limited key it serves.
local function limits(base, key, ...)
  local kinds, fields = {...}, {}
  for _, kind in ipairs(kinds) do
    fields[#fields + 1] = kind .. ':' .. key
    fields[#fields + 1] = kind .. ':*'
  end
  local live_name = kname(base, N.LIMITS_LIVE)
  local live = {}
  if not missing(live_name) then live = redis.call('HMGET', live_name, unpack(fields)) end
  local conf = redis.call('HMGET', kname(base, N.LIMITS_CONF), unpack(fields))
  local out = {}
  for i = 1, #kinds do
    local own, any = 2 * i - 1, 2 * i
    out[i] = tonumber(live[own] or conf[own] or live[any] or conf[any])
  end
  return unpack(out, 1, #kinds)
end

-- The broker's clock (seconds): every worker agrees on it.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Throttling, for inspect and metrics: a key set aside by its limits (at its
-- concurrency limit or out of tokens) is throttled, and timed until it goes
-- back in line.
local function throttle(base, key, now)
  if redis.call('HSETNX', kname(base, N.THROTTLED_SINCE), key, now) == 1 then
    redis.call('HINCRBY', kname(base, N.STATE), N.THROTTLED_COUNT, 1)
  end
end

local function unthrottle(base, key, now)
  local since = kname(base, N.THROTTLED_SINCE)
  local t = tonumber(redis.call('HGET', since, key))
  if not t then return end
  redis.call('HDEL', since, key)
  local d = math.max(0, now - t)
  redis.call('HINCRBYFLOAT', kname(base, N.STATE), N.THROTTLED_SECONDS, d)
  -- Reported by the key's next served task (telemetry's key_throttled).
  redis.call('HINCRBYFLOAT', kname(base, N.THROTTLED_OWED), key, d)
  written(kname(base, N.THROTTLED_OWED))
  local longest = kname(base, N.THROTTLED)
  redis.call('ZINCRBY', longest, d, key)
  if redis.call('ZCARD', longest) > 2 * N.THROTTLED_TOP then
    redis.call('ZREMRANGEBYRANK', longest, 0, -(N.THROTTLED_TOP + 1))
  end
end

-- A key set aside goes back in line in each level where it has messages
-- (NX: a publish may have put it back in a level already).
local function rejoin(base, key)
  for _, s in ipairs(level_suffixes(base)) do
    local lb = base .. s
    if waiting_in(lb, key) then
      redis.call('ZADD', kname(lb, N.ACTIVE), 'NX', start_tag(lb, key), key)
    end
  end
end

-- Pause (control fair_key_pause): a paused key is set aside like a key at its
-- limit, and timed (N.PAUSED_SINCE); its paused seconds are reported by its
-- next served task (N.PAUSED_OWED) and summed in the state's paused_s.
local function pause(base, key, now)
  if redis.call('SADD', kname(base, N.PAUSED), key) == 0 then return 0 end
  redis.call('HSETNX', kname(base, N.PAUSED_SINCE), key, now)
  redis.call('HINCRBY', kname(base, N.STATE), 'paused_n', 1)
  return 1
end

local function unpause(base, key, now)
  if redis.call('SREM', kname(base, N.PAUSED), key) == 0 then return 0 end
  local since = kname(base, N.PAUSED_SINCE)
  local t = tonumber(redis.call('HGET', since, key))
  redis.call('HDEL', since, key)
  if t then
    local d = math.max(0, now - t)
    redis.call('HINCRBYFLOAT', kname(base, N.STATE), 'paused_s', d)
    redis.call('HINCRBYFLOAT', kname(base, N.PAUSED_OWED), key, d)
    written(kname(base, N.PAUSED_OWED))
  end
  -- Back in line, unless its limits hold it (they put it back themselves).
  if redis.call('SISMEMBER', kname(base, N.AT_LIMIT), key) == 0
     and not redis.call('ZSCORE', kname(base, N.SLEEP), key) then
    rejoin(base, key)
  end
  return 1
end

-- A key set aside at its concurrency limit goes back in line.
local function readmit(base, key, now)
  if redis.call('SREM', kname(base, N.AT_LIMIT), key) == 1 then
    rejoin(base, key)
    unthrottle(base, key, now)
  end
end

-- A task of a limited key finished, was restored or its lease expired
-- (``id``: its message's delivery tag; ``now``: the broker's clock).
local function release(base, id, now)
  local leases = kname(base, N.LEASE_KEY)
  local key = redis.call('HGET', leases, id)
  if not key then return 0 end
  redis.call('HDEL', leases, id)
  redis.call('ZREM', kname(base, N.LEASES), id)
  local running = kname(base, N.RUNNING)
  local n = redis.call('HINCRBY', running, key, -1)
  if n <= 0 then redis.call('HDEL', running, key) end
  local c = limits(base, key, 'c')
  if not c or n < c then readmit(base, key, now) end
  return 1
end

-- Run-time cost: the difference between the measured run time and the
-- charge made at fetch, divided by the key's weight (DRR++ post-charge), on
-- the key's tag in the level (suffix ``level``) its task was fetched from.
-- With two-level keys (``user`` not empty), the user's tag within its tenant too.
local function charge(base, level, key, delta, user)
  local d = delta / weight(base, key)
  local lb = base .. level
  if user and user ~= '' then
    local users = users_name(lb, key)
    -- A tenant with no user waiting keeps no user state: nothing to correct.
    if redis.call('EXISTS', users) == 1 then
      local ud = delta / weight(base, user_weight_name(key, user))
      local ulast = kname(lb, N.USER_LAST) .. key
      if redis.call('ZSCORE', users, user) then
        redis.call('ZINCRBY', users, ud, user)
      elseif redis.call('ZSCORE', ulast, user) then
        redis.call('ZINCRBY', ulast, ud, user)
      elseif ud > 0 then
        local uvt = tonumber(redis.call('HGET', kname(lb, N.USER_VT), key)) or 0
        redis.call('ZADD', ulast, uvt + ud, user)
      end
    end
  end
  local active = kname(lb, N.ACTIVE)
  if redis.call('ZSCORE', active, key) then
    redis.call('ZINCRBY', active, d, key)
    return
  end
  local last = kname(lb, N.LAST)
  if redis.call('ZSCORE', last, key) then
    redis.call('ZINCRBY', last, d, key)
  elseif d > 0 then
    redis.call('ZADD', last, vtime(lb) + d, key)
  end
end
