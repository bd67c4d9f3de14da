-- keys: paging
-- Finish a page-out: the slot's state is in the checkpoint store (its snapshot is recorded in
-- the replay log, or the log replays it). ARGS: rid, now. The registration becomes PAGED (to
-- be restored like a lost trainer's run: `restore`); the caller then frees its slot and, if
-- operations arrived meanwhile, queues it for a slot again at `now` (fleet_slot.lua).
-- Result: code = paged | moved (it is no longer PAGING: a lost trainer made it UNAVAILABLE),
-- replica, slot (to free), base_model, waiting (1 when it is to wait for a page-in).
local rid, now = ARGS[1], tonumber(ARGS[2])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'replica', 'slot', 'base_model', 'pending')
redis.call('SREM', keys.paging, rid)
if r[1] ~= REG.PAGING then return result('code', 'moved') end
redis.call('HSET', rk, 'state', REG.PAGED, 'replica', '', 'slot', '-1', 'restore', '1',
  'paged_at', now)
local waiting = tonumber(r[5]) > 0 and 1 or 0
return result('code', 'paged', 'replica', r[2], 'slot', r[3], 'base_model', r[4],
  'waiting', waiting)
