-- keys: reclaim
-- Forget a reclaimed folder's entry, unless the path was removed again meanwhile (a newer
-- entry, another folder to reclaim). ARGS: path, the entry reclaimed. Result: code =
-- forgotten | newer.
if redis.call('HGET', keys.reclaim, ARGS[1]) ~= ARGS[2] then return result('code', 'newer') end
redis.call('HDEL', keys.reclaim, ARGS[1])
return result('code', 'forgotten')
