-- Fenced: forget an outcome (an operator's `celery -A app idem forget`, after a refund, say).
-- A done or failed record becomes a 'released' tombstone that keeps the token (and the TTL),
-- exactly as release.lua leaves a claim: the next claim runs the body with token + 1, so a
-- remote that refuses lower tokens still refuses every earlier holder.
-- KEYS[1] the record    ARGV[1] token
-- Returns 'ok', 'fenced:<state code>:<token>' / 'missing', or 'corrupt' (not a record).

-- (parse_whole and now_ms come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t = parse_whole(v)
if not state then return 'corrupt' end
if tonumber(t) ~= tonumber(ARGV[1]) or (state ~= 'd' and state ~= 'f') then
  return 'fenced:' .. state .. ':' .. t
end
redis.call('SET', KEYS[1], '\193r' .. t .. '\0' .. now_ms() .. '\0\0\0', 'KEEPTTL')
return 'ok'
