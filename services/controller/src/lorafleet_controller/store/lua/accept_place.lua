-- keys: binding
-- Placing a registration, group step: the run takes the slot place.lua gave it, only if it
-- still waits (QUEUED, UNAVAILABLE, PAGED) at the placement generation the caller read
-- before placing. It becomes BINDING and its generation moves on, so of two placements
-- racing for one run only one is taken, and a slot entry the sweep revoked
-- (revoke_slot.lua) can no longer be taken. ARGS: rid, replica, slot, gen.
-- Result: code = placed | moved (the caller frees the slot).
local rid, replica, slot, gen = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'gen')
local waiting = r[1] == REG.QUEUED or r[1] == REG.UNAVAILABLE or r[1] == REG.PAGED
if not waiting or tonumber(r[2] or '0') ~= gen then return result('code', 'moved') end
redis.call('HSET', rk, 'state', REG.BINDING, 'replica', replica, 'slot', slot, 'gen', gen + 1)
redis.call('SADD', keys.binding, rid)
return result('code', 'placed')
