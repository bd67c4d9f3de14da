-- keys:
-- Placing a registration, fleet step: a free trainer slot, or its place in the queue. ARGS:
-- rid, tenant, base_model, score (when it started waiting), cap (slots one tenant may hold
-- on the base model's trainers; 0 = no cap). The caller read the run in its group first
-- (registrations.py) and confirms the slot there next (accept_place.lua); refused there, it
-- frees the slot (fleet_slot.lua).
-- Chooses the healthy trainer replica of the base model with the most free slots, and its
-- lowest free slot. Never evicts (idle runs are paged out by paging.py). The queue is
-- ordered by when each started waiting: creation time, the page-in request of a PAGED run,
-- or far ahead for a lost trainer's runs (reg_lost.lua).
-- Result: code = placed | queued | capped (its tenant holds `cap` slots: it waits, others
-- may go first), replica, slot, position.
local rid, tenant, base, score, cap = ARGS[1], ARGS[2], ARGS[3], ARGS[4], tonumber(ARGS[5])
local qk = keys.regq(base)
local function wait(code)
  redis.call('ZADD', qk, 'NX', score, rid)
  return result('code', code, 'position', redis.call('ZRANK', qk, rid) + 1)
end
if cap > 0 then  -- the slots' tenants are in the slot table's scope, not the runs' groups
  local held = 0
  for _, replica in ipairs(redis.call('SMEMBERS', keys.trainers(base))) do
    for _, t in ipairs(redis.call('HVALS', keys.slot_tenants(replica))) do
      if t == tenant then held = held + 1 end
    end
  end
  if held >= cap then return wait('capped') end
end
local best, best_free = nil, 0
for _, replica in ipairs(redis.call('SMEMBERS', keys.trainers(base))) do
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
redis.call('HSET', keys.slot_tenants(best), tostring(slot), tenant)
redis.call('ZREM', qk, rid)
return result('code', 'placed', 'replica', best, 'slot', slot)
