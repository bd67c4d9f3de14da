-- keys: ckpt_ttl
-- Remove a checkpoint's record and its index entries together. ARGS: path, tenant, rid.
-- Result: code = removed.
local path, tenant, rid = ARGS[1], ARGS[2], ARGS[3]
redis.call('DEL', keys.ckpt(path))
redis.call('ZREM', keys.tenant_ckpts(tenant), path)
redis.call('ZREM', keys.run_ckpts(rid), path)
redis.call('ZREM', keys.ckpt_ttl, path)
return result('code', 'removed')
