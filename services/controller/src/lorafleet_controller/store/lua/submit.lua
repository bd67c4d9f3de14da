-- keys: pending unacked results depth gaps ready_ctl ready_data
-- Admit an operation at (rid, seq). ARGS: rid, seq, digest, kind, payload, now, tenant,
-- limits (per registration, per tenant, fleet; unacked per tenant, fleet), born_error (JSON,
-- '' = none), window, rate and burst (the tenant's admission bucket; rate 0 = no bucket).
-- Limits and the window are checked before anything is written, so a refused seq_id stays
-- free; a hole-filling seq_id is always admitted; a born-FAILED record (a rejected payload)
-- only needs room for its result.
-- The bucket: each tenant holds up to `burst` tokens, refilled at `rate` per second of `now`,
-- and every new seq_id costs one. A seq_id past max_seq with no whole token is refused
-- (backpressure, scope 'rate'), so one tenant's flood is held at `rate` admissions per second
-- before it reaches the ready queues and cannot crowd out another tenant's steps. The refusal
-- says to retry when the bucket is half full again, not when one token is: a tenant flooding
-- from N runs would otherwise retry N times per token, a herd of refused scripts that costs
-- the controller more than the admissions it limits (bench/fairness.py: A's p99 ratio 3.6
-- with one-token retries, see the README for the half-bucket figure). Each registration
-- then waits an offset of its own (from a hash of its id) of up to a tenth of that window
-- (RETRY_SPREAD), so a tenant's refused runs do not all come back in the same millisecond, a
-- herd whose admissions queue ahead of another tenant's step; spread over the whole window
-- instead, the flood never pauses and the other tenant's median step pays (bench/fairness.py
-- under SCHED_FIFO: A's p99 / alone 1.66-1.96 with the herd, 1.56 spread over a tenth, p50
-- 1.02, 1.03-1.08; over the whole window p99 1.54-1.98 but p50 1.61). The sustained rate is
-- the same either way. A hole-filling seq_id pays too (the balance may go
-- negative) but is never refused, so a gap cannot wait on the bucket and a tenant cannot
-- dodge it by submitting ahead and filling behind. Refill is a function of the stored balance
-- and time only, so a refusal writes nothing; `now` never runs backwards for the bucket (a
-- replica whose clock lags refills nothing until it catches up).
-- Result: code = created | duplicate | conflict | not_found | retired | window | unavailable
-- | backpressure, with operation_id, state, head, reason, scope, retry_after, corrupted,
-- failed as they apply; page_in (its base model) when it queued a PAGED registration for a
-- slot again.
local rid, seq, digest, kind, payload = ARGS[1], tonumber(ARGS[2]), ARGS[3], ARGS[4], ARGS[5]
local now, tenant = tonumber(ARGS[6]), ARGS[7]
local max_reg, max_tenant, max_fleet = tonumber(ARGS[8]), tonumber(ARGS[9]), tonumber(ARGS[10])
local max_unacked_tenant, max_unacked_fleet = tonumber(ARGS[11]), tonumber(ARGS[12])
local born_error, window = ARGS[13], tonumber(ARGS[14])
local rate, burst = tonumber(ARGS[15]), tonumber(ARGS[16])
local RETRY_SPREAD = 0.1
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
if seq < head or seq >= head + window then return result('code', 'window', 'head', head) end
if reg[2] == REG.UNAVAILABLE then return result('code', 'unavailable', 'reason', reg[6] or '') end
if seq > max_seq then
  local t = redis.call('HMGET', keys.tenant(tenant), 'pending', 'unacked')
  local refuse = nil
  if tonumber(t[2] or '0') >= max_unacked_tenant then
    refuse = 'tenant_results'
  elseif tonumber(redis.call('GET', keys.unacked) or '0') >= max_unacked_fleet then
    refuse = 'results'
  elseif born_error == '' then
    if tonumber(reg[5]) >= max_reg then
      refuse = 'registration'
    elseif tonumber(t[1] or '0') >= max_tenant then
      refuse = 'tenant'
    elseif tonumber(redis.call('GET', keys.pending) or '0') >= max_fleet then
      refuse = 'global'
    end
  end
  if refuse then return result('code', 'backpressure', 'scope', refuse) end
end
local tokens, filled_at = nil, now
if rate > 0 then
  local b = redis.call('HMGET', keys.tenant(tenant), 'bucket_tokens', 'bucket_at')
  tokens, filled_at = tonumber(b[1] or burst), tonumber(b[2] or now)
  if now > filled_at then
    tokens = math.min(burst, tokens + (now - filled_at) * rate)
    filled_at = now
  end
  if tokens < 1 and seq > max_seq then
    local due = math.max(1, burst / 2)
    local offset = RETRY_SPREAD * due * tonumber(string.sub(redis.sha1hex(rid), 1, 8), 16) / 2^32
    return result('code', 'backpressure', 'scope', 'rate',
      'retry_after', tostring((due - tokens + offset) / rate))
  end
  redis.call('HSET', keys.tenant(tenant), 'bucket_tokens', tokens - 1, 'bucket_at', filled_at)
end
redis.call('HSET', ok, 'rid', rid, 'tenant', tenant, 'seq', seq, 'kind', kind, 'digest', digest,
  'submitted_at', now, 'ordered', '1')
local state = OP.QUEUED
if born_error ~= '' then
  state = OP.FAILED
  redis.call('HSET', ok, 'state', OP.FAILED, 'error', born_error, 'finished_at', now)
  count(tenant, 'unacked', 1)
  redis.call('ZADD', keys.results, now, id)
else
  redis.call('HSET', ok, 'state', OP.QUEUED, 'payload', payload)
  redis.call('HINCRBY', rk, 'pending', 1)
  count(tenant, 'pending', 1)
end
depth(state, 1)
if seq > max_seq then redis.call('HSET', rk, 'max_seq', seq) end
redis.call('HSET', rk, 'last_request_time', now)
advance(rid, now)
if reg[2] == REG.PAGED and state == OP.QUEUED then  -- page it back in (paging.py)
  local base = redis.call('HGET', rk, 'base_model')
  redis.call('ZADD', keys.regq(base), 'NX', now, rid)
  return result('code', 'created', 'operation_id', id, 'state', state, 'page_in', base)
end
return result('code', 'created', 'operation_id', id, 'state', state)
