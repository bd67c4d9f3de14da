-- keys: gaps results depth claimed ready_ctl ready_data fleet_share
-- Seal a gap that outlived the gap timeout. ARGS: rid, now, cutoff.
-- The missing seq_id gets a sealed FAILED record (a late arrival is a conflict, never run),
-- and every queued, never-claimed operation behind it fails naming the missing seq_id.
-- Result: code = sealed (with seq) | closed (the gap closed meanwhile or is not old enough).
local rid, now, cutoff = ARGS[1], tonumber(ARGS[2]), tonumber(ARGS[3])
local since = redis.call('ZSCORE', keys.gaps, rid)
if not since or tonumber(since) > cutoff then return result('code', 'closed') end
local rk = keys.reg(rid)
local head = tonumber(redis.call('HGET', rk, 'head'))
local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
if op_state(opid_of(rid, head)) ~= 0 then
  advance(rid, now)
  return result('code', 'closed')
end
local tenant = redis.call('HGET', rk, 'tenant')
local msg = 'seq_id ' .. head .. ' never arrived; the gap was sealed after the gap timeout'
local sealed = error_json('user', 'seq_id', msg, 'SEQ_GAP_SEALED')
local blocked = error_json('user', 'seq_id',
  'blocked behind seq_id ' .. head .. ', which never arrived (gap sealed)', 'SEQ_GAP_SEALED')
for seq = head, max_seq do
  local id = opid_of(rid, seq)
  local st = op_state(id)
  if st == 0 then
    local err = seq == head and sealed or blocked
    redis.call('HSET', keys.op(id), 'rid', rid, 'tenant', tenant, 'seq', seq, 'kind', '0',
      'digest', '', 'submitted_at', now, 'ordered', '1', 'state', OP.FAILED,
      'error', err, 'finished_at', now, 'sealed', '1', 'rbytes', #err)
    count(tenant, 'unacked', 1)
    count(tenant, 'unacked_bytes', #err)
    redis.call('ZADD', keys.results, now, id)
    depth(OP.FAILED, 1)
  elseif st == OP.QUEUED then
    finish(id, OP.FAILED, '', blocked, now)
  end
end
advance(rid, now)
return result('code', 'sealed', 'seq', head)
