-- keys: run_newest versions_unheld reclaim
-- Collect a published version that nothing holds (the leader's sweep, fenced: version_gc.py):
-- its record and its live-index entry go and its folder is queued for reclaiming
-- (reclaim.py), in one step, after checking again that nothing holds it: no sampler pins it,
-- no sampler checkpoint names it, it is not its run's newest, and it was let go at or before
-- the cutoff. ARGS: adapter id, cutoff, reclaim entry (its folder).
-- Result: code = collected | held | waiting | gone.
local aid, cutoff = ARGS[1], tonumber(ARGS[2])
local since = redis.call('ZSCORE', keys.versions_unheld, aid)
if not since then return result('code', 'gone') end
if tonumber(since) > cutoff then return result('code', 'waiting') end
local ak = keys.adapter(aid)
local rid, version, base_model = unpack(redis.call('HMGET', ak, 'rid', 'version', 'base_model'))
if not rid then
  redis.call('ZREM', keys.versions_unheld, aid)
  return result('code', 'gone')
end
if redis.call('SCARD', keys.adapter_refs(aid)) > 0
    or redis.call('HGET', keys.run_newest, rid) == version then
  redis.call('ZREM', keys.versions_unheld, aid)
  return result('code', 'held')
end
redis.call('DEL', ak)
redis.call('ZREM', keys.live(base_model), aid)
redis.call('ZREM', keys.versions_unheld, aid)
redis.call('HSET', keys.reclaim, 'version:' .. aid, ARGS[3])
return result('code', 'collected')
