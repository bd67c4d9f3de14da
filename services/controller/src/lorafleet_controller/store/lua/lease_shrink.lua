-- keys:
-- Take back what a group holds leased and does not use, second step (in the group): each
-- lease (common.lua's LEASES) becomes at most the group's use, under the revoke's version
-- (lease_revoke.lua). ARGS: tenant ('' = the fleet's), ver. Result: per lease its letter and
-- what the group holds of it now, then ver (the version they are under).
local tenant, ver = ARGS[1], tonumber(ARGS[2])
local k = tenant == '' and keys.fleet_share or keys.share(tenant)
local held = tonumber(redis.call('HGET', k, 'lver') or '0')
local out = {}
for kind, use in pairs(LEASES) do
  local f = redis.call('HMGET', k, use, 'l' .. kind)
  local lease = tonumber(f[2] or '0')
  if ver > held then
    lease = math.min(lease, tonumber(f[1] or '0'))
    redis.call('HSET', k, 'l' .. kind, lease)
  end
  table.insert(out, kind)
  table.insert(out, lease)
end
if ver > held then
  redis.call('HSET', k, 'lver', ver)
  held = ver
end
table.insert(out, 'ver')
table.insert(out, held)
return out
