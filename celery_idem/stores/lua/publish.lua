-- The enqueue check folded into the publish (celery_idem/enqueue_redis.py): push the
-- message unless the key's record answers it, in one round trip.
-- KEYS[1]: the broker's queue list; KEYS[2]: the record; KEYS[3]: its reservation (only with
-- ARGV[2] = '1'). ARGV[1]: the message, as kombu packs it. ARGV[2]: '1' when this enqueue may
-- attach to an action under way (then ARGV[3] task id, ARGV[4] fingerprint or '', ARGV[5]
-- the reservation's lease in ms), else '0'; then, when the store is on another database of the
-- broker's server, ' <store's db> <broker's db>': the record, the reservation and the intent
-- are the store's, the queue the broker's (a script's SELECT leaves its connection's alone).
-- Replies: the record (done, failed, or, when attaching, in progress: not pushed), {the
-- reservation} (another message's, when attaching: not pushed), false (pushed, and reserved
-- when attaching), or "check" (not pushed: the value is not a plain record, so the client
-- reads it the usual way and reports what it is).
-- With two more keys, the key's intent and the intents' index (KEYS[3] and KEYS[4], or KEYS[4]
-- and KEYS[5] when attaching), a pushed message's intent is written too (write_intent,
-- lua/_intent.lua, prepended), from one more argument (ARGV[3], or ARGV[6] when attaching): its
-- spec (redis_intents.intent_spec: times, task id, queue and the head of its message,
-- intents.kombu_redis_head; the message kept is the head, then ARGV[1], the payload pushed). The
-- index's member, the key, is the record's name after the prefix (the index's name is the prefix
-- and '\31intents', 8 bytes).
local sdb, bdb
if #ARGV[2] > 1 then
  sdb, bdb = string.match(ARGV[2], '^. (%d+) (%d+)$')
  redis.call('SELECT', sdb)
end
local ok, value = pcall(redis.call, 'GET', KEYS[2])
if not ok then
  return 'check'  -- WRONGTYPE: another program's key under the prefix
end
local attach = string.byte(ARGV[2], 1) == 49  -- '1'
local free = true
if value then
  if string.byte(value, 1) ~= 0xC1 then
    return 'check'
  end
  local state = string.byte(value, 2)
  if state == 100 or state == 102 then  -- 'd' done, 'f' failed
    return value
  end
  if state == 105 then  -- 'i' in progress: the client attaches, or publishes if the lease is gone
    if attach then
      return value
    end
    free = false
  end
end
if attach and free then
  local r = redis.call('GET', KEYS[3])
  if r and r ~= '' then  -- '' is a dropped one (unreserve.lua)
    return {r}
  end
  redis.call('SET', KEYS[3], ARGV[3] .. '\0' .. ARGV[4], 'PX', ARGV[5])
end
if bdb then
  redis.call('SELECT', bdb)
  redis.call('LPUSH', KEYS[1], ARGV[1])
  redis.call('SELECT', sdb)
else
  redis.call('LPUSH', KEYS[1], ARGV[1])
end
local k, a = 3, 3
if attach then
  k, a = 4, 6
end
if KEYS[k] then
  write_intent(KEYS[k], KEYS[k + 1], string.sub(KEYS[2], #KEYS[k + 1] - 7), ARGV[a], ARGV[1])
end
return false
