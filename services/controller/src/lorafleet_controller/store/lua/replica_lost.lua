-- keys:
-- A replica is gone (heartbeat timeout, left discovery, or a new incarnation), first step.
-- ARGS: replica. It is marked unhealthy (no run is placed on it from now) and its slot
-- table is read: each entry is then lost in its run's group (reg_lost.lua), which frees the
-- entry in the same step, so a controller that dies between the steps leaves the rest in
-- the table, where the next call (or the sweeper's redrive of an unhealthy trainer with
-- slots) finds them.
-- Result: code = lost | unknown | already (was not healthy), kind, slots (slot, rid, ...).
local replica = ARGS[1]
local hk = keys.replica(replica)
local h = redis.call('HMGET', hk, 'healthy', 'kind')
if not h[2] then return result('code', 'unknown', 'kind', '', 'slots', {}) end
redis.call('HSET', hk, 'healthy', '0')
return result('code', h[1] == '1' and 'lost' or 'already', 'kind', h[2],
  'slots', redis.call('HGETALL', keys.slots(replica)))
