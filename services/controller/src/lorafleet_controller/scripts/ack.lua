-- Acknowledge a terminal result. ARGV: P, opid, tenant.
-- Returns 'ok', 'not_found' (unknown or another tenant's) or 'open' (not terminal yet).
local id, tenant = ARGV[2], ARGV[3]
local f = redis.call('HMGET', opkey(id), 'state', 'tenant')
if not f[1] or f[2] ~= tenant then return 'not_found' end
local st = tonumber(f[1])
if st == QUEUED or st == CLAIMED then return 'open' end
expire(id)
return 'ok'
