-- keys: sessions_finished run_newest versions_unheld
-- Forget a finished session (the leader's sweep, fenced): its record, its list of runs, its
-- place in the tenant's sessions and its samplers (a session owns its sampling sessions),
-- whose published versions are let go (version_gc.py collects those nothing else holds).
-- The runs themselves and the checkpoints they saved are not touched. ARGS: session_id, now.
-- Result: code = expired | live (not finished: left as it is).
local session_id, now = ARGS[1], tonumber(ARGS[2])
local sk = keys.session(session_id)
local tenant, finished = unpack(redis.call('HMGET', sk, 'tenant', 'finished'))
if tenant and finished ~= '1' then
  redis.call('ZREM', keys.sessions_finished, session_id)
  return result('code', 'live')
end
if tenant then redis.call('ZREM', keys.tenant_sessions(tenant), session_id) end
for _, sampler_id in ipairs(redis.call('SMEMBERS', keys.session_samplers(session_id))) do
  local sampler = keys.sampler(sampler_id)
  local holds = redis.call('HGET', sampler, 'holds')
  redis.call('DEL', sampler)
  if holds and holds ~= '' then
    redis.call('SREM', keys.adapter_refs(holds), 's:' .. sampler_id)
    let_go(holds, now)
  end
end
redis.call('DEL', sk, keys.session_runs(session_id), keys.session_samplers(session_id))
redis.call('ZREM', keys.sessions_finished, session_id)
return result('code', 'expired')
