-- Helpers shared by the keyed-queue scripts (celery_fair/keys/scripts.py puts
-- this file after its header and before each script that uses it).
--
-- The header defines N, the Redis names and constants of celery_fair.keys.layout
-- (N.ACTIVE is 'fair.keys', ...), and the locals SEP (Kombu's separator between
-- a queue name and its suffixes) and DFLT (the default key weight), which each
-- script sets from its ARGV before calling anything here.
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

local function weight(base, key)
  local w = redis.call('HGET', kname(base, N.WEIGHTS_LIVE), key)
  if not w then w = redis.call('HGET', kname(base, N.WEIGHTS_CONF), key) end
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

-- Per-key limits: the live value, else the configured one, for the key or '*'.
local function limit(base, kind, key)
  local live, conf = kname(base, N.LIMITS_LIVE), kname(base, N.LIMITS_CONF)
  local v = redis.call('HGET', live, kind .. ':' .. key)
  if not v then v = redis.call('HGET', conf, kind .. ':' .. key) end
  if not v then v = redis.call('HGET', live, kind .. ':*') end
  if not v then v = redis.call('HGET', conf, kind .. ':*') end
  return tonumber(v)
end

-- The broker's clock (seconds): every worker agrees on it.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Throttling, for inspect and metrics: a key set aside by its limits (at its
-- concurrency limit or out of tokens) is timed until it goes back in line.
local function hold(base, key, now)
  if redis.call('HSETNX', kname(base, N.HELD_SINCE), key, now) == 1 then
    redis.call('HINCRBY', kname(base, N.STATE), 'held_n', 1)
  end
end

local function resume(base, key, now)
  local since = kname(base, N.HELD_SINCE)
  local t = tonumber(redis.call('HGET', since, key))
  if not t then return end
  redis.call('HDEL', since, key)
  local d = math.max(0, now - t)
  redis.call('HINCRBYFLOAT', kname(base, N.STATE), 'held_s', d)
  -- Reported by the key's next served task (telemetry's key_held).
  redis.call('HINCRBYFLOAT', kname(base, N.HELD_OWED), key, d)
  local held = kname(base, N.HELD)
  redis.call('ZINCRBY', held, d, key)
  if redis.call('ZCARD', held) > 2 * N.HELD_TOP then
    redis.call('ZREMRANGEBYRANK', held, 0, -(N.HELD_TOP + 1))
  end
end

-- A key set aside goes back in line in each level where it has messages
-- (NX: a publish may have put it back in a level already).
local function rejoin(base, key)
  for _, s in ipairs(level_suffixes(base)) do
    local lb = base .. s
    local n
    if key == N.UNKEYED then n = redis.call('LLEN', lb)
    else n = redis.call('LLEN', kname(lb, N.KEY_LIST) .. key) end
    if n > 0 then redis.call('ZADD', kname(lb, N.ACTIVE), 'NX', start_tag(lb, key), key) end
  end
end

-- A key set aside at its concurrency limit goes back in line.
local function unpark(base, key, now)
  if redis.call('SREM', kname(base, N.AT_LIMIT), key) == 1 then
    rejoin(base, key)
    resume(base, key, now)
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
  local c = limit(base, 'c', key)
  if not c or n < c then unpark(base, key, now) end
  return 1
end

-- Run-time cost: the difference between the measured run time and the
-- charge made at fetch, divided by the key's weight (DRR++ post-charge), on
-- the key's tag in the level (suffix ``level``) its task was fetched from.
local function charge(base, level, key, delta)
  local d = delta / weight(base, key)
  local lb = base .. level
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
