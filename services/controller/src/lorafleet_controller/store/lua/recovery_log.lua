-- keys:
-- Log an operation the trainer applied to a run: its replay log entry is
-- '<previous seq_id>:<payload>' ('' before the first) and the registration keeps the newest
-- seq_id (`replay_last`). Idempotent; a seq_id the snapshot covers is not logged. A
-- load_state also names its checkpoint in field `load:<seq_id>`, which holds the checkpoint's
-- files on disk while a replay may need them (reclaim.py).
-- ARGS: rid, seq_id, payload, loaded checkpoint path ('' = none). Result: code = logged | skipped.
local rid, seq = ARGS[1], ARGS[2]
local lk, rk = keys.replay(rid), keys.reg(rid)
if tonumber(seq) <= tonumber(redis.call('HGET', lk, 'snap_seq') or '-1') then
  return result('code', 'skipped')
end
if redis.call('HEXISTS', lk, seq) == 1 then return result('code', 'skipped') end
local prev = redis.call('HGET', rk, 'replay_last') or ''
redis.call('HSET', lk, seq, prev .. ':' .. ARGS[3])
redis.call('HSET', rk, 'replay_last', seq)
if ARGS[4] ~= '' then redis.call('HSET', lk, 'load:' .. seq, ARGS[4]) end
return result('code', 'logged')
