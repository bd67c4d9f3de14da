-- keys:
-- Read a run's replay log together with the registration's newest logged seq_id and its
-- optimizer step count. One script, so no append falls between the two reads: an entry
-- logged in between (a late answer from a trainer the run has since left, logged while a
-- restore reads its plan) would name a newest seq_id whose entry the log read did not hold,
-- and the run would be corrupted for a payload that is there. ARGS: rid.
-- Result: {the log hash as HGETALL gives it, {replay_last, optim_steps}}.
local rid = ARGS[1]
return { redis.call('HGETALL', keys.replay(rid)),
  redis.call('HMGET', keys.reg(rid), 'replay_last', 'optim_steps') }
