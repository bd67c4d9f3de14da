-- keys:
-- Lease a group admission tokens from its tenant's bucket (store/quota.py). ARGS: tenant,
-- group, rate, burst, chunk, now, rid (whose refusal this is), need (whole tokens the group
-- must get to admit one operation: 1, more when hole-filling admissions left its balance
-- negative). The bucket holds up to `burst` tokens, refilled at `rate` per second of `now`
-- (never backwards: a replica whose clock lags refills nothing until it catches up); at
-- least `need` and up to `chunk` whole tokens leave it for the group, counted in the
-- group's running total (tokens_set.lua applies the difference once). A tenant's admissions in any T seconds are thus at most burst + rate * T plus what
-- its groups held (at most `chunk` each).
-- With no whole token the refusal says to retry when the bucket is half full again, not
-- when one token is: a tenant flooding from N runs would otherwise retry N times per token,
-- a herd of refused scripts that costs the controller more than the admissions it limits
-- (bench/fairness.py: A's p99 ratio 3.6 with one-token retries, see the README for the
-- half-bucket figure). Each registration then waits an offset of its own (from a hash of its
-- id) of up to a tenth of that window (RETRY_SPREAD), so a tenant's refused runs do not all
-- come back in the same millisecond, a herd whose admissions queue ahead of another
-- tenant's step; spread over the whole window instead, the flood never pauses and the other
-- tenant's median step pays (bench/fairness.py under SCHED_FIFO: A's p99 / alone 1.66-1.96
-- with the herd, 1.56 spread over a tenth, p50 1.02, 1.03-1.08; over the whole window p99
-- 1.54-1.98 but p50 1.61). The sustained rate is the same either way.
-- Result: code = granted (total: the group's running total) | none (retry_after).
local tenant, group, rate, burst = ARGS[1], ARGS[2], tonumber(ARGS[3]), tonumber(ARGS[4])
local chunk, now, rid, need = tonumber(ARGS[5]), tonumber(ARGS[6]), ARGS[7], tonumber(ARGS[8])
local RETRY_SPREAD = 0.1
local k = keys.tenant(tenant)
local b = redis.call('HMGET', k, 'bucket_tokens', 'bucket_at')
local tokens, filled_at = tonumber(b[1] or burst), tonumber(b[2] or now)
if now > filled_at then
  tokens = math.min(burst, tokens + (now - filled_at) * rate)
  filled_at = now
end
local grant = math.min(math.max(chunk, need), math.floor(tokens))
if grant < need then  -- the group's debt counts as tokens the bucket lacks
  local due = math.max(1, burst / 2)
  local offset = RETRY_SPREAD * due * tonumber(string.sub(redis.sha1hex(rid), 1, 8), 16) / 2^32
  return result('code', 'none',
    'retry_after', tostring((due - tokens + need - 1 + offset) / rate))
end
redis.call('HSET', k, 'bucket_tokens', tokens - grant, 'bucket_at', filled_at)
return result('code', 'granted', 'total', redis.call('HINCRBY', k, 't' .. group, grant))
