-- Re-queue a registration's head for the scheduler (start-up recovery: an id popped from a
-- ready list by a controller that died before claiming it). ARGV: P, rid, now.
local rid, now = ARGV[2], tonumber(ARGV[3])
local rk = regkey(rid)
if not redis.call('HGET', rk, 'head') then return 0 end
redis.call('HDEL', opkey(opid_of(rid, redis.call('HGET', rk, 'head'))), 'pushed')
advance(rid, now)
return 1
