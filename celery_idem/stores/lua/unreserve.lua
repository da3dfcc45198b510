-- Drop a reservation if it is still the given message's (Store.unreserve).
-- KEYS[1]  the reservation     ARGV[1]  the task id
local r = redis.call('GET', KEYS[1])
if r and string.sub(r, 1, #ARGV[1] + 1) == ARGV[1] .. '\0' then
  redis.call('DEL', KEYS[1])
end
return false
