-- Fail every open operation of a registration and set its state. ARGV: P, rid, now,
-- new_state ('retired' or 'unavailable'), error JSON, reason text.
-- Returns the number of operations failed.
local rid, now, new_state, err, reason = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local rk = regkey(rid)
if not redis.call('HGET', rk, 'tenant') then return -1 end
redis.call('HSET', rk, 'state', new_state)
if reason ~= '' then redis.call('HSET', rk, 'unavailable_reason', reason) end
local n = fail_open(rid, err, now)
advance(rid, now)
return n
