-- Atomically claim one idempotency key (see Store.claim for the decision order).
-- KEYS[1]  the record
-- ARGV[1]  owner          ARGV[2] task id      ARGV[3] attempt (request.retries)
-- ARGV[4]  lease (ms)     ARGV[5] ttl (ms)     ARGV[6] payload hash ('' = do not validate)
-- ARGV[7]  the claim id to store if this claim takes the key
-- Returns  {status, token, now_ms, the record BEFORE the claim (its stored string) or nil}.

-- (parse, IN_PROGRESS_TAIL come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
local clock = redis.call('TIME')
local seconds, micros = tonumber(clock[1]), tonumber(clock[2])
local now = seconds * 1000 + math.floor(micros / 1000)
local token = 0

-- The new token is max(previous + 1, server clock in microseconds): above every earlier token
-- while the record exists, and above the lost one when the server lost it (a FLUSHALL, a
-- restart without persistence, a failover), since that one was issued at an earlier clock.
-- It stays below 2^53 (a double holds it exactly) until the year 2255. '%.0f', not '..': Lua
-- 5.1 writes a number with 14 significant digits ('1.7970000000000e+15').
local function take(status)
  local t = string.format('%.0f', math.max(token + 1, seconds * 1000000 + micros))
  redis.call('SET', KEYS[1], '\193i' .. t .. '.' .. ARGV[7] .. '\0' .. now .. '\0' .. ARGV[2] ..
             '\0' .. ARGV[6] .. '\0' .. ARGV[1] .. '\0' .. ARGV[3] .. '\0' ..
             (now + tonumber(ARGV[4])), 'PX', ARGV[5])
  return {status, t, now, v}
end

if not v then
  return take('claimed')
end
local state, t, _, _, task_id, hash, tail = parse(v)
if not state then
  return {'corrupt', 0, now, v}  -- not written by celery_idem: left alone
end
token = tonumber(t)
if state == 'r' then
  return take('claimed')
end
-- A validating caller refuses a record without a hash too: it cannot show it is this action.
if ARGV[6] ~= '' and hash ~= ARGV[6] then
  return {'mismatch', t, now, v}
end
if state == 'd' then
  return {'done', t, now, v}
end
if state == 'f' then
  return {'failed', t, now, v}
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
return {'busy', t, now, v}
