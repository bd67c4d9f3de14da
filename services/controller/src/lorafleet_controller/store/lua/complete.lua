-- keys: claimed results depth open_samples gaps ready_ctl ready_data usage_tenants fleet_share
-- Record the outcomes of one or more operations. ARGS: now, then per operation: opid, state,
-- result, error, from ('claimed' or 'open'), claim (the claim's number, claim_op; 0: any
-- claim), n, and n triples (op, field, value) applied to
-- the registration hash in the same transaction (op: 'set' or 'incr'), for example
-- optim_steps or the published version; op 'usage' adds value to that field of the
-- operation's tenant's usage totals instead (usage.py: counted exactly once). Result: per
-- operation 1 when recorded, 0 when it was no longer open (a fence or the sweeper won) or,
-- from 'claimed', no longer held by that claim (re-queued and claimed again: the answer to
-- the old claim came from a binding the run has since left).
local now = tonumber(ARGS[1])
local out = {}
local i = 2
while i <= #ARGS do
  local id, state, body, err, from = ARGS[i], tonumber(ARGS[i + 1]), ARGS[i + 2], ARGS[i + 3],
    ARGS[i + 4]
  local claim = tonumber(ARGS[i + 5])
  local n = tonumber(ARGS[i + 6])
  local effects = i + 7
  i = effects + 3 * n
  local held = from ~= 'claimed' or (op_state(id) == OP.CLAIMED and (claim == 0 or
    tonumber(redis.call('HGET', keys.op(id), 'claim') or '0') == claim))
  local recorded = 0
  if held and finish(id, state, body, err, now) then
    recorded = 1
    local ok = keys.op(id)
    local rid = redis.call('HGET', ok, 'rid')
    for e = effects, i - 1, 3 do
      if ARGS[e] == 'set' then  -- only an ordered operation's, in its registration's group
        redis.call('HSET', keys.reg(rid), ARGS[e + 1], ARGS[e + 2])
      elseif ARGS[e] == 'incr' then
        redis.call('HINCRBY', keys.reg(rid), ARGS[e + 1], tonumber(ARGS[e + 2]))
      elseif ARGS[e] == 'usage' then
        local tenant = redis.call('HGET', ok, 'tenant')
        redis.call('HINCRBY', keys.usage(tenant), ARGS[e + 1], tonumber(ARGS[e + 2]))
        redis.call('SADD', keys.usage_tenants, tenant)
      end
    end
    if redis.call('HGET', ok, 'ordered') == '1' then advance(rid, now) end
  end
  table.insert(out, recorded)
end
return out
