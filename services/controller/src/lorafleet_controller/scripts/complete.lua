-- Record an operation's outcome. ARGV: P, opid, state, result, error, now, from
-- ('claimed' or 'open'), then triples (op, field, value) applied to the registration hash
-- in the same transaction (op: 'set' or 'incr'), for example optim_steps or the published
-- version. Returns 1 when recorded, 0 when the operation was no longer open (a fence won).
local id, state, result, err = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local now, from = tonumber(ARGV[6]), ARGV[7]
local st = op_state(id)
if from == 'claimed' and st ~= CLAIMED then return 0 end
if not finish(id, state, result, err, now) then return 0 end
local ok = opkey(id)
local rid = redis.call('HGET', ok, 'rid')
local rk = regkey(rid)
local i = 8
while i + 2 <= #ARGV do
  if ARGV[i] == 'set' then
    redis.call('HSET', rk, ARGV[i + 1], ARGV[i + 2])
  elseif ARGV[i] == 'incr' then
    redis.call('HINCRBY', rk, ARGV[i + 1], tonumber(ARGV[i + 2]))
  end
  i = i + 3
end
if redis.call('HGET', ok, 'ordered') == '1' then advance(rid, now) end
return 1
