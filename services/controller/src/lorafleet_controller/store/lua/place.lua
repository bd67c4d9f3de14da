-- keys: binding
-- Place a registration on a free trainer slot, or queue it. ARGS: rid, now, cap (slots one
-- tenant may hold on the base model's trainers; 0 = no cap).
-- Chooses the healthy trainer replica of the registration's base model with the most free
-- slots, and its lowest free slot. Never evicts (idle runs are paged out by paging.py). The
-- queue is ordered by when each started waiting: creation time, the page-in request of a
-- PAGED run, or far ahead for a lost trainer's runs (replica_lost.lua).
-- Result: code = placed | bound (already placed) | queued | capped (its tenant holds `cap`
-- slots: it waits, others may go first) | retired, replica, slot, position.
local rid, now, cap = ARGS[1], tonumber(ARGS[2]), tonumber(ARGS[3])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'base_model', 'replica', 'slot', 'created_at',
  'tenant')
if not r[1] or r[1] == REG.RETIRED then return result('code', 'retired') end
local placed = r[1] == REG.READY or r[1] == REG.BINDING or r[1] == REG.PAGING
if placed and r[3] and r[3] ~= '' then
  return result('code', 'bound', 'replica', r[3], 'slot', r[4])
end
local qk = keys.regq(r[2])
local function wait(code)
  local score = r[1] == REG.PAGED and now or (r[5] or now)
  if not redis.call('ZSCORE', qk, rid) then redis.call('ZADD', qk, score, rid) end
  if r[1] ~= REG.UNAVAILABLE and r[1] ~= REG.PAGED then
    redis.call('HSET', rk, 'state', REG.QUEUED)
  end
  return result('code', code, 'position', redis.call('ZRANK', qk, rid) + 1)
end
if cap > 0 then  -- the slots' tenants are in the slot table's scope, not the runs' groups
  local held = 0
  for _, replica in ipairs(redis.call('SMEMBERS', keys.trainers(r[2]))) do
    for _, tenant in ipairs(redis.call('HVALS', keys.slot_tenants(replica))) do
      if tenant == r[6] then held = held + 1 end
    end
  end
  if held >= cap then return wait('capped') end
end
local best, best_free = nil, 0
for _, replica in ipairs(redis.call('SMEMBERS', keys.trainers(r[2]))) do
  local h = redis.call('HMGET', keys.replica(replica), 'healthy', 'num_slots')
  if h[1] == '1' then
    local free = tonumber(h[2]) - redis.call('HLEN', keys.slots(replica))
    if free > best_free or (free == best_free and free > 0 and best ~= nil and replica < best) then
      best, best_free = replica, free
    end
  end
end
if best == nil then return wait('queued') end
local n = tonumber(redis.call('HGET', keys.replica(best), 'num_slots'))
local sk = keys.slots(best)
local slot = 0
while slot < n and redis.call('HEXISTS', sk, tostring(slot)) == 1 do slot = slot + 1 end
redis.call('HSET', sk, tostring(slot), rid)
redis.call('HSET', keys.slot_tenants(best), tostring(slot), r[6])
redis.call('HSET', rk, 'state', REG.BINDING, 'replica', best, 'slot', slot)
redis.call('ZREM', qk, rid)
redis.call('SADD', keys.binding, rid)
return result('code', 'placed', 'replica', best, 'slot', slot)
