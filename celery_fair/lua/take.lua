-- TAKE: fill a FairConsumerMixin window on Redis (celery_fair/kombu/take.py):
-- pop up to <count> messages of one queue, from its priority lists in order
-- (as Kombu's Redis transport gets one), each recorded as unacknowledged in
-- the same step (as FETCH does for the one it pops).
-- ARGV: n, now (epoch seconds), count, then the queue's n lists in priority
--       order, its parking list (<queue>.fair-malformed), the unacked hash and
--       the unacked index.
-- Returns {the payloads taken, in order; how many were parked}.
local n, count = tonumber(ARGV[1]), tonumber(ARGV[3])
local now = ARGV[2]
local parking, hash, index = ARGV[4 + n], ARGV[5 + n], ARGV[6 + n]
local taken, parked = {}, 0
for i = 1, n do
  while #taken < count do
    local item = redis.call('RPOP', ARGV[3 + i])
    if not item then break end
    local tag, record = unacked_record(item)
    if tag then
      record_unacked(hash, index, now, tag, record)
      taken[#taken + 1] = item
    else
      park(parking, item, now)
      parked = parked + 1
    end
  end
end
return {taken, parked}
