-- keys: ckpt_ttl reclaim run_newest versions_unheld
-- Remove a checkpoint's record and its index entries together, and queue its folder for
-- reclaiming (reclaim.py) in the same step, so a controller killed between the two never
-- leaves files that nothing names; a sampler checkpoint lets its published version go
-- (version_gc.py collects it if nothing else holds it). ARGS: path, tenant, rid, reclaim
-- entry ('' = none), holds (the version a sampler checkpoint names, '' = none), now.
-- Result: code = removed.
local path, tenant, rid = ARGS[1], ARGS[2], ARGS[3]
redis.call('DEL', keys.ckpt(path))
redis.call('ZREM', keys.tenant_ckpts(tenant), path)
redis.call('ZREM', keys.run_ckpts(rid), path)
redis.call('ZREM', keys.ckpt_ttl, path)
if ARGS[4] ~= '' then redis.call('HSET', keys.reclaim, path, ARGS[4]) end
if ARGS[5] ~= '' then
  redis.call('SREM', keys.adapter_refs(ARGS[5]), 'p:' .. path)
  let_go(ARGS[5], tonumber(ARGS[6]))
end
return result('code', 'removed')
