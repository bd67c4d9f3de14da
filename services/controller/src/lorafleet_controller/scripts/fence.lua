-- Fail every open operation of a registration and set its state. ARGV: P, rid, now,
-- new_state ('retired' or 'unavailable'), error JSON, reason text.
-- A retired registration enters `retired` so the sweeper deletes its operation records once
-- their results outlive the result TTL. Returns the number of operations failed.
local rid, now, new_state, err, reason = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local rk = regkey(rid)
if not redis.call('HGET', rk, 'tenant') then return -1 end
redis.call('HSET', rk, 'state', new_state)
if new_state == 'retired' then redis.call('ZADD', P .. 'retired', now, rid) end
if reason ~= '' then redis.call('HSET', rk, 'unavailable_reason', reason) end
local n = fail_open(rid, err, now)
advance(rid, now)
return n
