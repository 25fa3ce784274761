"""The server-side scripts of keyed queues (Redis Lua).

The order is start-time fair queuing (Goyal, Vin and Cheng, SIGCOMM 1996),
the weighted fair order that Temporal's fairness keys approximate with
stride scheduling: each key with messages waiting has a start tag; the
fetch serves the key with the lowest, sets the queue's virtual time to that
tag, and moves the key's tag on by ``charge / weight``.  A key that starts
waiting joins at ``max(virtual time, its last finish tag)``, so it neither
banks credit while idle nor skips ahead by emptying and refilling.

Choosing a key is one ``ZRANGE 0 0`` and one ``ZADD`` on a sorted set of the
keys with messages waiting: O(log active keys).  A key whose list empties
leaves the set; its finish tag stays in ``fair.last`` only until the virtual
time passes it.

The per-key list names are built inside the scripts from the queue's name
(a key is not known to the caller before the choice).  That is fine on a
single Redis server or a Sentinel-managed one, which Kombu's Redis transport
supports; it would not be on Redis Cluster, which Kombu does not support.
"""

from __future__ import annotations

from . import layout

__all__ = ("CHARGE", "ENQUEUE", "KEYED_POP", "PRELUDE", "PURGE", "RELEASE", "UNKEY")

#: Helpers shared by the scripts.  The script defines ``SEP`` (Kombu's
#: separator) and ``DFLT`` (the default key weight) before this text.
PRELUDE = f"""
local function kname(base, suffix) return base .. SEP .. suffix end

local function weight(base, key)
  local w = redis.call('HGET', kname(base, '{layout.WEIGHTS_LIVE}'), key)
  if not w then w = redis.call('HGET', kname(base, '{layout.WEIGHTS_CONF}'), key) end
  w = tonumber(w)
  if not w or w <= 0 then return DFLT end
  return w
end

local function vtime(base)
  return tonumber(redis.call('HGET', kname(base, '{layout.STATE}'), 'vt')) or 0
end

-- A key that starts waiting joins at max(virtual time, its last finish tag).
local function start_tag(base, key)
  local vt = vtime(base)
  local last = tonumber(redis.call('ZSCORE', kname(base, '{layout.LAST}'), key))
  if last and last > vt then return last end
  return vt
end

-- Per-key limits: the live value, else the configured one, for the key or '*'.
local function limit(base, kind, key)
  local live, conf = kname(base, '{layout.LIMITS_LIVE}'), kname(base, '{layout.LIMITS_CONF}')
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
  if redis.call('HSETNX', kname(base, '{layout.HELD_SINCE}'), key, now) == 1 then
    redis.call('HINCRBY', kname(base, '{layout.STATE}'), 'held_n', 1)
  end
end

local function resume(base, key, now)
  local since = kname(base, '{layout.HELD_SINCE}')
  local t = tonumber(redis.call('HGET', since, key))
  if not t then return end
  redis.call('HDEL', since, key)
  local d = math.max(0, now - t)
  redis.call('HINCRBYFLOAT', kname(base, '{layout.STATE}'), 'held_s', d)
  -- Reported by the key's next served task (telemetry's key_held).
  redis.call('HINCRBYFLOAT', kname(base, '{layout.HELD_OWED}'), key, d)
  local held = kname(base, '{layout.HELD}')
  redis.call('ZINCRBY', held, d, key)
  if redis.call('ZCARD', held) > {2 * layout.HELD_TOP} then
    redis.call('ZREMRANGEBYRANK', held, 0, -{layout.HELD_TOP + 1})
  end
end

-- A key set aside at its concurrency limit goes back in line.
local function unpark(base, key, now)
  if redis.call('SREM', kname(base, '{layout.PARKED}'), key) == 1 then
    redis.call('ZADD', kname(base, '{layout.ACTIVE}'), start_tag(base, key), key)
    resume(base, key, now)
  end
end

-- A task of a limited key finished, was restored or its lease expired
-- (``id``: its message's delivery tag; ``now``: the broker's clock).
local function release(base, id, now)
  local leases = kname(base, '{layout.LEASE_KEY}')
  local key = redis.call('HGET', leases, id)
  if not key then return 0 end
  redis.call('HDEL', leases, id)
  redis.call('ZREM', kname(base, '{layout.LEASES}'), id)
  local running = kname(base, '{layout.RUNNING}')
  local n = redis.call('HINCRBY', running, key, -1)
  if n <= 0 then redis.call('HDEL', running, key) end
  local c = limit(base, 'c', key)
  if not c or n < c then unpark(base, key, now) end
  return 1
end

-- Run-time cost: the difference between the measured run time and the
-- charge made at fetch, divided by the key's weight (DRR++ post-charge).
local function charge(base, key, delta)
  local d = delta / weight(base, key)
  local active = kname(base, '{layout.ACTIVE}')
  if redis.call('ZSCORE', active, key) then
    redis.call('ZINCRBY', active, d, key)
    return
  end
  local last = kname(base, '{layout.LAST}')
  if redis.call('ZSCORE', last, key) then
    redis.call('ZINCRBY', last, d, key)
  elseif d > 0 then
    redis.call('ZADD', last, vtime(base) + d, key)
  end
end
"""

#: Publish one message to its key.  ARGV: base, sep, default weight, key,
#: payload, "1" to put it first in line (a restore) else "0".  Returns the
#: key's list length, or 0 when the queue was moved back to plain lists
#: (``unkey``): then the message goes to the queue's own list.
ENQUEUE = (
    "local SEP, DFLT = ARGV[2], tonumber(ARGV[3])\n"
    + PRELUDE
    + f"""
local base, key, item = ARGV[1], ARGV[4], ARGV[5]
local push = 'LPUSH'
if ARGV[6] == '1' then push = 'RPUSH' end
local state = kname(base, '{layout.STATE}')
if redis.call('HEXISTS', state, '{layout.UNKEYED_MARK}') == 1 then
  -- Moved back to plain lists: no message may wait where only a keyed fetch reads.
  redis.call(push, base, item)
  return 0
end
local list = kname(base, '{layout.KEY_LIST}') .. key
local n = redis.call(push, list, item)
redis.call('HINCRBY', state, '{layout.BACKLOG}', 1)
redis.call('ZADD', kname(base, '{layout.SIZES}'), n, key)
if n == 1 then
  redis.call('ZADD', kname(base, '{layout.ACTIVE}'), start_tag(base, key), key)
end
return n
"""
)

#: Apply run-time charges.  ARGV: sep, default weight, then (base, key,
#: delta) triples.
CHARGE = (
    "local SEP, DFLT = ARGV[1], tonumber(ARGV[2])\n"
    + PRELUDE
    + """
for i = 3, #ARGV, 3 do charge(ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])) end
return (#ARGV - 2) / 3
"""
)

#: Release the slots of finished tasks.  ARGV: sep, default weight, then
#: (base, delivery tag) pairs (a lease is named by its message's delivery
#: tag).  Returns how many leases were found.
RELEASE = (
    "local SEP, DFLT = ARGV[1], tonumber(ARGV[2])\n"
    + PRELUDE
    + """
local n, now = 0, server_now()
for i = 3, #ARGV, 2 do n = n + release(ARGV[i], ARGV[i + 1], now) end
return n
"""
)

#: Delete up to ARGV[3] keys' lists of a keyed queue.  ARGV: base, sep,
#: limit.  Returns {messages deleted, keys visited}; call until keys < limit.
#: The keys waiting in line come first, then the ones set aside by their
#: limits (at their concurrency limit, or out of tokens): their lists hold
#: messages too.
PURGE = f"""
local base, SEP, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function name(suffix) return base .. SEP .. suffix end
local n, visited = 0, 0
local function drop(key)
  if key ~= '{layout.UNKEYED}' then
    local list = name('{layout.KEY_LIST}') .. key
    n = n + redis.call('LLEN', list)
    redis.call('DEL', list)
    redis.call('ZREM', name('{layout.SIZES}'), key)
  end
  redis.call('HDEL', name('{layout.HELD_SINCE}'), key)
  redis.call('HDEL', name('{layout.HELD_OWED}'), key)
  visited = visited + 1
end
for _, key in ipairs(redis.call('ZRANGE', name('{layout.ACTIVE}'), 0, limit - 1)) do
  drop(key)
  redis.call('ZREM', name('{layout.ACTIVE}'), key)
end
if visited < limit then
  for _, key in ipairs(redis.call('SPOP', name('{layout.PARKED}'), limit - visited)) do
    drop(key)
  end
end
if visited < limit then
  local sleep = name('{layout.SLEEP}')
  for _, key in ipairs(redis.call('ZRANGE', sleep, 0, limit - visited - 1)) do
    drop(key)
    redis.call('ZREM', sleep, key)
  end
end
if n > 0 then redis.call('HINCRBY', name('{layout.STATE}'), '{layout.BACKLOG}', -n) end
return {{n, visited}}
"""

#: Move up to ARGV[3] waiting messages of a keyed queue back to Kombu's own
#: lists (a return to plain Celery).  ARGV: base, sep, limit, the list
#: suffix of a message without a priority, then the suffixes of priorities 0
#: to 9 (Kombu's ``_q_for_pri``: a plain consumer finds each message where
#: Kombu would have put it).  Takes one message of each key in turn, in the
#: keys' fair order (the keys set aside by their limits too, after those in
#: line), so that plain workers serve the keys interleaved; each
#: goes to the back of its list (LPUSH, as Kombu publishes).  Marks the
#: queue ``unkeyed`` (:mod:`celery_fair.keys.layout`): a keyed publish or
#: restore after this goes to the queue's own list as well.  Returns
#: {messages moved, messages left in the per-key lists}: call until nothing
#: is left.  Each call is one atomic step: a kill between two calls loses
#: and duplicates nothing.
UNKEY = f"""
local base, SEP, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function name(suffix) return base .. SEP .. suffix end
local unprioritized, by_priority = ARGV[4], {{}}
for p = 0, 9 do by_priority[p] = ARGV[5 + p] end
local function target(item)
  local ok, msg = pcall(cjson.decode, item)
  if ok and type(msg) == 'table' and type(msg['properties']) == 'table' then
    local p = tonumber(msg['properties']['priority'])
    if p then return base .. by_priority[math.max(0, math.min(9, math.floor(p)))] end
  end
  return base .. unprioritized
end
local keys, seen = {{}}, {{}}
local function add(list, where)
  for _, key in ipairs(list) do
    if key ~= '{layout.UNKEYED}' and not seen[key] and #keys < limit then
      seen[key] = where
      keys[#keys + 1] = key
    end
  end
end
add(redis.call('ZRANGE', name('{layout.ACTIVE}'), 0, limit - 1), 'line')
add(redis.call('SRANDMEMBER', name('{layout.PARKED}'), limit), 'aside')
add(redis.call('ZRANGE', name('{layout.SLEEP}'), 0, limit - 1), 'aside')
redis.call('HSET', name('{layout.STATE}'), '{layout.UNKEYED_MARK}', 1)
local moved, live = 0, #keys
while moved < limit and live > 0 do
  live = 0
  for i, key in ipairs(keys) do
    if key and moved < limit then
      local item = redis.call('RPOP', name('{layout.KEY_LIST}') .. key)
      if item then
        redis.call('LPUSH', target(item), item)
        redis.call('ZINCRBY', name('{layout.SIZES}'), -1, key)
        if seen[key] == 'line' then
          -- Further back in line: the next batch starts with another key.
          redis.call('ZINCRBY', name('{layout.ACTIVE}'), 1, key)
        end
        moved = moved + 1
        live = live + 1
      else
        keys[i] = false
      end
    end
  end
end
-- Keys with nothing left leave every place a key waits in.
for key in pairs(seen) do
  if redis.call('EXISTS', name('{layout.KEY_LIST}') .. key) == 0 then
    redis.call('ZREM', name('{layout.ACTIVE}'), key)
    redis.call('ZREM', name('{layout.SIZES}'), key)
    redis.call('SREM', name('{layout.PARKED}'), key)
    redis.call('ZREM', name('{layout.SLEEP}'), key)
    redis.call('HDEL', name('{layout.HELD_SINCE}'), key)
    redis.call('HDEL', name('{layout.HELD_OWED}'), key)
  end
end
local left = tonumber(redis.call('HGET', name('{layout.STATE}'), '{layout.BACKLOG}')) or 0
if moved > 0 then
  -- (A Lua 0 negated is sent as "-0", which HINCRBY refuses.)
  left = redis.call('HINCRBY', name('{layout.STATE}'), '{layout.BACKLOG}', -moved)
end
if left < 0 then
  redis.call('HSET', name('{layout.STATE}'), '{layout.BACKLOG}', 0)
  left = 0
end
return {{moved, left}}
"""

#: The keyed branch of the fetch script (``celery_fair.kombu.atomic``),
#: a function ``keyed_pop(base, suffixes, est, limited, now)`` returning
#: ``item, key, weight, held`` or nil (``weight`` as text: a Lua number
#: returned to Redis loses its fraction; ``held``: the seconds the key was
#: set aside since its previous task was served, as text, or nil).
#: ``suffixes`` name the queue's Kombu priority lists other than its own
#: (the unkeyed messages); ``est`` is the charge at fetch; ``limited``: the
#: queue has per-key limits, ``now`` the broker's clock.
#: Also ``next_event`` and ``lease`` (per-key limits).
KEYED_POP = f"""
local function plain_pop(base, suffixes)
  local item = redis.call('RPOP', base)
  if item then return item end
  for _, s in ipairs(suffixes) do
    item = redis.call('RPOP', base .. s)
    if item then return item end
  end
  return nil
end

local function plain_len(base, suffixes)
  local n = redis.call('LLEN', base)
  for _, s in ipairs(suffixes) do n = n + redis.call('LLEN', base .. s) end
  return n
end

-- A key set aside keeps its place: it resumes at this tag (or the virtual time).
local function keep_tag(last, key, tag)
  local kept = tonumber(redis.call('ZSCORE', last, key))
  if not kept or kept < tag then redis.call('ZADD', last, tag, key) end
end

local function keyed_pop(base, suffixes, est, limited, now)
  local active = kname(base, '{layout.ACTIVE}')
  local state = kname(base, '{layout.STATE}')
  local last = kname(base, '{layout.LAST}')
  if limited then
    -- Leases past their expiry (a worker that died) free their slots; keys
    -- whose rate lets them go on rejoin the line.  A few per fetch: bounded.
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', kname(base, '{layout.LEASES}'),
                                   '-inf', now, 'LIMIT', 0, 32)) do
      release(base, id, now)
    end
    local sleep = kname(base, '{layout.SLEEP}')
    for _, key in ipairs(redis.call('ZRANGEBYSCORE', sleep, '-inf', now, 'LIMIT', 0, 32)) do
      redis.call('ZREM', sleep, key)
      redis.call('ZADD', active, start_tag(base, key), key)
      resume(base, key, now)
    end
  end
  -- Messages of producers without celery-fair: one more key, the empty one.
  local plain = plain_len(base, suffixes)
  if plain > 0 and not redis.call('ZSCORE', active, '{layout.UNKEYED}')
     and not (limited and (redis.call('SISMEMBER', kname(base, '{layout.PARKED}'),
                                      '{layout.UNKEYED}') == 1
                           or redis.call('ZSCORE', kname(base, '{layout.SLEEP}'),
                                         '{layout.UNKEYED}'))) then
    redis.call('ZADD', active, start_tag(base, '{layout.UNKEYED}'), '{layout.UNKEYED}')
  end
  while true do
    local top = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local key, tag = top[1], tonumber(top[2])
    local held, bucket, tokens, rate = false, nil, nil, nil
    if limited then
      -- At its concurrency limit: set aside until one of its tasks finishes.
      local c = limit(base, 'c', key)
      if c and (tonumber(redis.call('HGET', kname(base, '{layout.RUNNING}'), key)) or 0) >= c then
        redis.call('ZREM', active, key)
        keep_tag(last, key, tag)
        redis.call('SADD', kname(base, '{layout.PARKED}'), key)
        hold(base, key, now)
        held = true
      else
        -- Out of tokens: set aside until the bucket holds one again.
        rate = limit(base, 'r', key)
        if rate then
          bucket = kname(base, '{layout.BUCKET}') .. key
          local burst = math.max(1, rate)
          local saved = redis.call('HMGET', bucket, 't', 's')
          tokens = tonumber(saved[1]) or burst
          local stamp = tonumber(saved[2]) or now
          tokens = math.min(burst, tokens + math.max(0, now - stamp) * rate)
          if tokens < 1 then
            redis.call('ZREM', active, key)
            keep_tag(last, key, tag)
            redis.call('ZADD', kname(base, '{layout.SLEEP}'), now + (1 - tokens) / rate, key)
            hold(base, key, now)
            held = true
          end
        end
      end
    end
    if not held then
      local item, left = nil, 0
      if key == '{layout.UNKEYED}' then
        item = plain_pop(base, suffixes)
        left = plain - 1
      else
        local list = kname(base, '{layout.KEY_LIST}') .. key
        item = redis.call('RPOP', list)
        if item then
          redis.call('HINCRBY', state, '{layout.BACKLOG}', -1)
          left = redis.call('LLEN', list)
          if left > 0 then redis.call('ZADD', kname(base, '{layout.SIZES}'), left, key)
          else redis.call('ZREM', kname(base, '{layout.SIZES}'), key) end
        end
      end
      if item then
        -- Read here, before the key's tag moves. The same HGET at the end of
        -- this branch made idle workers miss the wake-up of a released slot
        -- and wait for their next poll (Redis 7.0.15, seen in
        -- test_concurrency_limits_hold_across_two_workers; cause not found;
        -- a lost wake-up of the idle wait, fixed since in AtomicFetch.start,
        -- may have been it: not checked again).
        local owed = nil
        if limited then owed = redis.call('HGET', kname(base, '{layout.HELD_OWED}'), key) end
        if tag > vtime(base) then redis.call('HSET', state, 'vt', tag) end
        local w = weight(base, key)
        local finish = tag + est / w
        redis.call('ZREMRANGEBYSCORE', last, '-inf', '(' .. tag)
        if left > 0 then
          redis.call('ZADD', active, finish, key)
        else
          redis.call('ZREM', active, key)
          redis.call('ZADD', last, finish, key)
        end
        if bucket then
          -- The bucket expires once it would be full again: no state for idle keys.
          redis.call('HSET', bucket, 't', tokens - 1, 's', now)
          redis.call('PEXPIRE', bucket, math.ceil((math.max(1, rate) - tokens + 1) / rate * 1000))
        end
        if owed then redis.call('HDEL', kname(base, '{layout.HELD_OWED}'), key) end
        return item, key, tostring(w), owed
      end
      -- Listed but empty (its list was deleted by hand): forget it.
      redis.call('ZREM', active, key)
      if limited then redis.call('HDEL', kname(base, '{layout.HELD_OWED}'), key) end
    end
  end
end

-- A limited queue with nothing to serve now: seconds until a key set aside
-- by its rate may go on, or a lease expires (nil: nothing will by itself).
local function next_event(base, now)
  local soonest = nil
  local names = {{'{layout.SLEEP}'}}
  -- An expiring lease matters only to a key set aside at its concurrency limit.
  if redis.call('SCARD', kname(base, '{layout.PARKED}')) > 0 then
    names[2] = '{layout.LEASES}'
  end
  for _, name in ipairs(names) do
    local first = redis.call('ZRANGE', kname(base, name), 0, 0, 'WITHSCORES')
    if #first > 0 then
      local due = math.max(0, tonumber(first[2]) - now)
      if not soonest or due < soonest then soonest = due end
    end
  end
  return soonest
end

-- Record the lease of a fetched task of a limited key (its slot until it finishes).
local function lease(base, key, id, now, ttl)
  redis.call('HSET', kname(base, '{layout.LEASE_KEY}'), id, key)
  redis.call('ZADD', kname(base, '{layout.LEASES}'), now + ttl, id)
  redis.call('HINCRBY', kname(base, '{layout.RUNNING}'), key, 1)
end
"""
