-- keys: ckpt_ttl
-- Change a checkpoint's visibility and expiry, keeping the expiry index in step; a record
-- removed meanwhile stays removed. ARGS: path, public ('1', '0', '' = unchanged), expires_at
-- ('' = unchanged, 0 = never). Result: code = updated | not_found.
local path, public, expires = ARGS[1], ARGS[2], ARGS[3]
local ck = keys.ckpt(path)
if redis.call('EXISTS', ck) == 0 then return result('code', 'not_found') end
if public ~= '' then redis.call('HSET', ck, 'public', public) end
if expires ~= '' then
  redis.call('HSET', ck, 'expires_at', expires)
  if tonumber(expires) > 0 then
    redis.call('ZADD', keys.ckpt_ttl, expires, path)
  else
    redis.call('ZREM', keys.ckpt_ttl, path)
  end
end
return result('code', 'updated')
