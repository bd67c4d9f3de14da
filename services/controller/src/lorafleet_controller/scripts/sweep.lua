-- Periodic housekeeping. ARGV: P, now, claimed_cutoff, result_cutoff, limit, claimed_error.
-- Fails claims older than the claimed TTL and expires results older than the result TTL.
-- Registrations retired longer ago than the result TTL lose their operation records
-- entirely (a retired registration's seq_ids need no reserving: it admits nothing).
-- Returns {claims_failed, results_expired, records_deleted}.
local now, claimed_cutoff, result_cutoff = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local limit, claimed_error = tonumber(ARGV[5]), ARGV[6]
local failed = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'claimed', '-inf', claimed_cutoff,
    'LIMIT', 0, limit)) do
  local ok = opkey(id)
  if finish(id, FAILED, '', claimed_error, now) then
    failed = failed + 1
    if redis.call('HGET', ok, 'ordered') == '1' then advance(redis.call('HGET', ok, 'rid'), now) end
  else
    redis.call('ZREM', P .. 'claimed', id)
  end
end
local expired = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'results', '-inf', result_cutoff,
    'LIMIT', 0, limit)) do
  if expire(id) then expired = expired + 1 else redis.call('ZREM', P .. 'results', id) end
end
local deleted = 0
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', P .. 'retired', '-inf', result_cutoff,
    'LIMIT', 0, limit)) do
  local max_seq = tonumber(redis.call('HGET', regkey(rid), 'max_seq') or '-1')
  for seq = 0, max_seq do
    local id = opid_of(rid, seq)
    local st = op_state(id)
    if st ~= 0 and st ~= QUEUED and st ~= CLAIMED then
      expire(id)
      redis.call('DEL', opkey(id))
      depth(EXPIRED, -1)
      deleted = deleted + 1
    end
  end
  redis.call('ZREM', P .. 'retired', rid)
end
return { failed, expired, deleted }
