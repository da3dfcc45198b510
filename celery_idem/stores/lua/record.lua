-- Fenced: turn the caller's in_progress record into done/failed.
-- KEYS[1] the record             KEYS[2] (optional) Celery's result key for this task
-- ARGV[1] token   ARGV[2] state ('d' done | 'f' failed)   ARGV[3] content type (or its code)
-- ARGV[4] data    ARGV[5] ttl (ms)   ARGV[6] claim id ('' = check the token alone)
-- ARGV[7] (with KEYS[2]) the result backend's encoded meta   ARGV[8] its expiry (s, 0 = none)
-- Returns 'ok' ('ok:nometa' when the meta write was refused), 'fenced:<state code>:<token>' /
-- 'reissued:<state code>:<token>' / 'missing' when the caller no longer holds the key, or
-- 'corrupt' (not a record: left alone).

-- (parse_whole, same_claim, refusal and now_ms come from _record.lua, prepended by the store)

local v = redis.call('GET', KEYS[1])
if not v then return 'missing' end
local state, t, claim_id, _, task_id, hash = parse_whole(v)
if not state then return 'corrupt' end
if not same_claim(t, claim_id, ARGV[1], ARGV[6]) then return refusal(state, t, claim_id, ARGV[1]) end

-- The result backend's own write (SET + PUBLISH, what Celery's Redis backend does), folded into
-- this round trip and made only by the fenced holder. pcall: a refused meta write (an ACL, say)
-- must not fail the record; Celery then writes the meta itself.
local function meta()
  if not KEYS[2] then return 'ok' end
  local set
  if tonumber(ARGV[8]) > 0 then
    set = redis.pcall('SET', KEYS[2], ARGV[7], 'EX', ARGV[8])
  else
    set = redis.pcall('SET', KEYS[2], ARGV[7])
  end
  if type(set) == 'table' and set.err then return 'ok:nometa' end
  local pub = redis.pcall('PUBLISH', KEYS[2], ARGV[7])
  if type(pub) == 'table' and pub.err then return 'ok:nometa' end
  return 'ok'
end

-- The holder retrying a record whose reply it lost: already written (the meta too, unless it
-- was refused: writing it again is harmless).
if state == ARGV[2] then return meta() end
if state ~= 'i' then return 'fenced:' .. state .. ':' .. t end
-- Who held the claim, at which attempt and until when no longer matters once the outcome is
-- known: the done record drops them to stay small (the task id stays: it is the original one).
-- The claim id stays, so a retry of this record is told apart from a reissued token's.
local head = t
if claim_id ~= '' then head = t .. '.' .. claim_id end
redis.call('SET', KEYS[1], '\193' .. ARGV[2] .. head .. '\0' .. now_ms() .. '\0' .. task_id ..
           '\0' .. hash .. '\0' .. ARGV[3] .. '\0' .. ARGV[4], 'PX', ARGV[5])
return meta()
