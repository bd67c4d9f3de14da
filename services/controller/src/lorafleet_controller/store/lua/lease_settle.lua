-- keys:
-- Take back what a group holds leased and does not use, last step (the coordinator): its
-- leases become what the group kept (lease_shrink.lua), unless a newer lease was granted it
-- since (then the count stays as it is: more than the group holds, never less).
-- ARGS: tenant ('' = the fleet's), group, ver, then pairs of a lease's letter and what the
-- group kept of it. Result: code = settled | newer.
local tenant, group, ver = ARGS[1], ARGS[2], tonumber(ARGS[3])
local k = tenant == '' and keys.fleet_quota or keys.tenant(tenant)
if tonumber(redis.call('HGET', k, 'v' .. group) or '0') ~= ver then
  return result('code', 'newer')
end
for i = 4, #ARGS, 2 do
  local kind, kept = ARGS[i], tonumber(ARGS[i + 1])
  local old = tonumber(redis.call('HGET', k, kind .. group) or '0')
  if kept < old then
    redis.call('HSET', k, kind .. group, kept)
    redis.call('HINCRBY', k, 'sum_' .. kind, kept - old)
  end
end
return result('code', 'settled')
