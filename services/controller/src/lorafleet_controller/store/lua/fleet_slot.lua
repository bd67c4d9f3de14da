-- keys:
-- The fleet's half of a run's placement change, after its group step (release, page-out,
-- page-in, a lost trainer, a refused or revoked placement): free its slot entry if it still
-- holds it, and set its place in its base model's queue. ARGS: rid, replica ('' = no
-- slot), slot, base_model, queue (leave | wait: join unless queued, at `score` | ahead: at
-- `score`, moved if queued | '' = as it is), score. Idempotent.
-- Result: code = freed | kept (the entry was not the run's, or no slot was given).
local rid, replica, slot, base, queue, score = ARGS[1], ARGS[2], ARGS[3], ARGS[4], ARGS[5],
  ARGS[6]
local freed = false
if replica ~= '' and redis.call('HGET', keys.slots(replica), slot) == rid then
  redis.call('HDEL', keys.slots(replica), slot)
  redis.call('HDEL', keys.slot_tenants(replica), slot)
  freed = true
end
if queue == 'leave' then
  redis.call('ZREM', keys.regq(base), rid)
elseif queue == 'wait' then
  redis.call('ZADD', keys.regq(base), 'NX', score, rid)
elseif queue == 'ahead' then
  redis.call('ZADD', keys.regq(base), score, rid)
end
return result('code', freed and 'freed' or 'kept')
