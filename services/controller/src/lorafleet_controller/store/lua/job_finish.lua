-- keys: jobs_open
-- End a job (the leader's runner only, fenced): its final state and fields, its progress of
-- the pass in progress cleared, its version bumped, and out of its run's queue and of the
-- open set a new leader resumes; its data (up to the gateway's body limit, needed only to
-- run it) is dropped, so a tenant's finished jobs keep only their results. A job whose
-- record is gone only leaves the indexes.
-- ARGS: job_id, rid, state, finished_at, then (field, value) pairs.
-- Result: code = finished | missing.
local job_id, rid, state, finished_at = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
local jk = keys.job(job_id)
redis.call('LREM', keys.run_jobs(rid), 0, job_id)
redis.call('SREM', keys.jobs_open, job_id)
if redis.call('EXISTS', jk) == 0 then return result('code', 'missing') end
for i = 5, #ARGS - 1, 2 do redis.call('HSET', jk, ARGS[i], ARGS[i + 1]) end
redis.call('HSET', jk, 'state', state, 'finished_at', finished_at, 'live', '[]')
redis.call('HDEL', jk, 'data')
redis.call('HINCRBY', jk, 'version', 1)
table.insert(DONE, job_id)
return result('code', 'finished')
