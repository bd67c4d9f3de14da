-- keys: runs_retired regs run_newest versions_unheld
-- Forget a retired run's fleet records (the leader's sweep, fenced), once it was retired at
-- or before the cutoff and no checkpoint of it is left (a training checkpoint may still be
-- made a sampler, which takes a version of the run's counter): its place in the fleet's and
-- its tenant's runs, its home rollout (a run retired with its session keeps it until now),
-- and its newest version, which is let go (version_gc.py). Idempotent: a sweep cut off
-- before the group step (reg_forget.lua) runs it again. ARGS: rid, tenant, cutoff, now,
-- base_model. Result: code = forgotten | kept (checkpoints left) | waiting | gone.
local rid, tenant, cutoff, now = ARGS[1], ARGS[2], tonumber(ARGS[3]), tonumber(ARGS[4])
local since = redis.call('ZSCORE', keys.runs_retired, rid)
if not since then return result('code', 'gone') end
if tonumber(since) > cutoff then return result('code', 'waiting') end
if redis.call('EXISTS', keys.run_ckpts(rid)) == 1 then return result('code', 'kept') end
redis.call('SREM', keys.regs, rid)
redis.call('ZREM', keys.tenant_regs(tenant), rid)
if ARGS[5] ~= '' then redis.call('HDEL', keys.homes(ARGS[5]), rid) end
local newest = redis.call('HGET', keys.run_newest, rid)
redis.call('HDEL', keys.run_newest, rid)
if newest then let_go(rid .. '@' .. newest, now) end
return result('code', 'forgotten')
