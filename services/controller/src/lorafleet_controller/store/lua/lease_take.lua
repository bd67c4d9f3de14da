-- keys:
-- Lease a group more of a limit (store/quota.py), at its coordinator: the tenant's hash, or
-- the fleet's (`tenant` ''). ARGS: tenant, group, kind (a letter of common.lua's LEASES: 'p'
-- open operations, 'u' unacknowledged results, 'b' open operations' payload bytes, 'r'
-- unacknowledged results' bytes), limit, chunk, want (the lease the group must hold to admit
-- its operation). The group's lease grows to `want`, or by `chunk` where that is more, out of
-- what no group holds; less than `want` would be held without admitting anything, so then
-- nothing is granted. Where the group is counted as holding `want` already (a concurrent
-- call's grant, or one whose set a crash lost), nothing more is leased. Either way the
-- answer is the group's lease whole (the group sets it, not adds it: lease_set.lua) under a
-- new version of the group's leases, so a replayed or late set changes nothing.
-- Result: code = granted | none (less than `want` is left unleased), lease, ver.
local tenant, group, kind = ARGS[1], ARGS[2], ARGS[3]
local limit, chunk, want = tonumber(ARGS[4]), tonumber(ARGS[5]), tonumber(ARGS[6])
local k = tenant == '' and keys.fleet_quota or keys.tenant(tenant)
local held = tonumber(redis.call('HGET', k, kind .. group) or '0')
if held < want then
  local avail = limit - tonumber(redis.call('HGET', k, 'sum_' .. kind) or '0')
  if avail < want - held then return result('code', 'none', 'lease', 0, 'ver', 0) end
  local grant = math.min(math.max(chunk, want - held), avail)
  redis.call('HINCRBY', k, 'sum_' .. kind, grant)
  held = redis.call('HINCRBY', k, kind .. group, grant)
end
local ver = redis.call('HINCRBY', k, 'v' .. group, 1)
return result('code', 'granted', 'lease', held, 'ver', ver)
