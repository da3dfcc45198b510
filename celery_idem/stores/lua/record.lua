-- Fenced: turn the caller's in_progress record into done/failed.
-- KEYS[1] the record hash        KEYS[2] (optional) Celery's result key for this task
-- ARGV[1] token   ARGV[2] state ('done'|'failed')   ARGV[3] content type   ARGV[4] data
-- ARGV[5] ttl (ms)
-- ARGV[6] (with KEYS[2]) the result backend's encoded meta   ARGV[7] its expiry (s, 0 = none)
-- Returns 'ok' ('ok:nometa' when the meta write was refused), or 'fenced:<state>:<token>' /
-- 'missing' when the caller no longer holds the key.
local r = redis.call('HMGET', KEYS[1], 's', 't')
if not r[1] then return 'missing' end
if tonumber(r[2]) ~= tonumber(ARGV[1]) then return 'fenced:' .. r[1] .. ':' .. r[2] end

-- The result backend's own write (SET + PUBLISH, what Celery's Redis backend does), folded into
-- this round trip and made only by the fenced holder. pcall: a refused meta write (an ACL, say)
-- must not fail the record; Celery then writes the meta itself.
local function meta()
  if not KEYS[2] then return 'ok' end
  local set
  if tonumber(ARGV[7]) > 0 then
    set = redis.pcall('SET', KEYS[2], ARGV[6], 'EX', ARGV[7])
  else
    set = redis.pcall('SET', KEYS[2], ARGV[6])
  end
  if type(set) == 'table' and set.err then return 'ok:nometa' end
  local pub = redis.pcall('PUBLISH', KEYS[2], ARGV[6])
  if type(pub) == 'table' and pub.err then return 'ok:nometa' end
  return 'ok'
end

-- The holder retrying a record whose reply it lost: already written (the meta too, unless it
-- was refused: writing it again is harmless).
if r[1] == ARGV[2] then return meta() end
if r[1] ~= 'in_progress' then return 'fenced:' .. r[1] .. ':' .. r[2] end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 's', ARGV[2], 'c', ARGV[3], 'd', ARGV[4], 'u', now)
-- Who held the claim and at which attempt no longer matters once the outcome is known: drop
-- them to keep a done record small (the task id stays: it is the original task id).
redis.call('HDEL', KEYS[1], 'l', 'o', 'a')
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return meta()
