-- keys: paging
-- Finish a page-out: the slot's state is in the checkpoint store (its snapshot is recorded in
-- the replay log, or the log replays it). ARGS: rid, now. The registration becomes PAGED (to
-- be restored like a lost trainer's run: `restore`), its slot is free, and if operations
-- arrived meanwhile it already waits for a slot again (score now: oldest waiting first).
-- Result: code = paged | moved (it is no longer PAGING: a lost trainer made it UNAVAILABLE),
-- replica, slot (freed), base_model, waiting (1 when queued for a page-in).
local rid, now = ARGS[1], tonumber(ARGS[2])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'replica', 'slot', 'base_model', 'pending')
redis.call('SREM', keys.paging, rid)
if r[1] ~= REG.PAGING then return result('code', 'moved') end
free_slot(r[2], r[3], rid)
redis.call('HSET', rk, 'state', REG.PAGED, 'replica', '', 'slot', '-1', 'restore', '1',
  'paged_at', now)
local waiting = 0
if tonumber(r[5]) > 0 then
  redis.call('ZADD', keys.regq(r[4]), 'NX', now, rid)
  waiting = 1
end
return result('code', 'paged', 'replica', r[2], 'slot', r[3], 'base_model', r[4],
  'waiting', waiting)
