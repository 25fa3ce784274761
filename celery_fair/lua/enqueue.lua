-- ENQUEUE: publish one message to its key's list (a producer with fair_keys,
-- or a restore of a keyed message).
-- KEYS: none (the per-key names are built from the queue's name).
-- ARGV: base (the queue's Redis name), sep, default key weight, key, payload,
--       "1" to put it first in line (a restore) else "0", and the suffix of
--       the message's priority level (Kombu's list suffix for its priority:
--       "" for the first level; absent: "").
-- Returns the key's list length in its level, or 0 when the queue was moved
-- back to plain lists (celery-fair keys unkey): then the message goes to
-- Kombu's own list for its priority.
SEP, DFLT = ARGV[2], tonumber(ARGV[3])
local base, key, item = ARGV[1], ARGV[4], ARGV[5]
local level = ARGV[7] or ''
local lb = base .. level
local push = 'LPUSH'
if ARGV[6] == '1' then push = 'RPUSH' end
local state = kname(base, N.STATE)
if redis.call('HEXISTS', state, N.UNKEYED_MARK) == 1 then
  -- Moved back to plain lists: no message may wait where only a keyed fetch reads.
  redis.call(push, lb, item)
  return 0
end
if level ~= '' then redis.call('SADD', kname(base, N.LEVELS), level) end
local list = kname(lb, N.KEY_LIST) .. key
local n = redis.call(push, list, item)
redis.call('HINCRBY', state, N.BACKLOG, 1)
-- Messages waiting per key, all levels together (the exporter's top keys).
redis.call('ZINCRBY', kname(base, N.SIZES), 1, key)
if n == 1 then
  redis.call('ZADD', kname(lb, N.ACTIVE), start_tag(lb, key), key)
end
return n
