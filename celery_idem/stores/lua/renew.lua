-- Fenced: extend the caller's lease to now + lease.
-- KEYS[1] the record hash    ARGV[1] token    ARGV[2] lease (ms)
-- Returns the new lease expiry (ms), or 'fenced:<state>:<token>' / 'missing'.
local r = redis.call('HMGET', KEYS[1], 's', 't')
if not r[1] then return 'missing' end
if tonumber(r[2]) ~= tonumber(ARGV[1]) or r[1] ~= 'in_progress' then
  return 'fenced:' .. r[1] .. ':' .. r[2]
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'l', expires)
-- The record must outlive the lease: a body running past the TTL keeps its record (and with it
-- the token that fences every earlier holder).
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return expires
