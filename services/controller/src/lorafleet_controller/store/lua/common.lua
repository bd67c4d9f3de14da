-- Helpers shared by every script (prepended by store/scripts.py after the generated `OP`,
-- `REG`, `DATA_KINDS` constants and the `keys` table). ARGV[1] is the fleet's key base,
-- ARGV[2] the caller's fencing epoch ('' when the caller is not the dispatching leader),
-- ARGV[3] the call's group ('' for none: see store/keys.py), and the script's own arguments
-- are ARGS[1..] (ARGV[4..]).

-- Operations this script made terminal: announced with one PUBLISH when it ends.
local DONE = {}

local function publish_done()
  if #DONE > 0 then redis.call('PUBLISH', keys.done, table.concat(DONE, '\n')) end
end

-- A deposed leader's writes are refused: the epoch it was given must still be the newest. A
-- call in a group reads the group's copy, which a new leader installs before it dispatches
-- (Store.take_epoch), so the check stays on the call's slot.
local function check_epoch()
  if ARGV[2] == '' then return end
  local current = tonumber(redis.call('GET', GB and keys.group_epoch or keys.epoch) or '0')
  if tonumber(ARGV[2]) ~= current then
    return redis.error_reply('STALE_EPOCH epoch ' .. ARGV[2] .. ' was superseded by ' .. current)
  end
end

-- A named result: {'name', value, 'name', value, ...}, read by name in Python.
local function result(...) return { ... } end

local function opid_of(rid, seq) return rid .. '#' .. seq end

local function op_state(opid)
  return tonumber(redis.call('HGET', keys.op(opid), 'state') or '0')
end

local function depth(state, delta)
  redis.call('HINCRBY', keys.depth, tostring(state), delta)
end

-- Open operations and unacknowledged results, and their bytes (an open operation's payload,
-- an unacknowledged result's body and error), per tenant and for the fleet: the call's group
-- counts its share (store/quota.py sums them and leases the limits to the groups). The bytes
-- an operation added are kept on its record (`bytes`, `rbytes`), so what goes back is exactly
-- what came in, once (each decrement sits beside a state change that happens once).
local function count(tenant, field, delta)
  if delta == 0 then return end
  redis.call('HINCRBY', keys.fleet_share, field, delta)
  redis.call('HINCRBY', keys.share(tenant), field, delta)
end

-- The leased limits by their letter (lease_*.lua, store/quota.py): the use each one bounds.
local LEASES = { p = 'pending', u = 'unacked', b = 'pending_bytes', r = 'unacked_bytes' }

-- The limits a new operation needs leased in the call's group, as the backpressure scopes
-- they refuse with (in the order they are checked) and the lease of each the group must
-- hold: empty when it holds enough. A result needs room for one more (its count, and a byte
-- of its size, known only when it finishes: finishing is never refused); an open operation
-- needs room for one more and for its whole payload, `size` bytes (nil for a born-FAILED
-- record, which only needs room for its result). `counts` false checks the bytes alone (a
-- hole-filling seq_id behind its run's head: submit.lua).
local function needs(tenant, size, counts)
  local fields = { 'pending', 'unacked', 'pending_bytes', 'unacked_bytes', 'lp', 'lu', 'lb', 'lr' }
  local t = redis.call('HMGET', keys.share(tenant), unpack(fields))
  local f = redis.call('HMGET', keys.fleet_share, unpack(fields))
  local scopes, want = {}, {}
  local function check(scope, s, use, add)  -- s[use + 4] is the lease of s[use]
    local lease = tonumber(s[use] or '0') + add
    if lease > tonumber(s[use + 4] or '0') then
      table.insert(scopes, scope)
      table.insert(want, lease)
    end
  end
  if counts then
    check('tenant_results', t, 2, 1)
    check('results', f, 2, 1)
  end
  check('tenant_result_bytes', t, 4, 1)
  check('result_bytes', f, 4, 1)
  if size then
    if counts then
      check('tenant', t, 1, 1)
      check('global', f, 1, 1)
    end
    check('tenant_bytes', t, 3, size)
    check('global_bytes', f, 3, size)
  end
  return scopes, want
end

local function error_json(category, field, message, reason)
  return cjson.encode({ category = category, field = field, message = message, reason = reason })
end

-- Queue the registration's head operation for the scheduler when it can run now.
local function push_head(rid)
  local rk = keys.reg(rid)
  if redis.call('HGET', rk, 'state') ~= REG.READY then return end
  local id = opid_of(rid, redis.call('HGET', rk, 'head'))
  local ok = keys.op(id)
  if tonumber(redis.call('HGET', ok, 'state') or '0') ~= OP.QUEUED then return end
  if redis.call('HGET', ok, 'pushed') == '1' then return end
  redis.call('HSET', ok, 'pushed', '1')
  if DATA_KINDS[redis.call('HGET', ok, 'kind')] then
    redis.call('RPUSH', keys.ready_data, id)
  else
    redis.call('RPUSH', keys.ready_ctl, id)
  end
end

-- Move the head past terminal operations, track a gap stall, and queue the new head.
local function advance(rid, now)
  local rk = keys.reg(rid)
  local head = tonumber(redis.call('HGET', rk, 'head'))
  while true do
    local id = opid_of(rid, head)
    local st = op_state(id)
    if st == 0 or st == OP.QUEUED or st == OP.CLAIMED then break end
    if st == OP.EXPIRED then  -- released before the head passed it: compacted now
      redis.call('DEL', keys.op(id))
      depth(OP.EXPIRED, -1)
    end
    head = head + 1
  end
  redis.call('HSET', rk, 'head', head)
  local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
  if op_state(opid_of(rid, head)) == 0 and max_seq > head then
    if tonumber(redis.call('HGET', rk, 'gap_seq') or '-1') ~= head then
      redis.call('HSET', rk, 'gap_seq', head)
      redis.call('ZADD', keys.gaps, now, rid)
    end
  else
    redis.call('HDEL', rk, 'gap_seq')
    redis.call('ZREM', keys.gaps, rid)
  end
  push_head(rid)
end

-- Make an open (QUEUED or CLAIMED) operation terminal. False when it was not open.
local function finish(opid, state, result_body, err, now)
  local ok = keys.op(opid)
  local f = redis.call('HMGET', ok, 'state', 'tenant', 'ordered', 'rid', 'bytes')
  local st = tonumber(f[1] or '0')
  if st ~= OP.QUEUED and st ~= OP.CLAIMED then return false end
  local rbytes = #result_body + #err
  redis.call('HSET', ok, 'state', state, 'finished_at', now, 'rbytes', rbytes)
  if result_body ~= '' then redis.call('HSET', ok, 'result', result_body) end
  if err ~= '' then redis.call('HSET', ok, 'error', err) end
  redis.call('HDEL', ok, 'payload', 'pushed', 'bytes')
  redis.call('ZREM', keys.claimed, opid)
  redis.call('SREM', keys.open_samples, opid)
  redis.call('ZADD', keys.results, now, opid)
  if f[3] == '1' then  -- last_done: when the run was last busy (paging's idleness)
    redis.call('HINCRBY', keys.reg(f[4]), 'pending', -1)
    redis.call('HSET', keys.reg(f[4]), 'last_done', now)
  end
  count(f[2], 'pending', -1)
  count(f[2], 'pending_bytes', -tonumber(f[5] or '0'))
  count(f[2], 'unacked', 1)
  count(f[2], 'unacked_bytes', rbytes)
  depth(st, -1)
  depth(state, 1)
  table.insert(DONE, opid)
  return true
end

-- Whether a released operation's record can go: what exactly-once needs of it is kept
-- elsewhere. A sample is not seq-ordered (running one again writes nothing and is seeded).
-- An ordered one below its registration's head is answered by the head itself (submit.lua:
-- a seq_id below the head with no record ran and was released), as is every one of a
-- retired registration (it admits nothing). One at or past the head stays an EXPIRED stub
-- until the head passes it (advance), which the ordering needs.
local function compactable(ordered, rid, seq)
  if ordered ~= '1' then return true end
  local r = redis.call('HMGET', keys.reg(rid), 'state', 'head')
  return r[1] == REG.RETIRED or tonumber(seq) < tonumber(r[2] or '0')
end

-- Release a terminal result: payload and result go, and the record with them where
-- `compactable`; else an EXPIRED stub keeps the seq_id reserved. An acknowledged one
-- (ack.lua) no longer counts as unacked.
local function expire(opid)
  local ok = keys.op(opid)
  local f = redis.call('HMGET', ok, 'state', 'tenant', 'acked', 'ordered', 'rid', 'seq', 'rbytes')
  local st = tonumber(f[1] or '0')
  if st ~= OP.SUCCEEDED and st ~= OP.FAILED and st ~= OP.CANCELLED then return false end
  redis.call('ZREM', keys.results, opid)
  if f[3] ~= '1' then
    count(f[2], 'unacked', -1)
    count(f[2], 'unacked_bytes', -tonumber(f[7] or '0'))
  end
  depth(st, -1)
  if compactable(f[4], f[5], f[6]) then
    redis.call('DEL', ok)
  else
    redis.call('HSET', ok, 'state', OP.EXPIRED)
    redis.call('HDEL', ok, 'result', 'error', 'payload', 'acked', 'rbytes')
    depth(OP.EXPIRED, 1)
  end
  return true
end

-- Fail every open operation of a registration (fencing, lost replica).
local function fail_open(rid, err, now)
  local rk = keys.reg(rid)
  local head = tonumber(redis.call('HGET', rk, 'head'))
  local max_seq = tonumber(redis.call('HGET', rk, 'max_seq'))
  local n = 0
  for seq = head, max_seq do
    if finish(opid_of(rid, seq), OP.FAILED, '', err, now) then n = n + 1 end
  end
  return n
end

-- A registration retires; its caller then takes it out of its tenant's live runs (a fleet
-- step, reg_retired.lua).
local function retire_state(rid)
  redis.call('HSET', keys.reg(rid), 'state', REG.RETIRED)
end

-- Claim a queued operation for dispatch. Ordered operations are claimable only at their
-- registration's head while it is bound. Each claim of an operation gets the next number: an
-- operation re-queued (its trainer lost) and claimed again may still be answered under its
-- old claim, and only the claim that holds it may record its outcome (complete.lua).
-- Returns false, or the claim as a named result.
local function claim_op(id, now)
  local ok = keys.op(id)
  local f = redis.call('HMGET', ok, 'state', 'rid', 'seq', 'kind', 'payload', 'ordered',
    'tenant', 'submitted_at')
  if tonumber(f[1] or '0') ~= OP.QUEUED then return false end
  -- Only an ordered operation reads its registration: a sample lives in its sampler's group,
  -- which need not be its registration's (on a Cluster the record is out of reach).
  local r = {}
  if f[6] == '1' then
    r = redis.call('HMGET', keys.reg(f[2] or ''), 'state', 'head', 'replica', 'slot', 'dirty',
      'base_model')
  end
  if f[6] == '1' and (r[1] ~= REG.READY or tonumber(r[2]) ~= tonumber(f[3])) then
    redis.call('HDEL', ok, 'pushed')
    return false
  end
  redis.call('HSET', ok, 'state', OP.CLAIMED, 'claimed_at', now)
  local number = redis.call('HINCRBY', ok, 'claim', 1)
  redis.call('HDEL', ok, 'pushed')
  redis.call('ZADD', keys.claimed, now, id)
  depth(OP.QUEUED, -1)
  depth(OP.CLAIMED, 1)
  return result('operation_id', id, 'registration_id', f[2], 'seq_id', f[3], 'kind', f[4],
    'payload', f[5] or '', 'replica', r[3] or '', 'slot', r[4] or '', 'dirty', r[5] or '0',
    'base_model', r[6] or '', 'tenant', f[7], 'submitted_at', f[8], 'claim', number)
end

-- A published version that nothing may hold any more (no sampler pins it, no sampler
-- checkpoint names it, and it is not its run's newest) is queued for the leader's version
-- collection (version_gc.py), which checks all of that again a grace later, in one script,
-- before the version leaves the rollouts and the disk.
local function let_go(aid, now)
  local ak = keys.adapter(aid)
  if redis.call('EXISTS', ak) == 0 then return end
  if redis.call('SCARD', keys.adapter_refs(aid)) > 0 then return end
  local rid, version = unpack(redis.call('HMGET', ak, 'rid', 'version'))
  if redis.call('HGET', keys.run_newest, rid) == version then return end
  redis.call('ZADD', keys.versions_unheld, now, aid)
end
