-- Place a registration on a free trainer slot, or queue it. ARGS: rid, now.
-- Chooses the healthy trainer replica of the registration's base model with the most free
-- slots, and its lowest free slot. Never evicts. The queue is ordered by creation time.
-- Result: code = placed | bound (already placed) | queued | retired, replica, slot, position.
local rid, now = ARGS[1], tonumber(ARGS[2])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'base_model', 'replica', 'slot', 'created_at')
if not r[1] or r[1] == REG.RETIRED then return result('code', 'retired') end
if (r[1] == REG.READY or r[1] == REG.BINDING) and r[3] and r[3] ~= '' then
  return result('code', 'bound', 'replica', r[3], 'slot', r[4])
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
local qk = keys.regq(r[2])
if best == nil then
  if not redis.call('ZSCORE', qk, rid) then redis.call('ZADD', qk, r[5] or now, rid) end
  if r[1] ~= REG.UNAVAILABLE then redis.call('HSET', rk, 'state', REG.QUEUED) end
  return result('code', 'queued', 'position', redis.call('ZRANK', qk, rid) + 1)
end
local n = tonumber(redis.call('HGET', keys.replica(best), 'num_slots'))
local sk = keys.slots(best)
local slot = 0
while slot < n and redis.call('HEXISTS', sk, tostring(slot)) == 1 do slot = slot + 1 end
redis.call('HSET', sk, tostring(slot), rid)
redis.call('HSET', rk, 'state', REG.BINDING, 'replica', best, 'slot', slot)
redis.call('ZREM', qk, rid)
redis.call('SADD', keys.binding, rid)
return result('code', 'placed', 'replica', best, 'slot', slot)
