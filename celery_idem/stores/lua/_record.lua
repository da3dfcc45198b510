-- Shared by every script: celery_idem/stores/redis.py prepends this file to each one before
-- registering it, so the record's format is parsed in one place.
--
-- The record format (celery_idem/stores/redis.py documents it): one string
--   '\193' <state> <token> \0 <updated ms> \0 <task id> \0 <payload hash> \0 <tail>
-- state: i in_progress, d done, f failed, r released.

-- state, token, updated, task id, payload hash, position of the tail; nil when v is not a record.
local function parse(v)
  return string.match(v, '^\193([idfr])(%d+)%z(%d+)%z([^%z]*)%z([^%z]*)%z()')
end

-- What follows the header of an in_progress record: owner, attempt, lease expiry.
local IN_PROGRESS_TAIL = '^[^%z]*%z%d+%z%d+$'

-- parse(v) for a record a script is about to rewrite: nil as well when an in_progress record's
-- tail is damaged, so the script leaves it alone ('corrupt') instead of building on it.
local function parse_whole(v)
  local state, t, updated, task_id, hash, tail = parse(v)
  if state == 'i' and not string.find(v, IN_PROGRESS_TAIL, tail) then return nil end
  return state, t, updated, task_id, hash, tail
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
