-- The keyed branch of the fetch (fetch.lua): keyed_pop(base, suffixes, est,
-- limited, now, lweights, call) serves a keyed queue's next message and returns item,
-- key, weight, throttled, level, user, paused (or nil when nothing may be served now).
--   base      the queue's Redis name (its own list; the per-key names derive from it)
--   suffixes  the suffixes of Kombu's other priority lists (its other levels)
--   est       the charge at fetch (1 task, or the estimated run time)
--   limited   the queue has per-key limits; now: the broker's clock (seconds)
--   lweights  nil: the first level with a message that may be served now wins
--             (strict priority); else level suffix -> weight: the levels with
--             messages share the fetches by weight (start-time fair queuing
--             over levels, their tags in N.LEVEL_TAGS, '*' their virtual time)
--   weight    the key's weight, as text (a Lua number returned to Redis loses its fraction)
--   throttled seconds the key was set aside by its limits since its previous
--             task was served, as text, or nil
--   level     the suffix of the level served ('' for the first)
--   user      with two-level keys, the user served within the key (else nil)
--   paused    seconds the key was paused since its previous task was served,
--             as text, or nil
-- Within a level, choosing a key is one ZRANGE 0 0 and one ZADD on the level's
-- sorted set of keys with messages waiting: O(levels + log active keys), and
-- with two-level keys the same within the key's users (+ log users).  Also
-- next_event (when a key set aside may go on by itself) and lease (a fetched
-- task holds its key's slot).

-- A key set aside keeps its place: it resumes at this tag (or the virtual time).
local function keep_tag(last, key, tag)
  local kept = tonumber(redis.call('ZSCORE', last, key))
  if not kept or kept < tag then redis.call('ZADD', last, tag, key) end
end

-- The next message of two-level key ``key`` (a tenant) in level ``lb``: its
-- users in start-time fair order within it, as keys are within a level.
-- Returns item, user, users still waiting; nil when it has no user waiting.
local function pop_user(base, lb, key, est)
  local users = users_name(lb, key)
  while true do
    local top = redis.call('ZRANGE', users, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local user, tag = top[1], tonumber(top[2])
    local list = user_list(lb, key, user)
    local item = redis.call('RPOP', list)
    if item then
      local vts, ulast = kname(lb, N.USER_VT), kname(lb, N.USER_LAST) .. key
      if tag > (tonumber(redis.call('HGET', vts, key)) or 0) then
        redis.call('HSET', vts, key, tag)
      end
      local finish = tag + est / weight(base, user_weight_name(key, user))
      redis.call('ZREMRANGEBYSCORE', ulast, '-inf', '(' .. tag)
      if redis.call('LLEN', list) > 0 then
        redis.call('ZADD', users, finish, user)
      else
        redis.call('ZREM', users, user)
        redis.call('ZADD', ulast, finish, user)
      end
      local left = redis.call('ZCARD', users)
      if left == 0 then
        -- Nothing left of the tenant in this level: its users start afresh next time.
        redis.call('DEL', ulast)
        redis.call('HDEL', vts, key)
      end
      return item, user, left
    end
    -- Listed but empty (its list was deleted by hand): forget it.
    redis.call('ZREM', users, user)
  end
end

-- Serve level ``lb`` (a queue's level base): nil when none of its keys may go now.
-- ``paused``: the queue has paused keys (control fair_key_pause).
local function pop_level(base, lb, est, limited, now, paused)
  local active = kname(lb, N.ACTIVE)
  local last = kname(lb, N.LAST)
  -- Messages of producers without celery-fair: one more key, the empty one.
  local plain = redis.call('LLEN', lb)
  if plain > 0 and not redis.call('ZSCORE', active, N.UNKEYED)
     and not (limited and (redis.call('SISMEMBER', kname(base, N.AT_LIMIT),
                                      N.UNKEYED) == 1
                           or redis.call('ZSCORE', kname(base, N.SLEEP),
                                         N.UNKEYED)))
     and not (paused and redis.call('SISMEMBER', kname(base, N.PAUSED), N.UNKEYED) == 1) then
    redis.call('ZADD', active, start_tag(lb, N.UNKEYED), N.UNKEYED)
  end
  while true do
    local top = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local key, tag = top[1], tonumber(top[2])
    local aside, bucket, tokens, rate = false, nil, nil, nil
    if paused and redis.call('SISMEMBER', kname(base, N.PAUSED), key) == 1 then
      -- Paused: set aside, keeping its place, until it is resumed.
      redis.call('ZREM', active, key)
      keep_tag(last, key, tag)
      aside = true
    elseif limited then
      -- At its concurrency limit: set aside until one of its tasks finishes.
      local c
      c, rate = limits(base, key, 'c', 'r')
      if c and (tonumber(redis.call('HGET', kname(base, N.RUNNING), key)) or 0) >= c then
        redis.call('ZREM', active, key)
        keep_tag(last, key, tag)
        redis.call('SADD', kname(base, N.AT_LIMIT), key)
        throttle(base, key, now)
        aside = true
      else
        -- Out of tokens: set aside until the bucket holds one again.
        if rate then
          bucket = kname(base, N.BUCKET) .. key
          local burst = math.max(1, rate)
          local saved = redis.call('HMGET', bucket, 't', 's')
          tokens = tonumber(saved[1]) or burst
          local stamp = tonumber(saved[2]) or now
          tokens = math.min(burst, tokens + math.max(0, now - stamp) * rate)
          if tokens < 1 then
            redis.call('ZREM', active, key)
            keep_tag(last, key, tag)
            redis.call('ZADD', kname(base, N.SLEEP), now + (1 - tokens) / rate, key)
            throttle(base, key, now)
            aside = true
          end
        end
      end
    end
    if not aside then
      local item, left, user = nil, 0, nil
      if key == N.UNKEYED then
        item = redis.call('RPOP', lb)
        left = plain - 1
      else
        local list = kname(lb, N.KEY_LIST) .. key
        item = redis.call('RPOP', list)
        if item then
          left = redis.call('LLEN', list)
          -- (A queue that became two-level with messages in the key's own list.)
          if left == 0 then left = redis.call('ZCARD', users_name(lb, key)) end
        else
          item, user, left = pop_user(base, lb, key, est)
        end
        if item then
          redis.call('HINCRBY', kname(base, N.STATE), N.BACKLOG, -1)
          local sizes = kname(base, N.SIZES)
          if tonumber(redis.call('ZINCRBY', sizes, -1, key)) <= 0 then
            redis.call('ZREM', sizes, key)
          end
        end
      end
      if item then
        -- The seconds the key was set aside, owed to this task's telemetry.
        local owed = nil
        if limited then owed = field(kname(base, N.THROTTLED_OWED), key) end
        if tag > vtime(lb) then redis.call('HSET', kname(lb, N.STATE), 'vt', tag) end
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
        if owed then redis.call('HDEL', kname(base, N.THROTTLED_OWED), key) end
        -- The seconds the key was paused, owed to this task's telemetry likewise.
        local powed = field(kname(base, N.PAUSED_OWED), key)
        if powed then redis.call('HDEL', kname(base, N.PAUSED_OWED), key) end
        return item, key, tostring(w), owed, user, powed
      end
      -- Listed but empty (its list was deleted by hand): forget it.
      redis.call('ZREM', active, key)
      if limited then redis.call('HDEL', kname(base, N.THROTTLED_OWED), key) end
    end
  end
end

-- ``call``: a table the caller keeps for one script call and one queue, so
-- that a batch of pops does once what holds for the whole call: the expired
-- leases and the keys whose rate lets them go on, whether any key is paused,
-- and the queue's levels.
local function keyed_pop(base, suffixes, est, limited, now, lweights, call)
  if not call.levels then
    call.paused = redis.call('SCARD', kname(base, N.PAUSED)) > 0
    if limited then
      -- Leases past their expiry (a worker that died) free their slots; keys
      -- whose rate lets them go on rejoin the line.  A few per fetch: bounded.
      for _, id in ipairs(redis.call('ZRANGEBYSCORE', kname(base, N.LEASES),
                                     '-inf', now, 'LIMIT', 0, 32)) do
        release(base, id, now)
      end
      local sleep = kname(base, N.SLEEP)
      for _, key in ipairs(redis.call('ZRANGEBYSCORE', sleep, '-inf', now, 'LIMIT', 0, 32)) do
        redis.call('ZREM', sleep, key)
        rejoin(base, key)
        unthrottle(base, key, now)
      end
    end
    call.levels = level_suffixes(base, suffixes)
  end
  local paused, levels = call.paused, call.levels
  if not lweights then
    for _, s in ipairs(levels) do
      local item, key, w, owed, user, powed = pop_level(base, base .. s, est, limited, now, paused)
      if item then return item, key, w, owed, s, user, powed end
    end
    return nil
  end
  -- Weighted levels: the levels with messages, by start tag (a level that had
  -- none joins at the levels' virtual time), then in level order.
  local tags_name = kname(base, N.LEVEL_TAGS)
  local tags = redis.call('HMGET', tags_name, '*', unpack(levels))
  local lvt = tonumber(tags[1]) or 0
  local order = {}
  for i, s in ipairs(levels) do
    local lb = base .. s
    if redis.call('ZCARD', kname(lb, N.ACTIVE)) > 0 or redis.call('LLEN', lb) > 0 then
      order[#order + 1] = {math.max(tonumber(tags[i + 1]) or 0, lvt), i, s}
    end
  end
  table.sort(order, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    return a[2] < b[2]
  end)
  for _, o in ipairs(order) do
    local item, key, w, owed, user, powed = pop_level(base, base .. o[3], est, limited, now, paused)
    if item then
      local lw = tonumber(lweights[o[3]]) or 1
      redis.call('HSET', tags_name, '*', o[1], o[3], o[1] + est / lw)
      return item, key, w, owed, o[3], user, powed
    end
  end
  return nil
end

-- A limited queue with nothing to serve now: seconds until a key set aside
-- by its rate may go on, or a lease expires (nil: nothing will by itself).
local function next_event(base, now)
  local soonest = nil
  local names = {N.SLEEP}
  -- An expiring lease matters only to a key set aside at its concurrency limit.
  if redis.call('SCARD', kname(base, N.AT_LIMIT)) > 0 then
    names[2] = N.LEASES
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
  redis.call('HSET', kname(base, N.LEASE_KEY), id, key)
  redis.call('ZADD', kname(base, N.LEASES), now + ttl, id)
  redis.call('HINCRBY', kname(base, N.RUNNING), key, 1)
end
