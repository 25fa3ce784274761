-- Helpers of the scripts that pop Kombu messages (fetch.lua, take.lua): each
-- popped message is recorded as unacknowledged in the same step as its pop,
-- so that after any crash it is in its queue or in the unacked index, where
-- Kombu's visibility timeout restores it.

-- A popped payload's delivery tag and Kombu's unacked record of it,
-- [payload, exchange, routing key] (kombu.transport.redis, QoS.append).
-- The tag is nil for a payload that is not a Kombu message.
local function unacked_record(item)
  local ok, msg = pcall(cjson.decode, item)
  local tag, ex, rk = nil, '', ''
  if ok and type(msg) == 'table' and type(msg['properties']) == 'table' then
    local props = msg['properties']
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
