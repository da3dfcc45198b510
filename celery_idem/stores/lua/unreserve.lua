-- Drop a reservation if it is still the given message's (Store.unreserve).
-- KEYS[1]  the reservation     ARGV[1]  the task id
-- Overwritten with an empty value that expires at once, not deleted: a least-privilege ACL
-- user (docs/reliability.md) may SET but not DEL. An empty value is no reservation.
local r = redis.call('GET', KEYS[1])
if r and string.sub(r, 1, #ARGV[1] + 1) == ARGV[1] .. '\0' then
  redis.call('SET', KEYS[1], '', 'PX', 1)
end
return false
