-- keys: paging
-- Start paging a bound registration out (paging.py). ARGS: rid, replica, slot, idle_before
-- (0 = forced). It must still hold that slot, READY, with no operation in flight (its head is
-- not CLAIMED); an idle page-out (idle_before > 0) also needs no open operation and no
-- submission or outcome since idle_before. PAGING stops its claims (they need READY) while
-- the trainer snapshots it; it keeps its slot until page_end.
-- Result: code = ok | busy | moved, seq (the last seq_id the slot's state covers: head - 1),
-- pending (its open operations).
local rid, replica, slot, idle_before = ARGS[1], ARGS[2], ARGS[3], tonumber(ARGS[4])
local rk = keys.reg(rid)
local r = redis.call('HMGET', rk, 'state', 'replica', 'slot', 'head', 'pending',
  'last_request_time', 'last_done')
if r[1] ~= REG.READY or r[2] ~= replica or r[3] ~= slot then return result('code', 'moved') end
local head, pending = tonumber(r[4]), tonumber(r[5])
if op_state(opid_of(rid, head)) == OP.CLAIMED then return result('code', 'busy') end
if idle_before > 0 then
  local last = math.max(tonumber(r[6] or '0'), tonumber(r[7] or '0'))
  if pending > 0 or last >= idle_before then return result('code', 'busy') end
end
redis.call('HSET', rk, 'state', REG.PAGING)
redis.call('SADD', keys.paging, rid)
return result('code', 'ok', 'seq', head - 1, 'pending', pending)
