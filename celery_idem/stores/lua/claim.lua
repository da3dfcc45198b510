-- Atomically claim one idempotency key (see Store.claim for the decision order).
-- KEYS[1]  the record
-- ARGV[1]  owner          ARGV[2] task id      ARGV[3] attempt (request.retries)
-- ARGV[4]  lease (ms)     ARGV[5] ttl (ms)     ARGV[6] payload hash ('' = do not validate)
-- Returns  {status, token, now_ms, the record BEFORE the claim (its stored string) or nil}.

-- (parse, IN_PROGRESS_TAIL and now_ms come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
local now = now_ms()
local token = 0

local function take(status)
  token = token + 1
  redis.call('SET', KEYS[1], '\193i' .. token .. '\0' .. now .. '\0' .. ARGV[2] .. '\0' ..
             ARGV[6] .. '\0' .. ARGV[1] .. '\0' .. ARGV[3] .. '\0' .. (now + tonumber(ARGV[4])),
             'PX', ARGV[5])
  return {status, token, now, v}
end

if not v then
  return take('claimed')
end
local state, t, _, task_id, hash, tail = parse(v)
if not state then
  return {'corrupt', 0, now, v}  -- not written by celery_idem: left alone
end
token = tonumber(t)
if state == 'r' then
  return take('claimed')
end
if ARGV[6] ~= '' and hash ~= '' and hash ~= ARGV[6] then
  return {'mismatch', token, now, v}
end
if state == 'd' then
  return {'done', token, now, v}
end
if state == 'f' then
  return {'failed', token, now, v}
end
local attempt, lease = string.match(v, '^[^%z]*%z(%d+)%z(%d+)$', tail)
if not attempt then
  return {'corrupt', 0, now, v}
end
local lease_expired = tonumber(lease) <= now
local earlier_attempt_of_same_task = task_id == ARGV[2] and tonumber(ARGV[3]) > tonumber(attempt)
if lease_expired or earlier_attempt_of_same_task then
  return take('takeover')
end
return {'busy', token, now, v}
