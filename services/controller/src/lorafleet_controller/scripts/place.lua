-- Place a registration on a free trainer slot, or queue it. ARGV: P, rid, now, queue_score.
-- Chooses the healthy trainer replica of the registration's base model with the most free
-- slots, and its lowest free slot. Never evicts. Returns {'placed', replica, slot},
-- {'queued', position}, {'retired'} or {'bound', replica, slot} (already placed).
local rid, now, score = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local rk = regkey(rid)
local r = redis.call('HMGET', rk, 'state', 'base_model', 'replica', 'slot')
if not r[1] or r[1] == 'retired' then return { 'retired' } end
if (r[1] == 'ready' or r[1] == 'binding') and r[3] and r[3] ~= '' then
  return { 'bound', r[3], r[4] }
end
local best, best_free = nil, 0
for _, replica in ipairs(redis.call('SMEMBERS', P .. 'trainers:' .. r[2])) do
  local h = redis.call('HMGET', P .. 'replica:' .. replica, 'healthy', 'num_slots')
  if h[1] == '1' then
    local free = tonumber(h[2]) - redis.call('HLEN', P .. 'slots:' .. replica)
    if free > best_free or (free == best_free and free > 0 and best ~= nil and replica < best) then
      best, best_free = replica, free
    end
  end
end
local qk = P .. 'regq:' .. r[2]
if best == nil then
  if not redis.call('ZSCORE', qk, rid) then redis.call('ZADD', qk, score, rid) end
  if r[1] ~= 'unavailable' then redis.call('HSET', rk, 'state', 'queued') end
  return { 'queued', redis.call('ZRANK', qk, rid) + 1 }
end
local n = tonumber(redis.call('HGET', P .. 'replica:' .. best, 'num_slots'))
local slot = 0
while slot < n and redis.call('HEXISTS', P .. 'slots:' .. best, tostring(slot)) == 1 do
  slot = slot + 1
end
redis.call('HSET', P .. 'slots:' .. best, tostring(slot), rid)
redis.call('HSET', rk, 'state', 'binding', 'replica', best, 'slot', slot)
redis.call('ZREM', qk, rid)
redis.call('SADD', P .. 'binding', rid)
return { 'placed', best, tostring(slot) }
