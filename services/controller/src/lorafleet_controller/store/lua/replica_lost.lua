-- fleet-keys: binding claimed results pending unacked depth gaps ready_ctl ready_data
-- A replica is gone (heartbeat timeout, left discovery, or a new incarnation). ARGS: replica,
-- now, reason. It is marked unhealthy; if it is a trainer, every registration it held
-- becomes UNAVAILABLE (to be rebuilt by replay: recovery.py), its open operations stay
-- queued (the one in flight, CLAIMED, is queued again: the lost trainer may or may not have
-- applied it, and either way its effect is gone with it), and it re-enters the placement
-- queue ahead of new registrations (score = its creation time - 1e10).
-- Result: code = lost | unknown | already (was not healthy), kind, affected (registration ids).
local replica, now, reason = ARGS[1], tonumber(ARGS[2]), ARGS[3]
local hk = keys.replica(replica)
local h = redis.call('HMGET', hk, 'healthy', 'kind')
if not h[2] then return result('code', 'unknown', 'kind', '', 'affected', {}) end
redis.call('HSET', hk, 'healthy', '0')
local sk = keys.slots(replica)
local affected = {}

local function requeue_claimed(rid)
  local rk = keys.reg(rid)
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
end
local entries = redis.call('HGETALL', sk)
for i = 1, #entries, 2 do
  local rid = entries[i + 1]
  local rk = keys.reg(rid)
  local r = redis.call('HMGET', rk, 'state', 'base_model', 'created_at')
  if r[1] and r[1] ~= REG.RETIRED then
    redis.call('HSET', rk, 'state', REG.UNAVAILABLE, 'unavailable_reason', reason, 'replica', '',
      'slot', '-1', 'restore', '1')
    redis.call('SREM', keys.binding, rid)
    requeue_claimed(rid)
    redis.call('ZADD', keys.regq(r[2]), tonumber(r[3]) - 1e10, rid)
    table.insert(affected, rid)
  end
end
redis.call('DEL', sk)
return result('code', h[1] == '1' and 'lost' or 'already', 'kind', h[2], 'affected', affected)
