-- keys:
-- Write fields of an existing job and bump its version, waking its long polls (fenced when
-- the leader's runner writes progress; a cancel request from any replica is not).
-- ARGS: job_id, then (field, value) pairs. Result: code = updated | missing.
local job_id = ARGS[1]
local jk = keys.job(job_id)
if redis.call('EXISTS', jk) == 0 then return result('code', 'missing') end
for i = 2, #ARGS - 1, 2 do redis.call('HSET', jk, ARGS[i], ARGS[i + 1]) end
redis.call('HINCRBY', jk, 'version', 1)
table.insert(DONE, job_id)
return result('code', 'updated')
