-- keys: usage_tenants
-- Bill `dt` seconds of trainer-slot residency: each registration holding a slot adds dt to
-- its tenant's adapter_seconds, all tenants in one step. The leader's sweeper calls it,
-- fenced, so a deposed leader that still ticks cannot bill the same seconds twice.
-- ARGS: dt, then the registration id of every occupied slot (a registration holding two
-- slots is listed twice). Result: tenants = how many tenants were billed.
local dt = tonumber(ARGS[1])
local slots = {}
for i = 2, #ARGS do
  local tenant = redis.call('HGET', keys.reg(ARGS[i]), 'tenant')
  if tenant and tenant ~= '' then slots[tenant] = (slots[tenant] or 0) + 1 end
end
local n = 0
for tenant, count in pairs(slots) do
  redis.call('HINCRBYFLOAT', keys.usage(tenant), 'adapter_seconds', count * dt)
  redis.call('SADD', keys.usage_tenants, tenant)
  n = n + 1
end
return result('tenants', n)
