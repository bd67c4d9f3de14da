-- keys: regs reserving
-- Undo a reservation whose record never came (its creator died between the steps). ARGS:
-- rid, at (the reservation's time, as the sweep read it: a newer reservation of the id
-- is left alone). Result: code = undone | kept.
local rid, at = ARGS[1], tonumber(ARGS[2])
local raw = redis.call('HGET', keys.reserving, rid)
if not raw then return result('code', 'kept') end
local r = cjson.decode(raw)
if r.at ~= at then return result('code', 'kept') end
redis.call('HDEL', keys.reserving, rid)
redis.call('SREM', keys.regs, rid)
redis.call('SREM', keys.tenant_live(r.tenant), rid)
redis.call('ZREM', keys.tenant_regs(r.tenant), rid)
redis.call('SREM', keys.session_runs(r.session), rid)
return result('code', 'undone')
