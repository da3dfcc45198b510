-- Write (replace) a key's intent and index it by its deadline: the intend script
-- (stores/redis_intents.py) and the enqueue check within the publish (publish.lua) both call it.
-- Times in the server's milliseconds: enqueued and sent are now, the deadline max(now, eta) +
-- relay_after, the expiry now + ttl; the hash is kept an hour past its expiry, so a relay sees it
-- stale and reports it before it goes.
local function write_intent(ikey, index, task_id, queue, message, relay_after, ttl, eta, member)
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local d = now
  if tonumber(eta) > d then d = tonumber(eta) end
  d = d + tonumber(relay_after)
  local x = now + tonumber(ttl)
  -- Every field is set (an intent's hash has no others): no DEL of the one it replaces.
  redis.call('HSET', ikey, 't', task_id, 'q', queue, 'm', message, 'e', now, 'd', d, 'x', x,
             's', now)
  redis.call('PEXPIRE', ikey, x - now + 3600000)
  redis.call('ZADD', index, d, member)
  return {now, d, x}
end
