-- keys: depth open_samples fleet_share
-- Admit a sample operation (not seq-ordered), in its sampler's group. ARGS: opid, digest,
-- payload, now, tenant, rid. Idempotent on (opid, digest); the tenant's and the fleet's
-- limits are leased to the group as for submit.lua (store/quota.py) and checked before
-- anything is written.
-- Result: code = created | duplicate | conflict | not_found | need_lease (need: scopes;
-- want: the lease of each the group must hold), state.
local id, digest, payload, now, tenant, rid = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4]),
  ARGS[5], ARGS[6]
local ok = keys.op(id)
local existing = redis.call('HMGET', ok, 'digest', 'state', 'tenant')
if existing[2] then
  if existing[3] ~= tenant then return result('code', 'not_found') end
  local code = existing[1] == digest and 'duplicate' or 'conflict'
  return result('code', code, 'state', existing[2])
end
local need, want = needs(tenant, #payload, true)
if #need > 0 then return result('code', 'need_lease', 'need', need, 'want', want) end
redis.call('HSET', ok, 'rid', rid, 'tenant', tenant, 'seq', 0, 'kind', SAMPLE_KIND,
  'digest', digest, 'submitted_at', now, 'ordered', '0', 'state', OP.QUEUED, 'payload', payload,
  'bytes', #payload)
redis.call('SADD', keys.open_samples, id)
count(tenant, 'pending', 1)
count(tenant, 'pending_bytes', #payload)
depth(OP.QUEUED, 1)
return result('code', 'created', 'state', OP.QUEUED)
