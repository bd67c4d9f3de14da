-- keys: reserving
-- Creating a registration, last step (fleet): its record exists, the reservation is kept.
-- ARGS: rid. Result: code = ok.
redis.call('HDEL', keys.reserving, ARGS[1])
return result('code', 'ok')
