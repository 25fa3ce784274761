-- Scheduled messages (fair_eta = "broker"): a queue's schedule is a sorted set,
-- <queue><SEP>fair.eta, of envelopes scored by when each message is due (epoch
-- seconds, the producer's reading of the task's eta).  An envelope is a JSON
-- object: "m" the Kombu payload, "l" the suffix of its priority level ('' for
-- the first), and for a keyed message "k" its key and, with two-level keys,
-- "u" its user.  <queue><SEP>fair.etakeys counts each key's scheduled messages
-- (schedule.lua adds, the promotion takes away).  Needs prelude.lua and
-- enqueue_one.lua before it.

-- One message of ``key`` left the schedule of ``base``.
local function unschedule_key(base, key)
  local counts = kname(base, N.SCHEDULED_KEYS)
  if tonumber(redis.call('ZINCRBY', counts, -1, key)) <= 0 then
    redis.call('ZREM', counts, key)
  end
end

-- Move up to ``limit`` messages of queue ``base`` due by ``now`` (the broker's
-- clock) into their queue, in due order: a keyed one to the tail of its key's
-- list with the keyed publish's bookkeeping (never refused by a backlog cap, as
-- a restore), a plain one to the tail of Kombu's list for its priority (LPUSH,
-- as Kombu publishes).  The ZREM and the push are in the same script: a due
-- message is moved once, and is always in one place.  Returns how many moved.
local function promote_due(base, now, limit)
  local sched = kname(base, N.SCHEDULE)
  local upto = '+inf'
  if now < math.huge then upto = string.format('%.6f', now) end
  local due = redis.call('ZRANGEBYSCORE', sched, '-inf', upto, 'LIMIT', 0, limit)
  for _, entry in ipairs(due) do
    redis.call('ZREM', sched, entry)
    local ok, e = pcall(cjson.decode, entry)
    if ok and type(e) == 'table' and type(e['m']) == 'string' then
      local level, key, user = e['l'], e['k'], e['u']
      if type(level) ~= 'string' then level = '' end
      if type(user) ~= 'string' then user = nil end
      if type(key) == 'string' and key ~= N.UNKEYED then
        if key ~= '' then unschedule_key(base, key) end
        enqueue_message(base, key, e['m'], false, level, nil, nil, user)
      else
        redis.call('LPUSH', base .. level, e['m'])
      end
    else
      -- Not an envelope of ours: into the queue's list as it is, where the
      -- fetch parks what is not a message (never dropped).
      redis.call('LPUSH', base, entry)
    end
  end
  return #due
end

-- Seconds until the next message of ``base``'s schedule is due (0 if one is
-- due already), or nil when its schedule is empty.
local function next_due(base, now)
  local top = redis.call('ZRANGE', kname(base, N.SCHEDULE), 0, 0, 'WITHSCORES')
  if #top == 0 then return nil end
  return math.max(0, tonumber(top[2]) - now)
end
