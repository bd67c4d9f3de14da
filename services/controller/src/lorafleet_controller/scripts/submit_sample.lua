-- Admit a sample operation (not seq-ordered). ARGV: P, opid, digest, payload, now, tenant,
-- rid, max_unacked, max_global. Idempotent on (opid, digest); backpressure before anything
-- is written. Returns {'created'|'duplicate'|'conflict', state} or {'backpressure', scope}.
local id, digest, payload, now, tenant, rid = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7]
local max_unacked, max_global = tonumber(ARGV[8]), tonumber(ARGV[9])
local ok = opkey(id)
local existing = redis.call('HMGET', ok, 'digest', 'state', 'tenant')
if existing[2] then
  if existing[3] ~= tenant then return { 'not_found' } end
  if existing[1] == digest then return { 'duplicate', existing[2] } end
  return { 'conflict', existing[2] }
end
if tonumber(redis.call('GET', P .. 'unacked') or '0') >= max_unacked then
  return { 'backpressure', 'results' }
end
if tonumber(redis.call('GET', P .. 'pending') or '0') >= max_global then
  return { 'backpressure', 'global' }
end
redis.call('HSET', ok, 'rid', rid, 'tenant', tenant, 'seq', 0, 'kind', 7, 'digest', digest,
  'submitted_at', now, 'ordered', '0', 'state', QUEUED, 'payload', payload)
redis.call('SADD', P .. 'open_samples', id)
redis.call('INCR', P .. 'pending')
depth(QUEUED, 1)
return { 'created', tostring(QUEUED) }
