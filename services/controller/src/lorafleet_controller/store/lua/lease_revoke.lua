-- keys:
-- Take back what a group holds leased and does not use, first step (store/quota.py): a new
-- version of its leases, so a set still in flight is refused by the group from now.
-- ARGS: tenant ('' = the fleet's), group. Result: ver.
local k = ARGS[1] == '' and keys.fleet_quota or keys.tenant(ARGS[1])
return result('ver', redis.call('HINCRBY', k, 'v' .. ARGS[2], 1))
