-- Fenced: extend the caller's lease to now + lease.
-- KEYS[1] the record    ARGV[1] token    ARGV[2] lease (ms)
-- ARGV[3] claim id ('' or absent = the token alone)
-- Returns the new lease expiry (ms), 'fenced:<state code>:<token>' / 'reissued:...' /
-- 'missing', or 'corrupt'.

-- (parse, same_claim, refusal and now_ms come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t, claim_id, _, _, _, tail = parse(v)
if not state then return 'corrupt' end
if state ~= 'i' then return 'fenced:' .. state .. ':' .. t end
if not same_claim(t, claim_id, ARGV[1], ARGV[3]) then
  return refusal(state, t, claim_id, ARGV[1])
end
-- The lease expiry is the last field: keep everything before it.
local at = string.match(v, '^[^%z]*%z%d+%z()%d+$', tail)
if not at then return 'corrupt' end
local lease = tonumber(ARGV[2])
local expires = now_ms() + lease
local value = string.sub(v, 1, at - 1) .. expires
-- The record must outlive the lease: a body running past the TTL keeps its record (and with it
-- the token that fences every earlier holder).
if redis.call('PTTL', KEYS[1]) < lease then
  redis.call('SET', KEYS[1], value, 'PX', lease)
else
  redis.call('SET', KEYS[1], value, 'KEEPTTL')
end
return expires
