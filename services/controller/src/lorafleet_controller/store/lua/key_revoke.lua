-- keys:
-- Revoke an API key if it exists (a revoked key stays listed, marked revoked; revoking
-- twice is a no-op). ARGS: key_id. Result: code = revoked | not_found.
local kk = keys.api_key(ARGS[1])
if redis.call('EXISTS', kk) == 0 then return result('code', 'not_found') end
redis.call('HSET', kk, 'revoked', '1')
return result('code', 'revoked')
