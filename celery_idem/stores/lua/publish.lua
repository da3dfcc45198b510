-- The enqueue check folded into the publish (celery_idem/stores/redis_enqueue.py): push the
-- message unless the key's record is done or failed, in one round trip.
-- KEYS[1]: the broker's queue list; KEYS[2]: the record. ARGV[1]: the message, as kombu packs it.
-- Replies: the record (done or failed: not pushed), false (pushed), or "check" (not pushed: the
-- value is not a plain record, so the client reads it the usual way and reports what it is).
local ok, value = pcall(redis.call, 'GET', KEYS[2])
if not ok then
  return 'check'  -- WRONGTYPE: another program's key under the prefix
end
if value then
  if string.byte(value, 1) ~= 0xC1 then
    return 'check'
  end
  local state = string.byte(value, 2)
  if state == 100 or state == 102 then  -- 'd' done, 'f' failed
    return value
  end
end
redis.call('LPUSH', KEYS[1], ARGV[1])
return false
