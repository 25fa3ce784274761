-- Helpers of the scripts that pop Kombu messages (fetch.lua, take.lua): each
-- popped message is recorded as unacknowledged in the same step as its pop,
-- so that after any crash it is in its queue or in the unacked index, where
-- Kombu's visibility timeout restores it.

-- The "properties" object of a Kombu message, read from the payload's tail.
-- Kombu writes it as the last member of the message, so the text after the
-- last '"properties":' up to the closing brace is that object alone; decoding
-- it costs a third of decoding a Celery message whole (its body and headers).
-- Any other layout leaves text that is not one JSON value (a key of that name
-- nested in the headers leaves their closing braces, an earlier member the
-- ones after it; a string cannot hold the unescaped quote): cjson refuses it,
-- and the caller decodes the whole payload.
local function tail_properties(item)
  local at, from = nil, 1
  while true do
    local _, stop = string.find(item, '"properties":', from, true)
    if not stop then break end
    at, from = stop, stop + 1
  end
  if not at then return nil end
  local ok, props = pcall(cjson.decode, string.sub(item, at + 1, #item - 1))
  if ok and type(props) == 'table' and string.sub(item, -1) == '}' then return props end
  return nil
end

-- A popped payload's delivery tag and Kombu's unacked record of it,
-- [payload, exchange, routing key] (kombu.transport.redis, QoS.append).
-- The tag is nil for a payload that is not a Kombu message.
local function unacked_record(item)
  local props = tail_properties(item)
  if not props then
    local ok, msg = pcall(cjson.decode, item)
    if ok and type(msg) == 'table' then props = msg['properties'] end
  end
  local tag, ex, rk = nil, '', ''
  if type(props) == 'table' then
    tag = props['delivery_tag']
    local info = props['delivery_info']
    if type(info) == 'table' then
      if type(info['exchange']) == 'string' then ex = info['exchange'] end
      if type(info['routing_key']) == 'string' then rk = info['routing_key'] end
    end
  end
  if type(tag) ~= 'string' then return nil, nil end
  return tag, '[' .. item .. ',' .. cjson.encode(ex) .. ',' .. cjson.encode(rk) .. ']'
end

-- Kombu's two structures: the unacked hash (tag -> record) and index (tag by time).
local function record_unacked(hash, index, now, tag, record)
  redis.call('ZADD', index, now, tag)
  redis.call('HSET', hash, tag, record)
end

-- A payload that is not a Kombu message is parked with its reason and time
-- (celery_fair.parked), never dropped.
local function park(list, item, now)
  redis.call('LPUSH', list, cjson.encode({fair_parked = 1, reason = N.NOT_A_MESSAGE,
    parked_at = tonumber(now), raw = item}))
end
