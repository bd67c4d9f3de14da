-- keys: sessions_live
-- Finish the tenant's session: marked finished with its reason and out of the live set, so
-- the sweeper no longer sees it silent and heartbeats are refused. Fenced when the leader
-- calls it (the sweeper's expiry of a silent session, a job's end): a deposed leader cannot
-- finish a session the new leader still hears from. ARGS: session_id, tenant, reason.
-- Result: code = finished | not_found (no such session of this tenant).
local session_id, tenant, reason = ARGS[1], ARGS[2], ARGS[3]
local sk = keys.session(session_id)
if redis.call('HGET', sk, 'tenant') ~= tenant then return result('code', 'not_found') end
redis.call('HSET', sk, 'finished', '1', 'finish_reason', reason)
redis.call('ZREM', keys.sessions_live, session_id)
return result('code', 'finished')
