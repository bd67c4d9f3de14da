-- keys: results depth gaps ready_ctl ready_data fleet_share
-- Admit an operation at (rid, seq), in the registration's group. ARGS: rid, seq, digest,
-- kind, payload, now, tenant, max_reg (open operations per registration), born_error (JSON,
-- '' = none), window, rate (the tenant's admission bucket; 0 = no bucket).
-- Limits and the window are checked before anything is written, so a refused seq_id stays
-- free; a hole-filling seq_id is held to the byte limits alone, and at the head to none (the
-- operations behind it may hold what it needs: refused, the run could never move, while a
-- hole further on becomes the head in time; unchecked, a client could skip ahead and fill a
-- window of holes with the largest payloads); a born-FAILED record (a rejected payload)
-- only needs room for its result. The registration's limit is exact here. The tenant's and
-- the fleet's limits (open operations and their payload bytes, unacknowledged results and
-- their bytes: common.lua's needs) and the tenant's bucket tokens are leased to the group
-- (store/quota.py): when the group does not hold enough for a new seq_id, the answer is
-- need_lease with the scopes short and what each needs, the caller leases more (or is
-- refused with that scope) and submits again. Every new seq_id spends a token; a hole-filling
-- one too (the balance may go negative) but is never refused, so a gap cannot wait on the
-- bucket and a tenant cannot dodge it by submitting ahead and filling behind.
-- Result: code = created | duplicate | conflict | not_found | retired | released | window
-- | unavailable
-- | backpressure (scope registration) | need_lease (need: scopes; want: the lease of each
-- the group must hold, for `rate` the whole tokens it must get, more than 1 after
-- hole-filling admissions left its balance negative), with operation_id, state,
-- head, reason, corrupted, failed as they apply; page_in (its base model) when a PAGED
-- registration is to wait for a slot again (the caller queues it: fleet_slot.lua).
local rid, seq, digest, kind, payload = ARGS[1], tonumber(ARGS[2]), ARGS[3], ARGS[4], ARGS[5]
local now, tenant, max_reg = tonumber(ARGS[6]), ARGS[7], tonumber(ARGS[8])
local born_error, window, rate = ARGS[9], tonumber(ARGS[10]), tonumber(ARGS[11])
local rk = keys.reg(rid)
local reg = redis.call('HMGET', rk, 'tenant', 'state', 'head', 'max_seq', 'pending',
  'unavailable_reason')
if not reg[1] or reg[1] ~= tenant then return result('code', 'not_found') end
local id = opid_of(rid, seq)
local ok = keys.op(id)
local existing = redis.call('HMGET', ok, 'digest', 'state')
if existing[2] then
  local code = existing[1] == digest and 'duplicate' or 'conflict'
  return result('code', code, 'operation_id', id, 'state', existing[2])
end
if reg[2] == REG.RETIRED then
  return result('code', 'retired', 'corrupted', redis.call('HGET', rk, 'corrupted') or '',
    'failed', redis.call('HGET', rk, 'failed') or '')
end
local head, max_seq = tonumber(reg[3]), tonumber(reg[4])
-- Below the head with no record: it ran and was released (common.lua's compactable).
if seq < head then return result('code', 'released', 'head', head) end
if seq >= head + window then return result('code', 'window', 'head', head) end
if reg[2] == REG.UNAVAILABLE then return result('code', 'unavailable', 'reason', reg[6] or '') end
local size = born_error == '' and #payload or nil  -- the bytes it holds open (nil: none)
if seq > max_seq then
  if born_error == '' and tonumber(reg[5]) >= max_reg then
    return result('code', 'backpressure', 'scope', 'registration')
  end
  local need, want = needs(tenant, size, true)
  local tokens = tonumber(redis.call('HGET', keys.share(tenant), 'tokens') or '0')
  if rate > 0 and tokens < 1 then
    table.insert(need, 'rate')
    table.insert(want, math.ceil(1 - tokens))
  end
  if #need > 0 then return result('code', 'need_lease', 'need', need, 'want', want) end
elseif seq > head then
  local need, want = needs(tenant, size, false)
  if #need > 0 then return result('code', 'need_lease', 'need', need, 'want', want) end
end
if rate > 0 then redis.call('HINCRBYFLOAT', keys.share(tenant), 'tokens', -1) end
redis.call('HSET', ok, 'rid', rid, 'tenant', tenant, 'seq', seq, 'kind', kind, 'digest', digest,
  'submitted_at', now, 'ordered', '1')
local state = OP.QUEUED
if born_error ~= '' then
  state = OP.FAILED
  redis.call('HSET', ok, 'state', OP.FAILED, 'error', born_error, 'finished_at', now,
    'rbytes', #born_error)
  count(tenant, 'unacked', 1)
  count(tenant, 'unacked_bytes', #born_error)
  redis.call('ZADD', keys.results, now, id)
else
  redis.call('HSET', ok, 'state', OP.QUEUED, 'payload', payload, 'bytes', #payload)
  redis.call('HINCRBY', rk, 'pending', 1)
  count(tenant, 'pending', 1)
  count(tenant, 'pending_bytes', #payload)
end
depth(state, 1)
if seq > max_seq then redis.call('HSET', rk, 'max_seq', seq) end
redis.call('HSET', rk, 'last_request_time', now)
advance(rid, now)
if reg[2] == REG.PAGED and state == OP.QUEUED then  -- the caller queues it (paging.py)
  local base = redis.call('HGET', rk, 'base_model')
  return result('code', 'created', 'operation_id', id, 'state', state, 'page_in', base)
end
return result('code', 'created', 'operation_id', id, 'state', state)
