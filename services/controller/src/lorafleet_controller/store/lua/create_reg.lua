-- keys:
-- Creating a registration, second step (its group): the record, unless it exists. ARGS: rid,
-- tenant, session_id, created_at, head, then (field, value) pairs. reg_reserve.lua counted
-- it against its tenant's limit first.
-- Result: code = created | exists.
local rid, tenant, session_id, created_at, head = ARGS[1], ARGS[2], ARGS[3], ARGS[4], ARGS[5]
local rk = keys.reg(rid)
if redis.call('EXISTS', rk) == 1 then return result('code', 'exists') end
redis.call('HSET', rk, 'tenant', tenant, 'session_id', session_id, 'created_at', created_at,
  'head', head, 'max_seq', tonumber(head) - 1, 'pending', 0, 'state', REG.QUEUED,
  'optim_steps', 0, 'published_version', 0, 'dirty', '0')
for i = 6, #ARGS - 1, 2 do redis.call('HSET', rk, ARGS[i], ARGS[i + 1]) end
return result('code', 'created')
