-- UNKEY: move up to `limit` waiting messages of a keyed queue back to Kombu's
-- own lists (celery-fair keys unkey: a return to plain Celery).
-- ARGV: base (the queue's Redis name), sep, limit, the list suffix of a message
--       without a priority, then the suffixes of priorities 0 to 9 (Kombu's
--       _q_for_pri: a plain consumer finds each message where Kombu would put it).
-- Takes one message of each key in turn, level by level, in the keys' fair
-- order (the keys set aside by their limits or paused too, after those in
-- line; a two-level key's users one after another), so that
-- plain workers serve the keys interleaved; each goes to the back of its list (LPUSH, as Kombu
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
-- Entries are (level, key): a key has one list per priority level it has messages in.
local levels = level_suffixes(base)
local entries, seen, keyset = {}, {}, {}
local function add(lb, list, where)
  for _, key in ipairs(list) do
    local id = lb .. SEP .. key
    if key ~= N.UNKEYED and not seen[id] and #entries < limit then
      seen[id] = true
      keyset[key] = true
      entries[#entries + 1] = {lb, key, where}
    end
  end
end
for _, s in ipairs(levels) do
  add(base .. s, redis.call('ZRANGE', kname(base .. s, N.ACTIVE), 0, limit - 1), 'line')
end
local aside = redis.call('SRANDMEMBER', name(N.AT_LIMIT), limit)
for _, key in ipairs(redis.call('ZRANGE', name(N.SLEEP), 0, limit - 1)) do
  aside[#aside + 1] = key
end
for _, key in ipairs(redis.call('SRANDMEMBER', name(N.PAUSED), limit)) do
  aside[#aside + 1] = key
end
for _, s in ipairs(levels) do add(base .. s, aside, 'aside') end
redis.call('HSET', name(N.STATE), N.UNKEYED_MARK, 1)
local moved, live = 0, #entries
while moved < limit and live > 0 do
  live = 0
  for i, e in ipairs(entries) do
    if e and moved < limit then
      local lb, key = e[1], e[2]
      local item = redis.call('RPOP', kname(lb, N.KEY_LIST) .. key)
      if not item then item = take_user_message(lb, key) end
      if item then
        redis.call('LPUSH', target(item), item)
        redis.call('ZINCRBY', name(N.SIZES), -1, key)
        if e[3] == 'line' then
          -- Further back in line: the next batch starts with another key.
          redis.call('ZINCRBY', kname(lb, N.ACTIVE), 1, key)
        end
        moved = moved + 1
        live = live + 1
      else
        entries[i] = false
      end
    end
  end
end
-- A level's list emptied: the key leaves that level's line; a key with nothing
-- left in any level leaves every place a key waits in.
for key in pairs(keyset) do
  local any = false
  for _, s in ipairs(levels) do
    local lb = base .. s
    if not waiting_in(lb, key) then
      redis.call('ZREM', kname(lb, N.ACTIVE), key)
    else
      any = true
    end
  end
  if not any then
    redis.call('ZREM', name(N.SIZES), key)
    redis.call('SREM', name(N.AT_LIMIT), key)
    redis.call('ZREM', name(N.SLEEP), key)
    redis.call('HDEL', name(N.THROTTLED_SINCE), key)
    redis.call('HDEL', name(N.THROTTLED_OWED), key)
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
