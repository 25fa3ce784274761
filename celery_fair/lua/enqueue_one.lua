-- Put one message in its key's list: the keyed publish's bookkeeping, shared by
-- enqueue.lua (a publish or a restore) and promote.lua (a scheduled message
-- that came due).  SEP and DFLT are set by the calling script.
-- base: the queue's Redis name; key, item: the key and the payload; restore:
-- true to put it first in line (RPUSH) and never refuse it; level: the suffix
-- of its priority level ('' for the first); cap: the key's backlog cap (nil:
-- none); order: for a restore, the publish time that keeps publish order among
-- the messages restored before it (nil: none); user: the user within the key
-- for two-level keys (nil: a one-level key).
-- Returns the key's list length in its level (a two-level key: its user's), 0
-- when the queue was moved back to plain lists (the message went to Kombu's
-- own list for its priority), or {"full", backlog} (nothing written).
local function enqueue_message(base, key, item, restore, level, cap, order, user)
  local lb = base .. level
  local push = 'LPUSH'
  if restore then push = 'RPUSH' end
  local state = kname(base, N.STATE)
  if redis.call('HEXISTS', state, N.UNKEYED_MARK) == 1 then
    -- Moved back to plain lists: no message may wait where only a keyed fetch reads.
    redis.call(push, lb, item)
    return 0
  end
  -- Messages waiting per key, all levels and users together (the cap, the exporter's top keys).
  local sizes = kname(base, N.SIZES)
  if cap and not restore then
    local waiting = tonumber(redis.call('ZSCORE', sizes, key)) or 0
    if waiting >= cap then return {'full', waiting} end
  end
  if level ~= '' then redis.call('SADD', kname(base, N.LEVELS), level) end
  -- A restore to the front with a publish time goes behind the messages restored
  -- before it that were published earlier (workers that return their prefetched
  -- tasks of a paused key one after another): publish order holds.  Only
  -- restored messages are older than the list's own, so a few are looked at.
  local function push_in_order(list)
    if not (restore and order) then return redis.call(push, list, item) end
    local ahead = {}
    while #ahead < 256 do
      local head = redis.call('LINDEX', list, -1)
      if not head then break end
      local ok, msg = pcall(cjson.decode, head)
      local t = ok and type(msg) == 'table' and type(msg['headers']) == 'table'
                and tonumber(msg['headers'][N.PUBLISHED_HEADER])
      if not t or t >= order then break end
      ahead[#ahead + 1] = redis.call('RPOP', list)
    end
    local n = redis.call('RPUSH', list, item)
    for i = #ahead, 1, -1 do n = redis.call('RPUSH', list, ahead[i]) end
    return n
  end
  local n, joins
  if user == nil then
    n = push_in_order(kname(lb, N.KEY_LIST) .. key)
    joins = n == 1
  else
    local users = users_name(lb, key)
    -- The key joins its level's line with its first user waiting there.
    joins = redis.call('EXISTS', users) == 0
    n = push_in_order(user_list(lb, key, user))
    if n == 1 then redis.call('ZADD', users, user_start_tag(lb, key, user), user) end
  end
  redis.call('HINCRBY', state, N.BACKLOG, 1)
  redis.call('ZINCRBY', sizes, 1, key)
  if joins then
    redis.call('ZADD', kname(lb, N.ACTIVE), start_tag(lb, key), key)
  end
  return n
end
