-- keys: binding gaps ready_ctl ready_data
-- The trainer confirmed the binding: the registration is READY, holding the slot since `now`
-- (bound_at, for `lorafleet status`). ARGS: rid, replica, slot, now.
-- Result: code = ok, or moved when the placement changed meanwhile (retired, replica lost):
-- the caller then releases the trainer slot it just bound.
local rid, replica, slot, now = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'replica', 'slot')
if r[1] ~= REG.BINDING or r[2] ~= replica or r[3] ~= slot then return result('code', 'moved') end
redis.call('HSET', rk, 'state', REG.READY, 'dirty', '0', 'bound_at', now)
redis.call('SREM', keys.binding, rid)
redis.call('HDEL', rk, 'unavailable_reason', 'restore', 'paged_at')
advance(rid, now)
return result('code', 'ok')
