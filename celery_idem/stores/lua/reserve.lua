-- The enqueue check with a reservation (Store.reserve), in one round trip.
-- KEYS[1]  the record          KEYS[2]  the reservation
-- ARGV[1]  the task id of the message about to be published
-- ARGV[2]  its fingerprint ('' = none)          ARGV[3]  the reservation's lease (ms)
-- Returns  the record (not released: the client answers or attaches), {reservation} (another
--          message's: attach to it), or false (reserved for ARGV[1]: publish).
local v = redis.call('GET', KEYS[1])
if v and not (string.byte(v, 1) == 0xC1 and string.byte(v, 2) == 114) then
  return v  -- any record but a released one ('r'); a foreign value is the client's to report
end
local r = redis.call('GET', KEYS[2])
if r and r ~= '' then  -- '' is a dropped one (unreserve.lua)
  return {r}
end
redis.call('SET', KEYS[2], ARGV[1] .. '\0' .. ARGV[2], 'PX', ARGV[3])
return false
