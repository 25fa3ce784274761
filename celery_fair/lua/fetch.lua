-- FETCH: the atomic fetch (celery_fair/kombu/atomic.py): pop from the first
-- non-empty queue in the order given (the DWRR order, as Kombu's BRPOP) and write
-- the unacknowledged record (Kombu's unacked hash and index) in the same step.
-- KEYS: n queue keys in fetch order, n matching parking lists
--       (<queue>.fair-malformed), the unacked hash, the unacked index, then the
--       keys an idle fetch watches besides the queue keys (each keyed queue's
--       active-key set and other priority lists: Redis 7.0 tracks the keys an EVAL
--       declares, not the ones its script names at run time).
-- ARGV: n, now (epoch seconds), sep, default key weight,
--       ns and ns suffixes (a keyed queue's other priority lists: its levels),
--       nl and nl (level suffix, weight) pairs: none for strict priority between
--       a keyed queue's levels, else the levels' weights (keyed_pop.lua),
--       nc and nc (base, level suffix, key, user, delta seconds) run-time
--       charges (user: '' for a one-level key),
--       nr and nr (base, delivery tag) releases: key slots of tasks finished
--       since the last fetch (per-key limits; release.lua sends them when no
--       fetch follows),
--       ne and ne bases: the queues whose schedules (fair_eta = "broker") are
--       looked at: before the pop, up to N.ETA_BATCH due messages of each go
--       into their queue (promote.lua), so that a large due backlog is moved
--       over several fetches and never stalls one,
--       batch: the most messages to take from the first queue key (in its
--       fair key order for a keyed queue); a later key is taken from only
--       when the first has nothing to serve, one message,
--       then one word per queue key:
--         "-"                    a plain list;
--         "<charge>"             a keyed queue: its charge at fetch;
--         "L<charge>:<lease s>"  a keyed queue with per-key limits, whose tasks
--                                hold their key's slot for at most <lease s>
--       (the words are built by celery_fair.keys.serving.FetchTerms.fetch_word).
-- Returns {key, item} for a message, {key, item, "key", fair key, key weight,
-- seconds throttled, level suffix, user ('' for a one-level key), seconds paused}
-- for one of a keyed queue
-- (celery_fair.wire.SERVED_HEADER),
-- {key, item, "malformed"} for a payload moved aside (with batch above 1: an
-- array of those, in the order taken), or, when every queue is
-- empty (after reading their lengths, so that client-side tracking watches them),
-- nil or the milliseconds until a key throttled by its limits may go on or the
-- next scheduled message is due.
SEP, DFLT = ARGV[3], tonumber(ARGV[4])
local n = tonumber(ARGV[1])
local ns = tonumber(ARGV[5])
local suffixes = {}
for j = 1, ns do suffixes[j] = ARGV[5 + j] end
local l = 6 + ns
local nl = tonumber(ARGV[l])
local lweights = nil
if nl > 0 then
  lweights = {}
  for j = 0, nl - 1 do lweights[ARGV[l + 2 * j + 1]] = ARGV[l + 2 * j + 2] end
end
local a = l + 2 * nl + 1
local nc = tonumber(ARGV[a])
for j = 0, nc - 1 do
  local c = a + 5 * j
  charge(ARGV[c + 1], ARGV[c + 2], ARGV[c + 3], tonumber(ARGV[c + 5]), ARGV[c + 4])
end
local r = a + 5 * nc + 1
local nr = tonumber(ARGV[r])
local now = nil
if nr > 0 then
  -- Freed before the pop, so that the key of a task just finished may be served.
  now = server_now()
  for j = 0, nr - 1 do release(ARGV[r + 2 * j + 1], ARGV[r + 2 * j + 2], now) end
end
local e = r + 2 * nr + 1
local ne = tonumber(ARGV[e])
if ne > 0 then
  now = now or server_now()
  for j = 1, ne do promote_due(ARGV[e + j], now, N.ETA_BATCH) end
end
local batch = tonumber(ARGV[e + ne + 1])
local flags = e + ne + 1
-- One message of the queue key i, recorded as unacknowledged (and leased), as
-- its reply entry; nil when the key has nothing to serve now.
local calls = {}  -- per keyed queue key: what keyed_pop does once per call
local function take(i)
  local item, fkey, fweight, fthrottled, flevel, fuser, fpaused, ttl = nil, nil, nil, nil, nil, nil, nil, nil
  local word = ARGV[flags + i]
  if word ~= '-' and not calls[i] then calls[i] = {} end
  if word == '-' then item = redis.call('RPOP', KEYS[i])
  elseif string.sub(word, 1, 1) == 'L' then
    -- A keyed queue with per-key limits: "L<charge>:<lease seconds>".
    local sep = string.find(word, ':', 2, true)
    ttl = tonumber(string.sub(word, sep + 1))
    now = now or server_now()
    item, fkey, fweight, fthrottled, flevel, fuser, fpaused = keyed_pop(
      KEYS[i], suffixes, tonumber(string.sub(word, 2, sep - 1)), true, now, lweights, calls[i])
  else
    item, fkey, fweight, fthrottled, flevel, fuser, fpaused = keyed_pop(
      KEYS[i], suffixes, tonumber(word), false, 0, lweights, calls[i])
  end
  if not item then return nil end
  local tag, record = unacked_record(item)
  if not tag then
    park(KEYS[n + i], item, ARGV[2])
    return {KEYS[i], item, 'malformed'}
  end
  record_unacked(KEYS[2 * n + 1], KEYS[2 * n + 2], ARGV[2], tag, record)
  if ttl then
    -- The task holds a slot of its key until it finishes (or the lease expires).
    lease(KEYS[i], fkey, tag, now, ttl)
  end
  if fkey then
    return {KEYS[i], item, 'key', fkey, fweight, fthrottled or '0', flevel, fuser or '',
            fpaused or '0'}
  end
  return {KEYS[i], item}
end
for i = 1, n do
  local entry = take(i)
  if entry then
    if batch <= 1 then return entry end
    local out = {entry}
    -- More of the same key while it has them: only the first key may batch.
    while i == 1 and #out < batch do
      entry = take(1)
      if not entry then break end
      out[#out + 1] = entry
    end
    return out
  end
end
for i = 1, n do redis.call('LLEN', KEYS[i]) end
for j = 2 * n + 3, #KEYS do redis.call('EXISTS', KEYS[j]) end
-- Limited queues: when a key set aside may go on by itself (its rate, an
-- expiring lease), tell the caller how long to wait at most (milliseconds).
local soonest = nil
for i = 1, n do
  if string.sub(ARGV[flags + i], 1, 1) == 'L' then
    local due = next_event(KEYS[i], now or server_now())
    if due and (not soonest or due < soonest) then soonest = due end
  end
end
for j = 1, ne do
  local due = next_due(ARGV[e + j], now)
  if due and (not soonest or due < soonest) then soonest = due end
end
if soonest then return math.floor(soonest * 1000) + 1 end
return nil
