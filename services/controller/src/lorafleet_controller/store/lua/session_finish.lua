-- keys: sessions_live sessions_finished
-- Finish the tenant's session: marked finished with its reason and out of the live set, so
-- the sweeper no longer sees it silent and heartbeats are refused. Fenced when the leader
-- calls it (the sweeper's expiry of a silent session, a job's end): a deposed leader cannot
-- finish a session the new leader still hears from. It is queued (`sessions_finished`) for
-- its records to expire (session_expire), and leaves its API key's open sessions.
-- ARGS: session_id, tenant, reason, now.
-- Result: code = finished | not_found (no such session of this tenant).
local session_id, tenant, reason = ARGS[1], ARGS[2], ARGS[3]
local sk = keys.session(session_id)
if redis.call('HGET', sk, 'tenant') ~= tenant then return result('code', 'not_found') end
redis.call('HSET', sk, 'finished', '1', 'finish_reason', reason)
redis.call('ZREM', keys.sessions_live, session_id)
if redis.call('ZSCORE', keys.sessions_finished, session_id) == false then
  redis.call('ZADD', keys.sessions_finished, ARGS[4], session_id)
end
local key_id = redis.call('HGET', sk, 'key_id')
if key_id and key_id ~= '' then redis.call('SREM', keys.key_sessions(key_id), session_id) end
return result('code', 'finished')
