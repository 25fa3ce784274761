-- PAUSE: pause or resume keys of keyed queues (control fair_key_pause and
-- fair_key_resume).  A paused key's messages stay in its lists and nothing of
-- it is fetched (keyed_pop.lua sets it aside); its running tasks finish.
-- ARGV: sep, "1" to pause or "0" to resume, then (base, key) pairs.
-- Returns how many of the pairs changed (a key already so is not counted).
SEP = ARGV[1]
local now, n = server_now(), 0
for i = 3, #ARGV, 2 do
  if ARGV[2] == '1' then n = n + pause(ARGV[i], ARGV[i + 1], now)
  else n = n + unpause(ARGV[i], ARGV[i + 1], now) end
end
return n
