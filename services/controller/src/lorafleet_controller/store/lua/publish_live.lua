-- keys:
-- Record an adapter version live: its record and its base model's live index together.
-- ARGS: adapter id (`<rid>@<version>`), base_model, rid, version, files_dir, lora (bytes),
-- refs (WriteSharedAdapterResponse bytes, empty files when streamed), tenant. Result: code =
-- live.
local aid, base_model, rid, version = ARGS[1], ARGS[2], ARGS[3], ARGS[4]
redis.call('HSET', keys.adapter(aid), 'files_dir', ARGS[5], 'lora', ARGS[6], 'base_model',
  base_model, 'rid', rid, 'version', version, 'refs', ARGS[7], 'tenant', ARGS[8])
redis.call('ZADD', keys.live(base_model), version, aid)
return result('code', 'live')
