-- Prelude shared by every ledger/registry script (prepended by lua.py).
-- ARGV[1] is always the key prefix. Keys are built here from ids: the controller targets one
-- Redis (or one Sentinel-managed primary), never a Redis Cluster.
local P = ARGV[1]
local QUEUED, CLAIMED, SUCCEEDED, FAILED, CANCELLED, EXPIRED = 1, 2, 3, 4, 5, 6
local DATA_KINDS = { ['1'] = true, ['2'] = true }

-- Operations this script made terminal: announced with one PUBLISH when it ends (lua.py).
local DONE = {}

local function publish_done()
  if #DONE > 0 then redis.call('PUBLISH', P .. 'done', table.concat(DONE, '\n')) end
end

local function regkey(rid) return P .. 'reg:' .. rid end
local function opkey(opid) return P .. 'op:' .. opid end
local function opid_of(rid, seq) return rid .. '#' .. seq end

local function op_state(opid)
  return tonumber(redis.call('HGET', opkey(opid), 'state') or '0')
end

local function depth(state, delta)
  redis.call('HINCRBY', P .. 'depth', tostring(state), delta)
end

local function error_json(category, field, message, reason)
  return cjson.encode({ category = category, field = field, message = message, reason = reason })
end

-- Queue the registration's head operation for the scheduler when it can run now.
local function push_head(rid)
  local rk = regkey(rid)
  if redis.call('HGET', rk, 'state') ~= 'ready' then return end
  local id = opid_of(rid, redis.call('HGET', rk, 'head'))
  local ok = opkey(id)
  if tonumber(redis.call('HGET', ok, 'state') or '0') ~= QUEUED then return end
  if redis.call('HGET', ok, 'pushed') == '1' then return end
  redis.call('HSET', ok, 'pushed', '1')
  if DATA_KINDS[redis.call('HGET', ok, 'kind')] then
    redis.call('RPUSH', P .. 'ready:data', id)
  else
    redis.call('RPUSH', P .. 'ready:ctl', id)
  end
end

-- Move the head past terminal operations, track a gap stall, and queue the new head.
local function advance(rid, now)
  local rk = regkey(rid)
  local head = tonumber(redis.call('HGET', rk, 'head'))
  while true do
    local st = op_state(opid_of(rid, head))
    if st == 0 or st == QUEUED or st == CLAIMED then break end
    head = head + 1
  end
  redis.call('HSET', rk, 'head', head)
  local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
  if op_state(opid_of(rid, head)) == 0 and max_seq > head then
    if tonumber(redis.call('HGET', rk, 'gap_seq') or '-1') ~= head then
      redis.call('HSET', rk, 'gap_seq', head)
      redis.call('ZADD', P .. 'gaps', now, rid)
    end
  else
    redis.call('HDEL', rk, 'gap_seq')
    redis.call('ZREM', P .. 'gaps', rid)
  end
  push_head(rid)
end

-- Make an open (QUEUED or CLAIMED) operation terminal. False when it was not open.
local function finish(opid, state, result, err, now)
  local ok = opkey(opid)
  local st = tonumber(redis.call('HGET', ok, 'state') or '0')
  if st ~= QUEUED and st ~= CLAIMED then return false end
  redis.call('HSET', ok, 'state', state, 'finished_at', now)
  if result ~= '' then redis.call('HSET', ok, 'result', result) end
  if err ~= '' then redis.call('HSET', ok, 'error', err) end
  redis.call('HDEL', ok, 'payload', 'pushed')
  redis.call('ZREM', P .. 'claimed', opid)
  redis.call('SREM', P .. 'open_samples', opid)
  redis.call('ZADD', P .. 'results', now, opid)
  if redis.call('HGET', ok, 'ordered') == '1' then
    redis.call('HINCRBY', regkey(redis.call('HGET', ok, 'rid')), 'pending', -1)
  end
  redis.call('DECR', P .. 'pending')
  redis.call('INCR', P .. 'unacked')
  depth(st, -1)
  depth(state, 1)
  table.insert(DONE, opid)
  return true
end

-- Release a terminal result: payload and result go, the seq_id stays reserved.
local function expire(opid)
  local ok = opkey(opid)
  local st = tonumber(redis.call('HGET', ok, 'state') or '0')
  if st ~= SUCCEEDED and st ~= FAILED and st ~= CANCELLED then return false end
  redis.call('HSET', ok, 'state', EXPIRED)
  redis.call('HDEL', ok, 'result', 'error', 'payload')
  redis.call('ZREM', P .. 'results', opid)
  redis.call('DECR', P .. 'unacked')
  depth(st, -1)
  depth(EXPIRED, 1)
  return true
end

-- Fail every open operation of a registration (fencing, lost replica).
local function fail_open(rid, err, now)
  local rk = regkey(rid)
  local head = tonumber(redis.call('HGET', rk, 'head'))
  local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
  local n = 0
  for seq = head, max_seq do
    if finish(opid_of(rid, seq), FAILED, '', err, now) then n = n + 1 end
  end
  return n
end

-- Claim a queued operation for dispatch. Ordered operations are claimable only at their
-- registration's head while it is bound. Returns false, or {rid, seq, kind, payload,
-- replica, slot, dirty, base_model, tenant, submitted_at}.
local function claim_op(id, now)
  local ok = opkey(id)
  local f = redis.call('HMGET', ok, 'state', 'rid', 'seq', 'kind', 'payload', 'ordered',
    'tenant', 'submitted_at')
  if tonumber(f[1] or '0') ~= QUEUED then return false end
  local r = redis.call('HMGET', regkey(f[2] or ''), 'state', 'head', 'replica', 'slot', 'dirty',
    'base_model')
  if f[6] == '1' and (r[1] ~= 'ready' or tonumber(r[2]) ~= tonumber(f[3])) then
    redis.call('HDEL', ok, 'pushed')
    return false
  end
  redis.call('HSET', ok, 'state', CLAIMED, 'claimed_at', now)
  redis.call('HDEL', ok, 'pushed')
  redis.call('ZADD', P .. 'claimed', now, id)
  depth(QUEUED, -1)
  depth(CLAIMED, 1)
  return { f[2], f[3], f[4], f[5] or '', r[3] or '', r[4] or '', r[5] or '0', r[6] or '', f[7],
    f[8] }
end
