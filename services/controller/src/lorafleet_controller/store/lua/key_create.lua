-- keys:
-- Record a new API key: its hash, the digest → key id index and the tenant's key set, all
-- or nothing (a key findable by its digest always has its record and is listed). ARGS:
-- key_id, tenant, label, created_at, digest (SHA-256 of the plaintext, never stored itself).
-- Result: code = created.
local key_id, tenant, digest = ARGS[1], ARGS[2], ARGS[5]
redis.call('HSET', keys.api_key(key_id), 'tenant', tenant, 'label', ARGS[3], 'created_at',
  ARGS[4], 'revoked', '0', 'hash', digest)
redis.call('SET', keys.key_hash(digest), key_id)
redis.call('SADD', keys.tenant_keys(tenant), key_id)
return result('code', 'created')
