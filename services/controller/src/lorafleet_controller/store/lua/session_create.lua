-- keys: sessions_live
-- Open a live session unless the API key that opens it is revoked (checked in the same
-- script, so a key revoked meanwhile cannot open one that its revocation would miss).
-- ARGS: session_id, tenant, key_id ('' = opened by the controller itself), now, tags (JSON),
-- metadata (JSON), sdk_version, project_id, display_name.
-- Result: code = created | revoked (nothing written).
local session_id, tenant, key_id, now = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
if key_id ~= '' and redis.call('HGET', keys.api_key(key_id), 'revoked') == '1' then
  return result('code', 'revoked')
end
redis.call('HSET', keys.session(session_id), 'tenant', tenant, 'tags', ARGS[5], 'metadata',
  ARGS[6], 'sdk_version', ARGS[7], 'project_id', ARGS[8], 'display_name', ARGS[9],
  'created_at', now, 'finished', '0', 'last_heartbeat', now, 'key_id', key_id)
if key_id ~= '' then redis.call('SADD', keys.key_sessions(key_id), session_id) end
redis.call('ZADD', keys.tenant_sessions(tenant), now, session_id)
redis.call('ZADD', keys.sessions_live, now, session_id)
return result('code', 'created')
