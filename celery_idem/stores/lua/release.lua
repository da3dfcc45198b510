-- Fenced: give the claim back. The record stays as a 'released' tombstone that keeps the token
-- (and the TTL), so the next claim gets token + 1 and a stale holder can never match again.
-- KEYS[1] the record    ARGV[1] token
-- Returns 'ok', 'fenced:<state code>:<token>' / 'missing', or 'corrupt' (not a record).

-- (parse_whole and now_ms come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t = parse_whole(v)
if not state then return 'corrupt' end
if tonumber(t) ~= tonumber(ARGV[1]) or state ~= 'i' then
  return 'fenced:' .. state .. ':' .. t
end
redis.call('SET', KEYS[1], '\193r' .. t .. '\0' .. now_ms() .. '\0\0\0', 'KEEPTTL')
return 'ok'
