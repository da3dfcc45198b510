-- Fenced: turn the caller's in_progress record into done/failed.
-- KEYS[1] the record hash
-- ARGV[1] token   ARGV[2] state ('done'|'failed')   ARGV[3] content type   ARGV[4] data
-- ARGV[5] ttl (ms)
-- Returns 'ok', or 'fenced:<state>:<token>' / 'missing' when the caller no longer holds the key.
local r = redis.call('HMGET', KEYS[1], 's', 't')
if not r[1] then return 'missing' end
if tonumber(r[2]) ~= tonumber(ARGV[1]) then return 'fenced:' .. r[1] .. ':' .. r[2] end
-- The holder retrying a record whose reply it lost: already written, nothing to do.
if r[1] == ARGV[2] then return 'ok' end
if r[1] ~= 'in_progress' then return 'fenced:' .. r[1] .. ':' .. r[2] end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 's', ARGV[2], 'c', ARGV[3], 'd', ARGV[4], 'u', now)
-- Who held the claim and at which attempt no longer matters once the outcome is known: drop
-- them to keep a done record small (the task id stays: it is the original task id).
redis.call('HDEL', KEYS[1], 'l', 'o', 'a')
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 'ok'
