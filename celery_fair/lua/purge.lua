-- PURGE: delete the waiting messages of up to `limit` keys of a keyed queue.
-- ARGV: base (the queue's Redis name), sep, limit.
-- Returns {messages deleted, keys visited}: call until keys visited < limit.
-- The keys waiting in line in each priority level come first, then the ones
-- set aside by their limits (at their concurrency limit, or out of tokens) and
-- the paused ones: their lists hold messages too.  A two-level key's users'
-- lists go with it.  A key's lists in every level go at once.
-- The queue's own (unkeyed) lists are Kombu's to purge.
local base, limit = ARGV[1], tonumber(ARGV[3])
SEP = ARGV[2]
local function name(suffix) return base .. SEP .. suffix end
local levels = level_suffixes(base)
local n, visited = 0, 0
local function drop(key)
  if key ~= N.UNKEYED then
    for _, s in ipairs(levels) do
      local list = kname(base .. s, N.KEY_LIST) .. key
      n = n + redis.call('LLEN', list) + drop_users(base .. s, key)
      redis.call('DEL', list)
      redis.call('ZREM', kname(base .. s, N.ACTIVE), key)
    end
    redis.call('ZREM', name(N.SIZES), key)
  end
  redis.call('HDEL', name(N.THROTTLED_SINCE), key)
  redis.call('HDEL', name(N.THROTTLED_OWED), key)
  visited = visited + 1
end
for _, s in ipairs(levels) do
  if visited < limit then
    local active = kname(base .. s, N.ACTIVE)
    for _, key in ipairs(redis.call('ZRANGE', active, 0, limit - visited - 1)) do
      drop(key)
      redis.call('ZREM', active, key)
    end
  end
end
if visited < limit then
  for _, key in ipairs(redis.call('SPOP', name(N.AT_LIMIT), limit - visited)) do
    drop(key)
  end
end
if visited < limit then
  local sleep = name(N.SLEEP)
  for _, key in ipairs(redis.call('ZRANGE', sleep, 0, limit - visited - 1)) do
    drop(key)
    redis.call('ZREM', sleep, key)
  end
end
-- Paused keys stay paused; their messages go (only those with messages count).
if visited < limit then
  local sizes = name(N.SIZES)
  for _, key in ipairs(redis.call('SMEMBERS', name(N.PAUSED))) do
    if visited < limit and redis.call('ZSCORE', sizes, key) then drop(key) end
  end
end
if n > 0 then redis.call('HINCRBY', name(N.STATE), N.BACKLOG, -n) end
return {n, visited}
