-- keys:
-- Take back what a group holds leased and does not use, second step (in the group): each
-- lease becomes at most the group's use, under the revoke's version (lease_revoke.lua).
-- ARGS: tenant ('' = the fleet's), ver. Result: lp, lu (the group's leases now), ver (the
-- version they are under).
local tenant, ver = ARGS[1], tonumber(ARGS[2])
local k = tenant == '' and keys.fleet_share or keys.share(tenant)
local f = redis.call('HMGET', k, 'pending', 'unacked', 'lp', 'lu', 'lver')
local lp, lu, held = tonumber(f[3] or '0'), tonumber(f[4] or '0'), tonumber(f[5] or '0')
if ver > held then
  lp = math.min(lp, tonumber(f[1] or '0'))
  lu = math.min(lu, tonumber(f[2] or '0'))
  redis.call('HSET', k, 'lp', lp, 'lu', lu, 'lver', ver)
  held = ver
end
return result('lp', lp, 'lu', lu, 'ver', held)
