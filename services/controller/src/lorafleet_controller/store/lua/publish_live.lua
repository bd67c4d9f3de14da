-- keys: run_newest versions_unheld
-- Record an adapter version live: its record and its base model's live index together.
-- ARGS: adapter id (`<rid>@<version>`), base_model, rid, version, files_dir, lora (bytes),
-- refs (WriteSharedAdapterResponse bytes, empty files when streamed), tenant, newest ('1':
-- the run's own publish, which becomes the version its inflight samplers follow and lets
-- the one before go), now, then for a sampler's own version (newest '0') the sampler id and
-- its session: the version is held for that sampler from this step on (its record, written
-- later by record_sampler.lua, completes the stub made here; an expiring session lets go
-- of it either way, so a controller killed in between leaks nothing). Result: code = live.
local aid, base_model, rid, version = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
local now = tonumber(ARGS[10])
redis.call('HSET', keys.adapter(aid), 'files_dir', ARGS[5], 'lora', ARGS[6], 'base_model',
  base_model, 'rid', rid, 'version', version, 'refs', ARGS[7], 'tenant', ARGS[8])
redis.call('ZADD', keys.live(base_model), version, aid)
if ARGS[9] == '1' then
  local old = redis.call('HGET', keys.run_newest, rid)
  if not old or tonumber(old) < tonumber(version) then
    redis.call('HSET', keys.run_newest, rid, version)
    if old then let_go(rid .. '@' .. old, now) end
  end
else
  local sampler_id, session_id = ARGS[11], ARGS[12]
  local sk = keys.sampler(sampler_id)
  if redis.call('HEXISTS', sk, 'base_model') == 0 then
    redis.call('HSET', sk, 'tenant', ARGS[8], 'holds', aid)
    redis.call('SADD', keys.session_samplers(session_id), sampler_id)
  end
  redis.call('SADD', keys.adapter_refs(aid), 's:' .. sampler_id)
end
return result('code', 'live')
