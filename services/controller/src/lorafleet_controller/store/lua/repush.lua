-- keys: gaps ready_ctl ready_data
-- Re-queue a registration's head for the scheduler (start-up recovery: an id popped from a
-- ready queue by a controller that died before claiming it). ARGS: rid, now.
-- Result: code = ok | not_found.
local rid, now = ARGS[1], tonumber(ARGS[2])
local rk = keys.reg(rid)
local head = redis.call('HGET', rk, 'head')
if not head then return result('code', 'not_found') end
redis.call('HDEL', keys.op(opid_of(rid, head)), 'pushed')
advance(rid, now)
return result('code', 'ok')
