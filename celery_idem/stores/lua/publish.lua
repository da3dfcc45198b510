-- The enqueue check folded into the publish (celery_idem/enqueue_redis.py): push the
-- message unless the key's record answers it, in one round trip.
-- KEYS[1]: the broker's queue list; KEYS[2]: the record; KEYS[3]: its reservation (only with
-- ARGV[2] = '1'). ARGV[1]: the message, as kombu packs it. ARGV[2]: '1' when this enqueue may
-- attach to an action under way (then ARGV[3] task id, ARGV[4] fingerprint or '', ARGV[5]
-- the reservation's lease in ms), else '0'.
-- Replies: the record (done, failed, or, when attaching, in progress: not pushed), {the
-- reservation} (another message's, when attaching: not pushed), false (pushed, and reserved
-- when attaching), or "check" (not pushed: the value is not a plain record, so the client
-- reads it the usual way and reports what it is).
-- With KEYS[4] (the key's intent) and KEYS[5] (the intents' index), a pushed message's intent
-- is written too (write_intent, lua/_intent.lua, prepended): ARGV[6] task id, ARGV[7] queue,
-- ARGV[8] the envelope, ARGV[9] relay after (ms), ARGV[10] ttl (ms), ARGV[11] eta (ms, 0 =
-- none), ARGV[12] the key.
local ok, value = pcall(redis.call, 'GET', KEYS[2])
if not ok then
  return 'check'  -- WRONGTYPE: another program's key under the prefix
end
local attach = ARGV[2] == '1'
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
redis.call('LPUSH', KEYS[1], ARGV[1])
if KEYS[4] then
  write_intent(KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12])
end
return false
