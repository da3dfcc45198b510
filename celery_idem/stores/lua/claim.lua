-- Atomically claim one idempotency key (see Store.claim for the decision order).
-- KEYS[1]  the record hash
-- ARGV[1]  owner          ARGV[2] task id      ARGV[3] attempt (request.retries)
-- ARGV[4]  lease (ms)     ARGV[5] ttl (ms)     ARGV[6] payload hash ('' = do not validate)
-- Returns  {status, token, now_ms, s, t, o, i, a, l, h, c, d, u} - the record BEFORE the claim.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 's', 't', 'o', 'i', 'a', 'l', 'h', 'c', 'd', 'u')
local state = r[1]
local token = tonumber(r[2]) or 0

local function reply(status, tok)
  return {status, tok, now, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10]}
end

local function take(status)
  token = token + 1
  redis.call('HSET', KEYS[1], 's', 'in_progress', 't', token, 'o', ARGV[1], 'i', ARGV[2],
             'a', ARGV[3], 'l', now + tonumber(ARGV[4]), 'h', ARGV[6], 'u', now)
  redis.call('HDEL', KEYS[1], 'c', 'd')
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return reply(status, token)
end

if not state or state == 'released' then
  return take('claimed')
end
if ARGV[6] ~= '' and r[7] and r[7] ~= '' and r[7] ~= ARGV[6] then
  return reply('mismatch', token)
end
if state == 'done' or state == 'failed' then
  return reply(state, token)
end
if state ~= 'in_progress' then
  return reply('corrupt', token)
end
local lease_expired = (tonumber(r[6]) or 0) <= now
local earlier_attempt_of_same_task = r[4] == ARGV[2] and tonumber(ARGV[3]) > (tonumber(r[5]) or 0)
if lease_expired or earlier_attempt_of_same_task then
  return take('takeover')
end
return reply('busy', token)
