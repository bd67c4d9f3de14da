-- keys: regs
-- Create a registration unless it exists. ARGS: rid, tenant, session_id, created_at, head,
-- max_registrations (the tenant's live registrations), then (field, value) pairs.
-- Result: code = created | exists | limit (the tenant has too many live registrations).
local rid, tenant, session_id, created_at, head = ARGS[1], ARGS[2], ARGS[3], ARGS[4], ARGS[5]
local max_regs = tonumber(ARGS[6])
local rk = keys.reg(rid)
if redis.call('EXISTS', rk) == 1 then return result('code', 'exists') end
local tk = keys.tenant(tenant)
if tonumber(redis.call('HGET', tk, 'registrations') or '0') >= max_regs then
  return result('code', 'limit')
end
redis.call('HSET', rk, 'tenant', tenant, 'session_id', session_id, 'created_at', created_at,
  'head', head, 'max_seq', tonumber(head) - 1, 'pending', 0, 'state', REG.QUEUED,
  'optim_steps', 0, 'published_version', 0, 'dirty', '0')
for i = 7, #ARGS - 1, 2 do redis.call('HSET', rk, ARGS[i], ARGS[i + 1]) end
redis.call('HINCRBY', tk, 'registrations', 1)
redis.call('SADD', keys.regs, rid)
redis.call('ZADD', keys.tenant_regs(tenant), created_at, rid)
redis.call('SADD', keys.session_runs(session_id), rid)
return result('code', 'created')
