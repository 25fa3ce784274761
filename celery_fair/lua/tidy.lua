-- TIDY: keep a keyed queue's throttling records under their names and true.
-- ARGV: sep, then the bases (Redis names) of the keyed queues to tidy.
-- Run by every worker with fair_keys at each connection and every
-- KEYED_RECHECK seconds (celery_fair.worker.keyed_admin).
--
-- 1. Records under the names of earlier releases (N.OLD_*: "fair.parked",
--    "fair.hsince", "fair.held", "fair.howed", and the state fields "held_n"
--    and "held_s") are merged into the current ones and deleted.  During a
--    rolling upgrade a worker of the earlier release keeps writing the old
--    names; the next tidy moves what it wrote.
-- 2. A key set aside at its concurrency limit whose running tasks are now
--    below the limit goes back in line.  A release normally does this; it is
--    repaired here when the release could not (a worker of the earlier release
--    freed a slot of a key this release set aside, or a limit was raised or
--    removed while the key was aside).  At most TIDY_SCAN keys per queue per run.
-- Returns {records moved, keys readmitted}, summed over the queues.
local TIDY_SCAN = 1000
SEP = ARGV[1]
local now, moved, readmitted = server_now(), 0, 0

local function merge_set(old, new)
  local n = redis.call('SCARD', old)
  if n == 0 then return 0 end
  redis.call('SUNIONSTORE', new, new, old)
  redis.call('DEL', old)
  return n
end

-- A hash of key -> number: ``earliest`` keeps the earlier of two times
-- (since when a key was throttled), else the two are summed (seconds owed).
local function merge_hash(old, new, earliest)
  local flat = redis.call('HGETALL', old)
  for i = 1, #flat, 2 do
    local key, value = flat[i], flat[i + 1]
    if not earliest then
      redis.call('HINCRBYFLOAT', new, key, value)
    else
      local mine = tonumber(redis.call('HGET', new, key))
      if not mine or tonumber(value) < mine then redis.call('HSET', new, key, value) end
    end
  end
  redis.call('DEL', old)
  return #flat / 2
end

-- Sorted set of key -> seconds: summed, then trimmed as unthrottle trims it.
local function merge_longest(old, new)
  local n = redis.call('ZCARD', old)
  if n == 0 then return 0 end
  redis.call('ZUNIONSTORE', new, 2, new, old, 'AGGREGATE', 'SUM')
  redis.call('DEL', old)
  if redis.call('ZCARD', new) > 2 * N.THROTTLED_TOP then
    redis.call('ZREMRANGEBYRANK', new, 0, -(N.THROTTLED_TOP + 1))
  end
  return n
end

local function merge_field(state, old, new, add)
  local v = redis.call('HGET', state, old)
  if not v then return 0 end
  redis.call(add, state, new, v)
  redis.call('HDEL', state, old)
  return 1
end

for i = 2, #ARGV do
  local base = ARGV[i]
  local state = kname(base, N.STATE)
  if redis.call('EXISTS', kname(base, N.OLD_AT_LIMIT), kname(base, N.OLD_THROTTLED_SINCE),
                kname(base, N.OLD_THROTTLED), kname(base, N.OLD_THROTTLED_OWED)) > 0
     or redis.call('HEXISTS', state, N.OLD_THROTTLED_COUNT) == 1
     or redis.call('HEXISTS', state, N.OLD_THROTTLED_SECONDS) == 1 then
    moved = moved
      + merge_set(kname(base, N.OLD_AT_LIMIT), kname(base, N.AT_LIMIT))
      + merge_hash(kname(base, N.OLD_THROTTLED_SINCE), kname(base, N.THROTTLED_SINCE), true)
      + merge_longest(kname(base, N.OLD_THROTTLED), kname(base, N.THROTTLED))
      + merge_hash(kname(base, N.OLD_THROTTLED_OWED), kname(base, N.THROTTLED_OWED), false)
      + merge_field(state, N.OLD_THROTTLED_COUNT, N.THROTTLED_COUNT, 'HINCRBY')
      + merge_field(state, N.OLD_THROTTLED_SECONDS, N.THROTTLED_SECONDS, 'HINCRBYFLOAT')
  end
  local running = kname(base, N.RUNNING)
  for _, key in ipairs(redis.call('SRANDMEMBER', kname(base, N.AT_LIMIT), TIDY_SCAN)) do
    local c = limits(base, key, 'c')
    if not c or (tonumber(redis.call('HGET', running, key)) or 0) < c then
      readmit(base, key, now)
      readmitted = readmitted + 1
    end
  end
end
return {moved, readmitted}
