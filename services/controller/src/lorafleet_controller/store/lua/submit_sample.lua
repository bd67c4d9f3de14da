-- keys: pending unacked depth open_samples
-- Admit a sample operation (not seq-ordered). ARGS: opid, digest, payload, now, tenant, rid,
-- limits (open per tenant, fleet; unacked per tenant, fleet). Idempotent on (opid, digest);
-- limits are checked before anything is written.
-- Result: code = created | duplicate | conflict | not_found | backpressure, state, scope.
local id, digest, payload, now, tenant, rid = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4]),
  ARGS[5], ARGS[6]
local max_tenant, max_fleet = tonumber(ARGS[7]), tonumber(ARGS[8])
local max_unacked_tenant, max_unacked_fleet = tonumber(ARGS[9]), tonumber(ARGS[10])
local ok = keys.op(id)
local existing = redis.call('HMGET', ok, 'digest', 'state', 'tenant')
if existing[2] then
  if existing[3] ~= tenant then return result('code', 'not_found') end
  local code = existing[1] == digest and 'duplicate' or 'conflict'
  return result('code', code, 'state', existing[2])
end
local t = redis.call('HMGET', keys.tenant(tenant), 'pending', 'unacked')
local refuse = nil
if tonumber(t[2] or '0') >= max_unacked_tenant then
  refuse = 'tenant_results'
elseif tonumber(redis.call('GET', keys.unacked) or '0') >= max_unacked_fleet then
  refuse = 'results'
elseif tonumber(t[1] or '0') >= max_tenant then
  refuse = 'tenant'
elseif tonumber(redis.call('GET', keys.pending) or '0') >= max_fleet then
  refuse = 'global'
end
if refuse then return result('code', 'backpressure', 'scope', refuse) end
redis.call('HSET', ok, 'rid', rid, 'tenant', tenant, 'seq', 0, 'kind', SAMPLE_KIND,
  'digest', digest, 'submitted_at', now, 'ordered', '0', 'state', OP.QUEUED, 'payload', payload)
redis.call('SADD', keys.open_samples, id)
count(tenant, 'pending', 1)
depth(OP.QUEUED, 1)
return result('code', 'created', 'state', OP.QUEUED)
