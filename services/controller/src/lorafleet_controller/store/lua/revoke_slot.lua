-- keys:
-- The sweep found a slot entry whose run does not hold it (its placer died between
-- place.lua and accept_place.lua, or a release or loss died before its fleet step). ARGS:
-- rid, replica, slot. Unless the run holds that slot now, its placement generation moves
-- on, so a placement still in flight cannot take the entry; the caller then frees it
-- (fleet_slot.lua). Result: code = held | revoked.
local rid, replica, slot = ARGS[1], ARGS[2], ARGS[3]
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'replica', 'slot')
local placed = r[1] == REG.BINDING or r[1] == REG.READY or r[1] == REG.PAGING
if placed and r[2] == replica and r[3] == slot then return result('code', 'held') end
if r[1] then redis.call('HINCRBY', rk, 'gen', 1) end
return result('code', 'revoked')
