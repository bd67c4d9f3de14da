-- A trainer replica is gone (heartbeat timeout or new incarnation). ARGV: P, replica, now,
-- reason. Every registration it held becomes UNAVAILABLE, its open operations fail (server,
-- REPLICA_LOST), and it re-enters the placement queue ahead of new registrations (score =
-- its creation time). Returns the registration ids affected.
local replica, now, reason = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local sk = P .. 'slots:' .. replica
local affected = {}
local entries = redis.call('HGETALL', sk)
for i = 1, #entries, 2 do
  local rid = entries[i + 1]
  local rk = regkey(rid)
  local r = redis.call('HMGET', rk, 'state', 'base_model', 'created_at')
  if r[1] and r[1] ~= 'retired' then
    redis.call('HSET', rk, 'state', 'unavailable', 'unavailable_reason', reason, 'replica', '',
      'slot', '-1', 'restore', '1')
    local err = error_json('server', '', reason .. '; the operation was not completed', 'REPLICA_LOST')
    redis.call('SREM', P .. 'binding', rid)
    fail_open(rid, err, now)
    advance(rid, now)
    redis.call('ZADD', P .. 'regq:' .. r[2], tonumber(r[3]) - 1e10, rid)
    table.insert(affected, rid)
  end
end
redis.call('DEL', sk)
return affected
