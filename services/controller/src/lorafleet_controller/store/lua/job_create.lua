-- keys: jobs_open
-- Record a job and queue it on its run unless it exists (idempotent on its id; a request
-- any replica serves, so not fenced). ARGS: job_id, tenant, rid, created_at, then (field,
-- value) pairs of the job's hash. Result: code = created | exists.
local job_id, tenant, rid, created_at = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
local jk = keys.job(job_id)
if redis.call('EXISTS', jk) == 1 then return result('code', 'exists') end
redis.call('HSET', jk, 'tenant', tenant, 'rid', rid, 'created_at', created_at, 'version', 1)
for i = 5, #ARGS - 1, 2 do redis.call('HSET', jk, ARGS[i], ARGS[i + 1]) end
redis.call('ZADD', keys.tenant_jobs(tenant), created_at, job_id)
redis.call('RPUSH', keys.run_jobs(rid), job_id)
redis.call('SADD', keys.jobs_open, job_id)
table.insert(DONE, job_id)
return result('code', 'created')
