-- Write (replace) a key's intent and index it by its deadline: the intend script
-- (stores/redis_intents.py) and the enqueue check within the publish (publish.lua) both call it.
-- spec (redis_intents.intent_spec): "<relay after> <ttl> <eta> <task id's length> <queue's
-- length>\n<task id><queue><head of the message>", then message: the rest of it. Times in the
-- server's milliseconds: enqueued and sent are now, the deadline max(now, eta) + relay_after, the
-- expiry now + ttl. The intent is one string, "<enqueued> <deadline> <expires> <sent>" and the
-- spec's part from the lengths on, then message: one SET writes it with its expiry (on the
-- enqueue's hot path: cheaper than a hash's fields and a PEXPIRE), kept an hour past its expiry
-- so a relay sees it stale and reports it before it goes.
local function write_intent(ikey, index, member, spec, message)
  local relay_after, ttl, eta, rest = string.match(spec, '^(%S+) (%S+) (%S+) (.*)$')
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local d = now
  eta = tonumber(eta)
  if eta > d then d = eta end
  d = d + tonumber(relay_after)
  ttl = tonumber(ttl)
  local x = now + ttl
  redis.call('SET', ikey, string.format('%d %d %d %d ', now, d, x, now) .. rest .. message,
             'PX', ttl + 3600000)
  redis.call('ZADD', index, d, member)
  return {now, d, x}
end
