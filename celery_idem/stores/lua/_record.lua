-- Shared by every script: celery_idem/stores/redis.py prepends this file to each one before
-- registering it, so the record's format is parsed in one place.
--
-- The record format (celery_idem/stores/redis.py documents it): one string
--   '\193' <state> <token> ['.' <claim id>] \0 <updated ms> \0 <task id> \0 <payload hash> \0 <tail>
-- state: i in_progress, d done, f failed, r released. The claim id is absent from a released
-- tombstone and from records written before claim ids existed ('' then).

-- state, token, claim id, updated, task id, payload hash, position of the tail; nil when v is
-- not a record.
local function parse(v)
  return string.match(v, '^\193([idfr])(%d+)%.?([^%z]*)%z(%d+)%z([^%z]*)%z([^%z]*)%z()')
end

-- What follows the header of an in_progress record: owner, attempt, lease expiry.
local IN_PROGRESS_TAIL = '^[^%z]*%z%d+%z%d+$'

-- parse(v) for a record a script is about to rewrite: nil as well when an in_progress record's
-- tail is damaged, so the script leaves it alone ('corrupt') instead of building on it.
local function parse_whole(v)
  local state, t, claim_id, updated, task_id, hash, tail = parse(v)
  if state == 'i' and not string.find(v, IN_PROGRESS_TAIL, tail) then return nil end
  return state, t, claim_id, updated, task_id, hash, tail
end

-- Whether a fenced call (token, claim id: ARGV values) names the claim that wrote the record
-- (t, claim_id: parsed). An empty claim id from the caller checks the token alone (a caller
-- from before claim ids); tokens are compared as numbers.
local function same_claim(t, claim_id, want_token, want_claim_id)
  if tonumber(t) ~= tonumber(want_token) then return false end
  return want_claim_id == nil or want_claim_id == '' or want_claim_id == claim_id
end

-- Why a fenced call was refused: 'fenced:<state>:<token>', or 'reissued:<state>:<token>' when
-- the token matched and the record's claim id was another (a token issued twice, after a loss).
local function refusal(state, t, claim_id, want_token)
  if claim_id ~= '' and tonumber(t) == tonumber(want_token) then
    return 'reissued:' .. state .. ':' .. t
  end
  return 'fenced:' .. state .. ':' .. t
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
