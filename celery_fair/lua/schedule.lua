-- SCHEDULE: a producer with fair_eta = "broker" puts a message whose eta is in
-- the future in its queue's schedule (promote.lua), not in the queue.
-- KEYS: none (the names are built from the queue's name).
-- ARGV: base (the queue's Redis name), sep, due (epoch seconds), the envelope
--       (promote.lua), the message's key ('' for a plain message), and the
--       key's backlog cap ('' for none).
-- The cap is checked as a publish checks it, against the key's messages
-- waiting now (the scheduled ones are not counted): the producer is told now,
-- when it can still act; the message is never refused when it comes due.
-- Returns 1 (scheduled), or {"full", backlog} when the key already has its cap
-- of messages waiting (nothing is written).
SEP = ARGV[2]
local base, due, envelope, key = ARGV[1], ARGV[3], ARGV[4], ARGV[5]
local cap = tonumber(ARGV[6] or '')
if cap and key ~= N.UNKEYED then
  local waiting = tonumber(redis.call('ZSCORE', kname(base, N.SIZES), key)) or 0
  if waiting >= cap then return {'full', waiting} end
end
local sched = kname(base, N.SCHEDULE)
local first = redis.call('ZRANGE', sched, 0, 0, 'WITHSCORES')
redis.call('ZADD', sched, due, envelope)
if #first == 0 or tonumber(due) < tonumber(first[2]) then
  -- Due before every other: idle fetches watch this key (fetch.lua), and
  -- wake to wait for this one instead.
  redis.call('SET', kname(base, N.SCHEDULE_NEXT), due)
end
if key ~= N.UNKEYED and key ~= '' then
  redis.call('ZINCRBY', kname(base, N.SCHEDULED_KEYS), 1, key)
end
return 1
