-- keys: binding
-- Retire a registration's placement, group step: RETIRED, no longer binding; the caller then
-- frees its slot and takes it out of the queue (fleet_slot.lua) and out of its tenant's live
-- runs (reg_retired.lua). ARGS: rid.
-- Result: replica and slot it held ('' when none), base_model, tenant ('' for no
-- registration).
local rid = ARGS[1]
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'replica', 'slot', 'base_model', 'tenant')
if not r[4] then return result('replica', '', 'slot', '', 'base_model', '', 'tenant', '') end
retire_state(rid)
redis.call('SREM', keys.binding, rid)
return result('replica', r[1] or '', 'slot', r[2] or '', 'base_model', r[3] or '', 'tenant', r[4])
