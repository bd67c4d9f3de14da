-- keys: sessions_live
-- A heartbeat of the tenant's live session: its last_heartbeat and its place among the live
-- sessions move to `now` (a finished session is not made live again). ARGS: session_id,
-- tenant, now. Result: code = ok | not_found (no such session of this tenant) | finished.
local session_id, tenant, now = ARGS[1], ARGS[2], ARGS[3]
local sk = keys.session(session_id)
local s = redis.call('HMGET', sk, 'tenant', 'finished')
if s[1] ~= tenant then return result('code', 'not_found') end
if s[2] == '1' then return result('code', 'finished') end
redis.call('HSET', sk, 'last_heartbeat', now)
redis.call('ZADD', keys.sessions_live, 'XX', now, session_id)
return result('code', 'ok')
