-- Fenced: give the claim back. The record stays as a 'released' tombstone that keeps the token
-- (and the TTL), so the next claim gets token + 1 and a stale holder can never match again.
-- KEYS[1] the record    ARGV[1] token
-- Returns 'ok', 'fenced:<state code>:<token>' / 'missing', or 'corrupt' (not a record).

-- The record format (celery_idem/stores/redis.py documents it): one string
--   '\193' <state> <token> \0 <updated ms> \0 <task id> \0 <payload hash> \0 <tail>
-- state: i in_progress, d done, f failed, r released. Each script carries these few lines:
-- the store sends the file as it is (its SHA1 is the file's).

-- state, token, updated, task id, payload hash, position of the tail; nil when v is not a record.
local function parse(v)
  return string.match(v, '^\193([idfr])(%d+)%z(%d+)%z([^%z]*)%z([^%z]*)%z()')
end

-- What follows the header of an in_progress record: owner, attempt, lease expiry.
local IN_PROGRESS_TAIL = '^[^%z]*%z%d+%z%d+$'

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t, _, _, _, tail = parse(v)
if not state or state == 'i' and not string.find(v, IN_PROGRESS_TAIL, tail) then
  return 'corrupt'
end
if tonumber(t) ~= tonumber(ARGV[1]) or state ~= 'i' then
  return 'fenced:' .. state .. ':' .. t
end
redis.call('SET', KEYS[1], '\193r' .. t .. '\0' .. now_ms() .. '\0\0\0', 'KEEPTTL')
return 'ok'
