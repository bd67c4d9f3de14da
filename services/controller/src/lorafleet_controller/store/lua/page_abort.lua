-- keys: paging gaps ready_ctl ready_data
-- Give up a page-out (the trainer could not snapshot the slot, or the controller that began
-- it died): the registration still holds its slot and the trainer its state, so it is READY
-- again and its head is queued. ARGS: rid, now. Result: code = ready | moved.
local rid, now = ARGS[1], tonumber(ARGS[2])
local rk = keys.reg(rid)
redis.call('SREM', keys.paging, rid)
if redis.call('HGET', rk, 'state') ~= REG.PAGING then return result('code', 'moved') end
redis.call('HSET', rk, 'state', REG.READY)
advance(rid, now)
return result('code', 'ready')
