-- keys:
-- Record a run's snapshot unless one as new is recorded, and drop the log entries it
-- covers (and the checkpoints they loaded, `load:<seq_id>`). ARGS: rid, seq_id the snapshot
-- covers, SlotSnapshot bytes.
-- Result: code = recorded | older.
local rid, seq = ARGS[1], tonumber(ARGS[2])
local lk = keys.replay(rid)
if seq <= tonumber(redis.call('HGET', lk, 'snap_seq') or '-1') then
  return result('code', 'older')
end
redis.call('HSET', lk, 'snap_seq', ARGS[2], 'snap', ARGS[3])
for _, f in ipairs(redis.call('HKEYS', lk)) do
  local n = tonumber(string.match(f, '^load:(%d+)$') or f)
  if n ~= nil and n <= seq then redis.call('HDEL', lk, f) end
end
return result('code', 'recorded')
