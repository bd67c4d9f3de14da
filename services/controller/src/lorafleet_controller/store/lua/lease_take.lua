-- keys:
-- Lease a group more of a limit (store/quota.py), at its coordinator: the tenant's hash, or
-- the fleet's (`tenant` ''). ARGS: tenant, group, kind ('p': open operations, 'u':
-- unacknowledged results), limit, chunk. Grants up to `chunk` of what no group holds,
-- as the group's new lease, whole (the group sets it, not adds it: lease_set.lua), under a
-- new version of the group's leases, so a replayed or late set changes nothing.
-- Result: code = granted | none (every unit is leased), lease, ver.
local tenant, group, kind = ARGS[1], ARGS[2], ARGS[3]
local limit, chunk = tonumber(ARGS[4]), tonumber(ARGS[5])
local k = tenant == '' and keys.fleet_quota or keys.tenant(tenant)
local avail = limit - tonumber(redis.call('HGET', k, 'sum_' .. kind) or '0')
if avail <= 0 then return result('code', 'none', 'lease', 0, 'ver', 0) end
local grant = math.min(chunk, avail)
redis.call('HINCRBY', k, 'sum_' .. kind, grant)
local lease = redis.call('HINCRBY', k, kind .. group, grant)
local ver = redis.call('HINCRBY', k, 'v' .. group, 1)
return result('code', 'granted', 'lease', lease, 'ver', ver)
