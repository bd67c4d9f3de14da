-- keys:
-- The adapter version a publish (or a sampler made from a training checkpoint) makes live,
-- allocated once: a re-dispatch of the same operation gets the same number. ARGS: rid,
-- opid ('' = always a new version). Result: version.
local rid, opid = ARGS[1], ARGS[2]
if opid ~= '' then
  local existing = redis.call('HGET', keys.op(opid), 'version')
  if existing then return result('version', tonumber(existing)) end
end
local version = redis.call('HINCRBY', keys.reg(rid), 'next_version', 1)
if opid ~= '' then redis.call('HSET', keys.op(opid), 'version', version) end
return result('version', version)
