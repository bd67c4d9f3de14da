-- keys:
-- Record why a replica's process stays down (its supervisor gave up on it); it stays until
-- the replica announces itself again (replica_register.lua). Only a known replica: checked in
-- the same step, so a report never creates a replica record. ARGS: replica, reason.
-- Result: code = ok | not_found (nothing written).
local hk = keys.replica(ARGS[1])
if redis.call('EXISTS', hk) == 0 then return result('code', 'not_found') end
redis.call('HSET', hk, 'failed', ARGS[2])
return result('code', 'ok')
