-- Record the outcomes of one or more operations. ARGV: P, now, then per operation: opid,
-- state, result, error, from ('claimed' or 'open'), n, and n triples (op, field, value)
-- applied to the registration hash in the same transaction (op: 'set' or 'incr'), for
-- example optim_steps or the published version. Returns, per operation, 1 when recorded and
-- 0 when it was no longer open (a fence won).
local now = tonumber(ARGV[2])
local out = {}
local i = 3
while i <= #ARGV do
  local id, state, result, err, from = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3],
    ARGV[i + 4]
  local n = tonumber(ARGV[i + 5])
  local effects = i + 6
  i = effects + 3 * n
  local recorded = 0
  if (from ~= 'claimed' or op_state(id) == CLAIMED) and finish(id, state, result, err, now) then
    recorded = 1
    local ok = opkey(id)
    local rid = redis.call('HGET', ok, 'rid')
    local rk = regkey(rid)
    for e = effects, i - 1, 3 do
      if ARGV[e] == 'set' then
        redis.call('HSET', rk, ARGV[e + 1], ARGV[e + 2])
      elseif ARGV[e] == 'incr' then
        redis.call('HINCRBY', rk, ARGV[e + 1], tonumber(ARGV[e + 2]))
      end
    end
    if redis.call('HGET', ok, 'ordered') == '1' then advance(rid, now) end
  end
  table.insert(out, recorded)
end
return out
