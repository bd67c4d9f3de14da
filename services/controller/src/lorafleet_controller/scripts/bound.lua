-- The trainer confirmed the binding: the registration is READY. ARGV: P, rid, replica, slot, now.
-- Returns 1, or 0 when the placement changed meanwhile (retired, replica lost): the caller
-- then releases the trainer slot it just bound.
local rid, replica, slot, now = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local rk = regkey(rid)
local r = redis.call('HMGET', rk, 'state', 'replica', 'slot')
if r[1] ~= 'binding' or r[2] ~= replica or r[3] ~= slot then return 0 end
redis.call('HSET', rk, 'state', 'ready', 'dirty', '0')
redis.call('SREM', P .. 'binding', rid)
redis.call('HDEL', rk, 'unavailable_reason', 'restore')
advance(rid, now)
return 1
