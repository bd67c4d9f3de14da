-- keys: binding claimed depth gaps ready_ctl ready_data
-- A lost trainer's slot entry, in its run's group (replica_lost.lua is the first step).
-- ARGS: replica, slot, rid, now, reason. Only while `rid` still holds that slot: the run
-- becomes UNAVAILABLE (to be rebuilt by replay: recovery.py), its open operations stay
-- queued (the one in flight, CLAIMED, is queued again: the lost trainer may or may not have
-- applied it, and either way its effect is gone with it), it re-enters the placement queue
-- ahead of new registrations (score = its creation time - 1e10), and the entry is freed.
-- A retired run's entry is only freed. Running it again changes nothing.
-- Result: code = lost | freed (retired run) | gone (the entry had moved on).
local replica, slot, rid, now, reason = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4]), ARGS[5]
if redis.call('HGET', keys.slots(replica), slot) ~= rid then return result('code', 'gone') end
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'base_model', 'created_at')
free_slot(replica, slot, rid)
if not r[1] or r[1] == REG.RETIRED then return result('code', 'freed') end
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
redis.call('ZADD', keys.regq(r[2]), tonumber(r[3]) - 1e10, rid)
return result('code', 'lost')
