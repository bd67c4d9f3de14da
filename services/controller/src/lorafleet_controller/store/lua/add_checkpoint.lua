-- keys: ckpt_ttl
-- Record a checkpoint unless its path exists (named checkpoints are immutable). ARGS: path,
-- tenant, rid, created_at, expires_at (0 = never), holds (the published version a sampler
-- checkpoint names, '' for none: held while the record stays), then (field, value) pairs.
-- Result: code = created | exists.
local path, tenant, rid, created_at, expires = ARGS[1], ARGS[2], ARGS[3], ARGS[4],
  tonumber(ARGS[5])
local ck = keys.ckpt(path)
if redis.call('EXISTS', ck) == 1 then return result('code', 'exists') end
redis.call('HSET', ck, 'tenant', tenant, 'rid', rid, 'created_at', created_at, 'expires_at',
  expires)
for i = 7, #ARGS - 1, 2 do redis.call('HSET', ck, ARGS[i], ARGS[i + 1]) end
if ARGS[6] ~= '' then redis.call('SADD', keys.adapter_refs(ARGS[6]), 'p:' .. path) end
redis.call('ZADD', keys.tenant_ckpts(tenant), created_at, path)
redis.call('ZADD', keys.run_ckpts(rid), created_at, path)
if expires > 0 then redis.call('ZADD', keys.ckpt_ttl, expires, path) end
return result('code', 'created')
