-- keys: replicas base_models
-- Record a replica's announcement: healthy, seen at `now`, no failure, in its kind's pool of
-- its base model. What changed since its last announcement is read in the same step, so two
-- announcements racing each other cannot both report a change. ARGS: replica, kind,
-- base_model, incarnation, now, then (field, value) pairs of the rest of the announcement.
-- Result: change = new | restarted (another incarnation) | returned (was unhealthy) | same.
local replica, kind, base, incarnation, now = ARGS[1], ARGS[2], ARGS[3], ARGS[4], ARGS[5]
local hk = keys.replica(replica)
local old = redis.call('HMGET', hk, 'incarnation', 'healthy')
local change = 'same'
if not old[1] then
  change = 'new'
elseif old[1] ~= incarnation then
  change = 'restarted'
elseif old[2] ~= '1' then
  change = 'returned'
end
redis.call('HSET', hk, 'kind', kind, 'base_model', base, 'incarnation', incarnation,
  'last_seen', now, 'healthy', '1', 'failed', '')
for i = 6, #ARGS - 1, 2 do redis.call('HSET', hk, ARGS[i], ARGS[i + 1]) end
redis.call('SADD', keys.replicas, replica)
redis.call('SADD', keys[kind .. 's'](base), replica)
redis.call('SADD', keys.base_models, base)
return result('change', change)
