-- Fenced: give the claim back. The hash stays as a 'released' tombstone that keeps the token,
-- so the next claim gets token + 1 and a stale holder can never match again.
-- KEYS[1] the record hash    ARGV[1] token
-- Returns 'ok', or 'fenced:<state>:<token>' / 'missing'.
local r = redis.call('HMGET', KEYS[1], 's', 't')
if not r[1] then return 'missing' end
if tonumber(r[2]) ~= tonumber(ARGV[1]) or r[1] ~= 'in_progress' then
  return 'fenced:' .. r[1] .. ':' .. r[2]
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HDEL', KEYS[1], 'o', 'i', 'a', 'l', 'h', 'c', 'd')
redis.call('HSET', KEYS[1], 's', 'released', 'u', now)
return 'ok'
