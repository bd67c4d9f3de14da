-- keys: results depth fleet_share
-- Acknowledge a terminal result. ARGS: opid, tenant, release_at.
-- The result stops counting toward the unacked limits at once and stays readable until the
-- sweep releases it (EXPIRED): its score in `results` becomes `release_at` (the ack's time
-- plus the grace, minus the result TTL, so the sweep's TTL cutoff reaches it then), never
-- later than it was. A client whose answer was lost in transit polls again and still gets
-- it, where an immediate release answered 410, which reaches a training loop as an error.
-- Acknowledging again changes nothing.
-- Result: code = ok | not_found (unknown or another tenant's) | open (not terminal yet).
local id, tenant, release_at = ARGS[1], ARGS[2], tonumber(ARGS[3])
local ok = keys.op(id)
local f = redis.call('HMGET', ok, 'state', 'tenant', 'acked', 'rbytes')
if not f[1] or f[2] ~= tenant then return result('code', 'not_found') end
local st = tonumber(f[1])
if st == OP.QUEUED or st == OP.CLAIMED then return result('code', 'open') end
if st == OP.EXPIRED or f[3] == '1' then return result('code', 'ok') end
redis.call('HSET', ok, 'acked', '1')
count(tenant, 'unacked', -1)
count(tenant, 'unacked_bytes', -tonumber(f[4] or '0'))
local held = tonumber(redis.call('ZSCORE', keys.results, id))
if not held or release_at < held then redis.call('ZADD', keys.results, release_at, id) end
return result('code', 'ok')
