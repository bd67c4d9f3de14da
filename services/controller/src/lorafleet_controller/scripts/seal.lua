-- Seal a gap that outlived the gap timeout. ARGV: P, rid, now, cutoff.
-- The missing seq_id gets a sealed FAILED record (a late arrival is a conflict, never run),
-- and every queued, never-claimed operation behind it fails naming the missing seq_id.
-- Returns the sealed seq_id, or -1 when the gap closed meanwhile or is not old enough.
local rid, now, cutoff = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local since = redis.call('ZSCORE', P .. 'gaps', rid)
if not since or tonumber(since) > cutoff then return -1 end
local rk = regkey(rid)
local head = tonumber(redis.call('HGET', rk, 'head'))
local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
if op_state(opid_of(rid, head)) ~= 0 then
  advance(rid, now)
  return -1
end
local msg = 'seq_id ' .. head .. ' never arrived; the gap was sealed after the gap timeout'
local sealed = error_json('user', 'seq_id', msg, 'SEQ_GAP_SEALED')
local blocked = error_json('user', 'seq_id',
  'blocked behind seq_id ' .. head .. ', which never arrived (gap sealed)', 'SEQ_GAP_SEALED')
for seq = head, max_seq do
  local id = opid_of(rid, seq)
  local ok = opkey(id)
  local st = op_state(id)
  if st == 0 then
    redis.call('HSET', ok, 'rid', rid, 'tenant', redis.call('HGET', rk, 'tenant'), 'seq', seq,
      'kind', '0', 'digest', '', 'submitted_at', now, 'ordered', '1', 'state', FAILED,
      'error', seq == head and sealed or blocked, 'finished_at', now, 'sealed', '1')
    redis.call('INCR', P .. 'unacked')
    redis.call('ZADD', P .. 'results', now, id)
    depth(FAILED, 1)
  elseif st == QUEUED then
    finish(id, FAILED, '', blocked, now)
  end
end
advance(rid, now)
return head
