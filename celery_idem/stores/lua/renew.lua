-- Fenced: extend the caller's lease to now + lease.
-- KEYS[1] the record    ARGV[1] token    ARGV[2] lease (ms)
-- Returns the new lease expiry (ms), 'fenced:<state code>:<token>' / 'missing', or 'corrupt'.

-- The record format (celery_idem/stores/redis.py documents it): one string
--   '\193' <state> <token> \0 <updated ms> \0 <task id> \0 <payload hash> \0 <tail>
-- state: i in_progress, d done, f failed, r released. Each script carries these few lines:
-- the store sends the file as it is (its SHA1 is the file's).

-- state, token, updated, task id, payload hash, position of the tail; nil when v is not a record.
local function parse(v)
  return string.match(v, '^\193([idfr])(%d+)%z(%d+)%z([^%z]*)%z([^%z]*)%z()')
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t, _, _, _, tail = parse(v)
if not state then return 'corrupt' end
if tonumber(t) ~= tonumber(ARGV[1]) or state ~= 'i' then
  return 'fenced:' .. state .. ':' .. t
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
