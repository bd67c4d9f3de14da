-- keys: ready_ctl ready_data claimed depth
-- Claim the ids the scheduler popped plus more from the ready queues (control before data),
-- up to `max` in all, in one round trip. ARGS: now, max, popped ids...
-- Result: a list of claims (each a named result, see claim_op).
local now, max = tonumber(ARGS[1]), tonumber(ARGS[2])
local ids = {}
for i = 3, #ARGS do table.insert(ids, ARGS[i]) end
for _, list in ipairs({ keys.ready_ctl, keys.ready_data }) do
  while #ids < max do
    local id = redis.call('LPOP', list)
    if not id then break end
    table.insert(ids, id)
  end
end
local out = {}
for _, id in ipairs(ids) do
  local c = claim_op(id, now)
  if c then table.insert(out, c) end
end
return out
