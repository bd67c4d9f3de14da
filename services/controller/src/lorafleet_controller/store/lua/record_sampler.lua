-- keys:
-- Record a sampler unless it exists (idempotent on its id). ARGS: sampler_id, session_id,
-- tenant, holds (the published version it pins, `<rid>@<version>`; '' for a sampler on the
-- base model or an inflight one, which follows its run's newest), then (field, value) pairs.
-- A pinned version that was collected meanwhile (version_gc.py) is not pinned again.
-- Result: code = created | exists | gone.
local sampler_id, session_id, tenant, holds = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
local sk = keys.sampler(sampler_id)
-- (a stub without base_model is the hold publish_live.lua made for a sampler's own version)
if redis.call('HEXISTS', sk, 'base_model') == 1 then return result('code', 'exists') end
if holds ~= '' then
  if redis.call('EXISTS', keys.adapter(holds)) == 0 then return result('code', 'gone') end
  redis.call('SADD', keys.adapter_refs(holds), 's:' .. sampler_id)
end
redis.call('HSET', sk, 'tenant', tenant, 'holds', holds)
for i = 5, #ARGS - 1, 2 do redis.call('HSET', sk, ARGS[i], ARGS[i + 1]) end
redis.call('SADD', keys.session_samplers(session_id), sampler_id)
return result('code', 'created')
