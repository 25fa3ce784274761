-- ENQUEUE: publish one message to its key's list (a producer with fair_keys,
-- or a restore of a keyed message).
-- KEYS: none (the per-key names are built from the queue's name).
-- ARGV: base (the queue's Redis name), sep, default key weight, key, payload,
--       "1" to put it first in line (a restore) else "0".
-- Returns the key's list length, or 0 when the queue was moved back to plain
-- lists (celery-fair keys unkey): then the message goes to the queue's own list.
SEP, DFLT = ARGV[2], tonumber(ARGV[3])
local base, key, item = ARGV[1], ARGV[4], ARGV[5]
local push = 'LPUSH'
if ARGV[6] == '1' then push = 'RPUSH' end
local state = kname(base, N.STATE)
if redis.call('HEXISTS', state, N.UNKEYED_MARK) == 1 then
  -- Moved back to plain lists: no message may wait where only a keyed fetch reads.
  redis.call(push, base, item)
  return 0
end
local list = kname(base, N.KEY_LIST) .. key
local n = redis.call(push, list, item)
redis.call('HINCRBY', state, N.BACKLOG, 1)
redis.call('ZADD', kname(base, N.SIZES), n, key)
if n == 1 then
  redis.call('ZADD', kname(base, N.ACTIVE), start_tag(base, key), key)
end
return n
