-- Admit an operation at (rid, seq). ARGV: P, rid, seq, digest, kind, payload, now, tenant,
-- max_pending, max_unacked, max_global, born_error (JSON, '' = none), window.
-- Backpressure and window checks run before anything is written, so a refused seq_id
-- stays free; a hole-filling seq_id is always admitted.
local rid, seq, digest, kind, payload = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local now, tenant = tonumber(ARGV[7]), ARGV[8]
local max_pending, max_unacked, max_global = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local born_error, window = ARGV[12], tonumber(ARGV[13])
local rk = regkey(rid)
local reg = redis.call('HMGET', rk, 'tenant', 'state', 'head', 'max_seq', 'pending', 'unavailable_reason')
if not reg[1] or reg[1] ~= tenant then return { 'not_found' } end
local id = opid_of(rid, seq)
local ok = opkey(id)
local existing = redis.call('HMGET', ok, 'digest', 'state')
if existing[2] then
  if existing[1] == digest then return { 'duplicate', id, existing[2] } end
  return { 'conflict', id, existing[2] }
end
if reg[2] == 'retired' then return { 'retired' } end
local head, max_seq = tonumber(reg[3]), tonumber(reg[4])
if seq < head or seq >= head + window then return { 'window', tostring(head) } end
if reg[2] == 'unavailable' then return { 'unavailable', reg[6] or '' } end
if seq > max_seq then
  if born_error == '' and tonumber(reg[5]) >= max_pending then
    return { 'backpressure', 'registration' }
  end
  if tonumber(redis.call('GET', P .. 'unacked') or '0') >= max_unacked then
    return { 'backpressure', 'results' }
  end
  if born_error == '' and tonumber(redis.call('GET', P .. 'pending') or '0') >= max_global then
    return { 'backpressure', 'global' }
  end
end
redis.call('HSET', ok, 'rid', rid, 'tenant', tenant, 'seq', seq, 'kind', kind, 'digest', digest,
  'submitted_at', now, 'ordered', '1')
local state = QUEUED
if born_error ~= '' then
  state = FAILED
  redis.call('HSET', ok, 'state', FAILED, 'error', born_error, 'finished_at', now)
  redis.call('INCR', P .. 'unacked')
  redis.call('ZADD', P .. 'results', now, id)
else
  redis.call('HSET', ok, 'state', QUEUED, 'payload', payload)
  redis.call('HINCRBY', rk, 'pending', 1)
  redis.call('INCR', P .. 'pending')
end
depth(state, 1)
if seq > max_seq then redis.call('HSET', rk, 'max_seq', seq) end
redis.call('HSET', rk, 'last_request_time', now)
advance(rid, now)
return { 'created', id, tostring(state) }
