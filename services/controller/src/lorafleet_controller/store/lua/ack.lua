-- fleet-keys: unacked results depth
-- Acknowledge a terminal result. ARGS: opid, tenant.
-- Result: code = ok | not_found (unknown or another tenant's) | open (not terminal yet).
local id, tenant = ARGS[1], ARGS[2]
local f = redis.call('HMGET', keys.op(id), 'state', 'tenant')
if not f[1] or f[2] ~= tenant then return result('code', 'not_found') end
local st = tonumber(f[1])
if st == OP.QUEUED or st == OP.CLAIMED then return result('code', 'open') end
expire(id)
return result('code', 'ok')
