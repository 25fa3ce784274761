-- PROMOTE: move the due messages of one queue's schedule into the queue
-- (promote.lua), outside a fetch: tests, and tools that move a schedule.
-- KEYS: none.
-- ARGV: base (the queue's Redis name), sep, limit (the most messages moved by
--       this call), and the time to compare due times with ('' for the
--       broker's clock; "+inf" moves every message, due or not).
-- Returns {messages moved, messages left in the schedule}.
SEP, DFLT = ARGV[2], 1
local base, limit = ARGV[1], tonumber(ARGV[3])
local now = server_now()
if ARGV[4] == '+inf' then now = math.huge
elseif ARGV[4] and ARGV[4] ~= '' then now = tonumber(ARGV[4]) end
local moved = promote_due(base, now, limit)
return {moved, redis.call('ZCARD', kname(base, N.SCHEDULE))}
