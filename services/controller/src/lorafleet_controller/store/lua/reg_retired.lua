-- keys:
-- A registration retired in its group (release.lua, fence.lua): it leaves its tenant's live
-- runs (fleet). ARGS: rid, tenant. Idempotent. Result: code = ok.
redis.call('SREM', keys.tenant_live(ARGS[2]), ARGS[1])
return result('code', 'ok')
