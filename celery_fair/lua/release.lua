-- RELEASE: free the key slots of finished tasks (per-key limits).
-- ARGV: sep, default key weight, then (base, delivery tag) pairs: a lease is
--       named by its message's delivery tag.
-- Returns how many leases were found (an unknown tag frees nothing).
SEP, DFLT = ARGV[1], tonumber(ARGV[2])
local n, now = 0, server_now()
for i = 3, #ARGV, 2 do n = n + release(ARGV[i], ARGV[i + 1], now) end
return n
