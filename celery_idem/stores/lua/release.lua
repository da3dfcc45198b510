-- Fenced: give the claim back. The record stays as a 'released' tombstone that keeps the token
-- (and the TTL), so the next claim gets a higher token and a stale holder can never match again.
-- KEYS[1] the record    ARGV[1] token    ARGV[2] claim id ('' or absent = the token alone)
-- Returns 'ok', 'fenced:<state code>:<token>' / 'reissued:...' / 'missing', or 'corrupt'.

-- (parse_whole, same_claim, refusal and now_ms come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t, claim_id = parse_whole(v)
if not state then return 'corrupt' end
if state ~= 'i' then return 'fenced:' .. state .. ':' .. t end
if not same_claim(t, claim_id, ARGV[1], ARGV[2]) then
  return refusal(state, t, claim_id, ARGV[1])
end
redis.call('SET', KEYS[1], '\193r' .. t .. '\0' .. now_ms() .. '\0\0\0', 'KEEPTTL')
return 'ok'
