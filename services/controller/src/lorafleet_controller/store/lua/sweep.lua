-- keys: claimed results retired depth open_samples gaps ready_ctl ready_data fleet_share
-- Periodic housekeeping. ARGS: now, claimed_cutoff, result_cutoff, limit, claimed_error.
-- Fails claims older than the claimed TTL and expires results older than the result TTL.
-- Registrations retired longer ago than the result TTL lose their operation records
-- entirely (a retired registration's seq_ids need no reserving: it admits nothing).
-- Result: claims_failed, results_expired, records_deleted.
local now, claimed_cutoff, result_cutoff = tonumber(ARGS[1]), ARGS[2], ARGS[3]
local limit, claimed_error = tonumber(ARGS[4]), ARGS[5]
local failed = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', keys.claimed, '-inf', claimed_cutoff,
    'LIMIT', 0, limit)) do
  local ok = keys.op(id)
  if finish(id, OP.FAILED, '', claimed_error, now) then
    failed = failed + 1
    if redis.call('HGET', ok, 'ordered') == '1' then advance(redis.call('HGET', ok, 'rid'), now) end
  else
    redis.call('ZREM', keys.claimed, id)
  end
end
local expired = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', keys.results, '-inf', result_cutoff,
    'LIMIT', 0, limit)) do
  if expire(id) then expired = expired + 1 else redis.call('ZREM', keys.results, id) end
end
-- A retired registration's records go (compactable) once its results are past the TTL; at
-- most `limit` * 256 seq_ids are probed per call, resuming at `purged` (a long run's seq_ids
-- are mostly compacted already, and one call must not hold the server for seconds).
local deleted, budget = 0, limit * 256
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', keys.retired, '-inf', result_cutoff,
    'LIMIT', 0, limit)) do
  local rk = keys.reg(rid)
  local max_seq = tonumber(redis.call('HGET', rk, 'max_seq') or '-1')
  local seq = tonumber(redis.call('HGET', rk, 'purged') or '0')
  while seq <= max_seq and budget > 0 do
    local id = opid_of(rid, seq)
    local st = op_state(id)
    if st ~= 0 and st ~= OP.QUEUED and st ~= OP.CLAIMED then
      expire(id)
      if redis.call('DEL', keys.op(id)) == 1 then depth(OP.EXPIRED, -1) end
      deleted = deleted + 1
    end
    seq, budget = seq + 1, budget - 1
  end
  if seq > max_seq then
    redis.call('ZREM', keys.retired, rid)
    redis.call('HDEL', rk, 'purged')
  else
    redis.call('HSET', rk, 'purged', seq)
  end
end
return result('claims_failed', failed, 'results_expired', expired, 'records_deleted', deleted)
