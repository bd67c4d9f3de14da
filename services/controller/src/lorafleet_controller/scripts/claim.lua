-- Claim a queued operation for dispatch. ARGV: P, opid, now.
-- Ordered operations are claimable only at their registration's head while it is bound.
-- Returns false, or {rid, seq, kind, payload, replica, slot, dirty, base_model, tenant,
-- submitted_at}.
local id, now = ARGV[2], tonumber(ARGV[3])
local ok = opkey(id)
local f = redis.call('HMGET', ok, 'state', 'rid', 'seq', 'kind', 'payload', 'ordered', 'tenant',
  'submitted_at')
if tonumber(f[1] or '0') ~= QUEUED then return false end
local r = redis.call('HMGET', regkey(f[2] or ''), 'state', 'head', 'replica', 'slot', 'dirty',
  'base_model')
if f[6] == '1' and (r[1] ~= 'ready' or tonumber(r[2]) ~= tonumber(f[3])) then
  redis.call('HDEL', ok, 'pushed')
  return false
end
redis.call('HSET', ok, 'state', CLAIMED, 'claimed_at', now)
redis.call('HDEL', ok, 'pushed')
redis.call('ZADD', P .. 'claimed', now, id)
depth(QUEUED, -1)
depth(CLAIMED, 1)
return { f[2], f[3], f[4], f[5] or '', r[3] or '', r[4] or '', r[5] or '0', r[6] or '', f[7],
  f[8] }
