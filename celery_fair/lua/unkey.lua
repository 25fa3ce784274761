-- UNKEY: move up to `limit` waiting messages of a keyed queue back to Kombu's
-- own lists (celery-fair keys unkey: a return to plain Celery).
-- ARGV: base (the queue's Redis name), sep, limit, the list suffix of a message
--       without a priority, then the suffixes of priorities 0 to 9 (Kombu's
--       _q_for_pri: a plain consumer finds each message where Kombu would put it).
-- Takes one message of each key in turn, in the keys' fair order (the keys set
-- aside by their limits too, after those in line), so that plain workers serve
-- the keys interleaved; each goes to the back of its list (LPUSH, as Kombu
-- publishes).  Marks the queue unkeyed (N.UNKEYED_MARK in its state hash): a
-- keyed publish or restore after this goes to the queue's own list as well.
-- Returns {messages moved, messages left in the per-key lists}: call until
-- nothing moves.  Each call is one atomic step: a kill between two calls loses
-- and duplicates nothing.
local base, limit = ARGV[1], tonumber(ARGV[3])
SEP = ARGV[2]
local function name(suffix) return base .. SEP .. suffix end
local unprioritized, by_priority = ARGV[4], {}
for p = 0, 9 do by_priority[p] = ARGV[5 + p] end
local function target(item)
  local ok, msg = pcall(cjson.decode, item)
  if ok and type(msg) == 'table' and type(msg['properties']) == 'table' then
    local p = tonumber(msg['properties']['priority'])
    if p then return base .. by_priority[math.max(0, math.min(9, math.floor(p)))] end
  end
  return base .. unprioritized
end
local keys, seen = {}, {}
local function add(list, where)
  for _, key in ipairs(list) do
    if key ~= N.UNKEYED and not seen[key] and #keys < limit then
      seen[key] = where
      keys[#keys + 1] = key
    end
  end
end
add(redis.call('ZRANGE', name(N.ACTIVE), 0, limit - 1), 'line')
add(redis.call('SRANDMEMBER', name(N.AT_LIMIT), limit), 'aside')
add(redis.call('ZRANGE', name(N.SLEEP), 0, limit - 1), 'aside')
redis.call('HSET', name(N.STATE), N.UNKEYED_MARK, 1)
local moved, live = 0, #keys
while moved < limit and live > 0 do
  live = 0
  for i, key in ipairs(keys) do
    if key and moved < limit then
      local item = redis.call('RPOP', name(N.KEY_LIST) .. key)
      if item then
        redis.call('LPUSH', target(item), item)
        redis.call('ZINCRBY', name(N.SIZES), -1, key)
        if seen[key] == 'line' then
          -- Further back in line: the next batch starts with another key.
          redis.call('ZINCRBY', name(N.ACTIVE), 1, key)
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
  if redis.call('EXISTS', name(N.KEY_LIST) .. key) == 0 then
    redis.call('ZREM', name(N.ACTIVE), key)
    redis.call('ZREM', name(N.SIZES), key)
    redis.call('SREM', name(N.AT_LIMIT), key)
    redis.call('ZREM', name(N.SLEEP), key)
    redis.call('HDEL', name(N.HELD_SINCE), key)
    redis.call('HDEL', name(N.HELD_OWED), key)
  end
end
local left = tonumber(redis.call('HGET', name(N.STATE), N.BACKLOG)) or 0
if moved > 0 then
  -- (A Lua 0 negated is sent as "-0", which HINCRBY refuses.)
  left = redis.call('HINCRBY', name(N.STATE), N.BACKLOG, -moved)
end
if left < 0 then
  redis.call('HSET', name(N.STATE), N.BACKLOG, 0)
  left = 0
end
return {moved, left}
