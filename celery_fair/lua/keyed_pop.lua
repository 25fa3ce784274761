-- The keyed branch of the fetch (fetch.lua): keyed_pop(base, suffixes, est,
-- limited, now) serves a keyed queue's next key in fair order and returns
-- item, key, weight, held (or nil when nothing may be served now).
--   base      the queue's Redis name (its own list; the per-key names derive from it)
--   suffixes  the queue's other Kombu priority lists (its unkeyed messages)
--   est       the charge at fetch (1 task, or the estimated run time)
--   limited   the queue has per-key limits; now: the broker's clock (seconds)
--   weight    the key's weight, as text (a Lua number returned to Redis loses its fraction)
--   held      seconds the key was set aside by its limits since its previous
--             task was served, as text, or nil
-- Choosing a key is one ZRANGE 0 0 and one ZADD on the sorted set of the keys
-- with messages waiting: O(log active keys).  Also next_event (when a key set
-- aside may go on by itself) and lease (a fetched task holds its key's slot).
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
  local active = kname(base, N.ACTIVE)
  local state = kname(base, N.STATE)
  local last = kname(base, N.LAST)
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
      redis.call('ZADD', active, start_tag(base, key), key)
      resume(base, key, now)
    end
  end
  -- Messages of producers without celery-fair: one more key, the empty one.
  local plain = plain_len(base, suffixes)
  if plain > 0 and not redis.call('ZSCORE', active, N.UNKEYED)
     and not (limited and (redis.call('SISMEMBER', kname(base, N.AT_LIMIT),
                                      N.UNKEYED) == 1
                           or redis.call('ZSCORE', kname(base, N.SLEEP),
                                         N.UNKEYED))) then
    redis.call('ZADD', active, start_tag(base, N.UNKEYED), N.UNKEYED)
  end
  while true do
    local top = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local key, tag = top[1], tonumber(top[2])
    local held, bucket, tokens, rate = false, nil, nil, nil
    if limited then
      -- At its concurrency limit: set aside until one of its tasks finishes.
      local c = limit(base, 'c', key)
      if c and (tonumber(redis.call('HGET', kname(base, N.RUNNING), key)) or 0) >= c then
        redis.call('ZREM', active, key)
        keep_tag(last, key, tag)
        redis.call('SADD', kname(base, N.AT_LIMIT), key)
        hold(base, key, now)
        held = true
      else
        -- Out of tokens: set aside until the bucket holds one again.
        rate = limit(base, 'r', key)
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
            hold(base, key, now)
            held = true
          end
        end
      end
    end
    if not held then
      local item, left = nil, 0
      if key == N.UNKEYED then
        item = plain_pop(base, suffixes)
        left = plain - 1
      else
        local list = kname(base, N.KEY_LIST) .. key
        item = redis.call('RPOP', list)
        if item then
          redis.call('HINCRBY', state, N.BACKLOG, -1)
          left = redis.call('LLEN', list)
          if left > 0 then redis.call('ZADD', kname(base, N.SIZES), left, key)
          else redis.call('ZREM', kname(base, N.SIZES), key) end
        end
      end
      if item then
        -- The seconds the key was set aside, owed to this task's telemetry.
        local owed = nil
        if limited then owed = redis.call('HGET', kname(base, N.HELD_OWED), key) end
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
        if owed then redis.call('HDEL', kname(base, N.HELD_OWED), key) end
        return item, key, tostring(w), owed
      end
      -- Listed but empty (its list was deleted by hand): forget it.
      redis.call('ZREM', active, key)
      if limited then redis.call('HDEL', kname(base, N.HELD_OWED), key) end
    end
  end
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
