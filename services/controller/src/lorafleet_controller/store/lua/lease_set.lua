-- keys:
-- A lease the coordinator granted (lease_take.lua), set in the call's group. ARGS: tenant
-- ('' = the fleet's), kind (a letter of common.lua's LEASES), lease, ver. Only a newer
-- version than the group's is set, so a set that arrives late (after a revoke,
-- lease_shrink.lua) changes nothing.
-- Result: code = set | stale.
local tenant, kind, lease, ver = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4])
local k = tenant == '' and keys.fleet_share or keys.share(tenant)
if ver <= tonumber(redis.call('HGET', k, 'lver') or '0') then return result('code', 'stale') end
redis.call('HSET', k, 'l' .. kind, lease, 'lver', ver)
return result('code', 'set')
