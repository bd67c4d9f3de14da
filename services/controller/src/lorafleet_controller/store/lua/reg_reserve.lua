-- keys: regs reserving
-- Creating a registration, first step (fleet): reserve its id for its tenant. ARGS: rid,
-- tenant, session_id, created_at, max_registrations (the tenant's live registrations).
-- The tenant's live runs are the members of its live set, so a replayed reservation counts
-- once and a retirement (reg_retired.lua) uncounts once. `reserving` keeps the reservation
-- until the record exists in the run's group (create_reg.lua, then reg_created.lua); the
-- sweep undoes one whose record never came (registrations.py).
-- Result: code = reserved (now or before) | limit (nothing written).
local rid, tenant, session_id, created_at = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
local max_regs = tonumber(ARGS[5])
if redis.call('SISMEMBER', keys.regs, rid) == 1 then return result('code', 'reserved') end
local live = keys.tenant_live(tenant)
if redis.call('SCARD', live) >= max_regs then return result('code', 'limit') end
redis.call('SADD', keys.regs, rid)
redis.call('SADD', live, rid)
redis.call('ZADD', keys.tenant_regs(tenant), created_at, rid)
redis.call('SADD', keys.session_runs(session_id), rid)
redis.call('HSET', keys.reserving, rid, cjson.encode({ tenant = tenant, session = session_id,
  at = tonumber(created_at) }))
return result('code', 'reserved')
