-- Create a registration unless it exists. ARGV: P, rid, tenant, session_id, created_at,
-- head, then (field, value) pairs. Returns 1 when created, 0 when it already existed.
local rid, tenant, session_id, created_at, head = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local rk = regkey(rid)
if redis.call('EXISTS', rk) == 1 then return 0 end
redis.call('HSET', rk, 'tenant', tenant, 'session_id', session_id, 'created_at', created_at,
  'head', head, 'max_seq', tonumber(head) - 1, 'pending', 0, 'state', 'queued',
  'optim_steps', 0, 'published_version', 0, 'dirty', '0')
for i = 7, #ARGV - 1, 2 do redis.call('HSET', rk, ARGV[i], ARGV[i + 1]) end
redis.call('SADD', P .. 'regs', rid)
redis.call('ZADD', P .. 'regs:' .. tenant, created_at, rid)
redis.call('SADD', P .. 'session_runs:' .. session_id, rid)
return 1
