-- keys:
-- Record the state a tenant's default run ended a job in, the one its next default run
-- resumes, only while that run is still the tenant's default (a reset meanwhile keeps it
-- cleared). Fenced: the leader's runner writes it after a job succeeded.
-- ARGS: tenant, rid, checkpoint. Result: code = set | other.
local tenant, rid, checkpoint = ARGS[1], ARGS[2], ARGS[3]
local dk = keys.default_run(tenant)
if redis.call('HGET', dk, 'rid') ~= rid then return result('code', 'other') end
redis.call('HSET', dk, 'checkpoint', checkpoint)
return result('code', 'set')
