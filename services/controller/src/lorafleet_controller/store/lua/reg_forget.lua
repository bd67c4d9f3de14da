-- keys: retired
-- Forget a retired run's record in its group (the leader's sweep, fenced), after its fleet
-- records (run_forget.lua) and once the sweep purged its operation records (it reads
-- `max_seq` from the record; the run is in the group's `retired` index until then).
-- ARGS: rid. Result: code = forgotten | purging | live.
local rid = ARGS[1]
local rk = keys.reg(rid)
local state = redis.call('HGET', rk, 'state')
if state and state ~= REG.RETIRED then return result('code', 'live') end
if redis.call('ZSCORE', keys.retired, rid) then return result('code', 'purging') end
redis.call('DEL', rk, keys.replay(rid))
return result('code', 'forgotten')
