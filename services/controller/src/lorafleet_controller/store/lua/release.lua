-- keys: binding
-- Retire a registration's placement: free its slot and leave the queue. ARGS: rid.
-- Result: replica and slot that were freed ('' when it held none), base_model.
local rid = ARGS[1]
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'replica', 'slot', 'base_model', 'tenant')
if not r[4] then return result('replica', '', 'slot', '', 'base_model', '') end
redis.call('ZREM', keys.regq(r[3] or ''), rid)
retire_state(rid, r[4])
redis.call('SREM', keys.binding, rid)
if free_slot(r[1], r[2], rid) then
  return result('replica', r[1], 'slot', r[2], 'base_model', r[3])
end
return result('replica', '', 'slot', '', 'base_model', r[3] or '')
