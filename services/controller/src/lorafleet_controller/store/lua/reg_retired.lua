-- keys: runs_retired
-- A registration retired in its group (release.lua, fence.lua): it leaves its tenant's live
-- runs (fleet) and is queued for forgetting after the retention (run_forget.lua). ARGS:
-- rid, tenant, now. Idempotent (the first retirement's time is kept). Result: code = ok.
redis.call('SREM', keys.tenant_live(ARGS[2]), ARGS[1])
redis.call('ZADD', keys.runs_retired, 'NX', ARGS[3], ARGS[1])
return result('code', 'ok')
