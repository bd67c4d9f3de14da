-- Retire a registration's placement: free its slot and leave the queue. ARGV: P, rid.
-- Returns {replica, slot} that was freed ('' when it held none).
local rid = ARGV[2]
local rk = regkey(rid)
local r = redis.call('HMGET', rk, 'replica', 'slot', 'base_model')
redis.call('ZREM', P .. 'regq:' .. (r[3] or ''), rid)
redis.call('HSET', rk, 'state', 'retired')
redis.call('SREM', P .. 'binding', rid)
if r[1] and r[1] ~= '' and redis.call('HGET', P .. 'slots:' .. r[1], r[2]) == rid then
  redis.call('HDEL', P .. 'slots:' .. r[1], r[2])
  return { r[1], r[2] }
end
return { '', '' }
