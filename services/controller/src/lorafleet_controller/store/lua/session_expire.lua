-- keys: sessions_finished
-- Forget a finished session (the leader's sweep, fenced): its record and its lists of runs
-- and samplers, and its place in the tenant's sessions. The runs and samplers themselves,
-- and the checkpoints they saved, are not touched. ARGS: session_id.
-- Result: code = expired | live (not finished: left as it is).
local session_id = ARGS[1]
local sk = keys.session(session_id)
local tenant, finished = unpack(redis.call('HMGET', sk, 'tenant', 'finished'))
if tenant and finished ~= '1' then
  redis.call('ZREM', keys.sessions_finished, session_id)
  return result('code', 'live')
end
if tenant then redis.call('ZREM', keys.tenant_sessions(tenant), session_id) end
redis.call('DEL', sk, keys.session_runs(session_id), keys.session_samplers(session_id))
redis.call('ZREM', keys.sessions_finished, session_id)
return result('code', 'expired')
