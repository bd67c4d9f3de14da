-- keys:
-- Record a sampler unless it exists (idempotent on its id). ARGS: sampler_id, session_id,
-- tenant, then (field, value) pairs. Result: code = created | exists.
local sampler_id, session_id, tenant = ARGS[1], ARGS[2], ARGS[3]
local sk = keys.sampler(sampler_id)
if redis.call('EXISTS', sk) == 1 then return result('code', 'exists') end
redis.call('HSET', sk, 'tenant', tenant)
for i = 4, #ARGS - 1, 2 do redis.call('HSET', sk, ARGS[i], ARGS[i + 1]) end
redis.call('SADD', keys.session_samplers(session_id), sampler_id)
return result('code', 'created')
