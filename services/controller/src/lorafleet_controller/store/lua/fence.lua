-- keys: retired claimed results depth gaps ready_ctl ready_data fleet_share
-- Fail every open operation of a registration and set its state. ARGS: rid, now, new_state
-- (REG.RETIRED or REG.UNAVAILABLE), error JSON, reason text. A retired registration enters
-- the `retired` index so the sweeper deletes its operation records once their results
-- outlive the result TTL. Result: code = ok | not_found, failed (operations failed), tenant.
local rid, now, new_state, err, reason = ARGS[1], tonumber(ARGS[2]), ARGS[3], ARGS[4], ARGS[5]
local rk = keys.reg(rid)
local tenant = redis.call('HGET', rk, 'tenant')
if not tenant then return result('code', 'not_found') end
if new_state == REG.RETIRED then
  if redis.call('HGET', rk, 'state') ~= REG.RETIRED then redis.call('ZADD', keys.retired, now, rid) end
  retire_state(rid)
else
  redis.call('HSET', rk, 'state', new_state)
end
if reason ~= '' then redis.call('HSET', rk, 'unavailable_reason', reason) end
local n = fail_open(rid, err, now)
advance(rid, now)
return result('code', 'ok', 'failed', n, 'tenant', tenant)
