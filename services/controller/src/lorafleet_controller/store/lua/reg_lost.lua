-- keys: binding claimed depth gaps ready_ctl ready_data
-- A lost trainer's slot entry, in its run's group (replica_lost.lua is the first step).
-- ARGS: replica, slot, rid, now, reason. Only while the run holds that slot: it becomes
-- UNAVAILABLE (to be rebuilt by replay: recovery.py), its open operations stay queued (the
-- one in flight, CLAIMED, is queued again: the lost trainer may or may not have applied it,
-- and either way its effect is gone with it). The caller then frees the entry and puts the
-- run in the placement queue ahead of new registrations (fleet_slot.lua, at `score` = its
-- creation time - 1e10). Running it again changes nothing.
-- Result: code = lost | gone (the run had left that slot, or retired), base_model, score.
local replica, slot, rid, now, reason = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4]), ARGS[5]
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'base_model', 'created_at', 'replica', 'slot')
local placed = r[1] == REG.BINDING or r[1] == REG.READY or r[1] == REG.PAGING
if not placed or r[4] ~= replica or r[5] ~= slot then
  return result('code', 'gone', 'base_model', r[2] or '', 'score', '0')
end
redis.call('HSET', rk, 'state', REG.UNAVAILABLE, 'unavailable_reason', reason, 'replica', '',
  'slot', '-1', 'restore', '1')
redis.call('SREM', keys.binding, rid)
local head = tonumber(redis.call('HGET', rk, 'head'))
local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
for seq = head, max_seq do
  local id = opid_of(rid, seq)
  if op_state(id) == OP.CLAIMED then
    redis.call('HSET', keys.op(id), 'state', OP.QUEUED)
    redis.call('HDEL', keys.op(id), 'pushed', 'claimed_at')
    redis.call('ZREM', keys.claimed, id)
    depth(OP.CLAIMED, -1)
    depth(OP.QUEUED, 1)
  end
end
return result('code', 'lost', 'base_model', r[2], 'score', tostring(tonumber(r[3]) - 1e10))
