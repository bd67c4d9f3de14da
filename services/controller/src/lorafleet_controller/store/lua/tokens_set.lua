-- keys:
-- Tokens leased to the call's group (tokens_take.lua): the group adds what its running total
-- grew by since it last applied one, so a replayed or late set adds nothing. ARGS: tenant,
-- total. Result: code = ok.
local k = keys.share(ARGS[1])
local total = tonumber(ARGS[2])
local applied = tonumber(redis.call('HGET', k, 'tokens_total') or '0')
if total > applied then
  redis.call('HINCRBYFLOAT', k, 'tokens', total - applied)
  redis.call('HSET', k, 'tokens_total', total)
end
return result('code', 'ok')
