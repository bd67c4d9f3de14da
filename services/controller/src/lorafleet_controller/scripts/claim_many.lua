-- Claim the ids the scheduler popped plus up to `max` in all from the ready lists (control
-- before data), in one round trip. ARGV: P, now, max, popped ids...
-- Returns a flat list: for each claimed operation its id and the 10 fields of claim_op.
local now, max = tonumber(ARGV[2]), tonumber(ARGV[3])
local ids = {}
for i = 4, #ARGV do table.insert(ids, ARGV[i]) end
for _, list in ipairs({ P .. 'ready:ctl', P .. 'ready:data' }) do
  while #ids < max do
    local id = redis.call('LPOP', list)
    if not id then break end
    table.insert(ids, id)
  end
end
local out = {}
for _, id in ipairs(ids) do
  local c = claim_op(id, now)
  if c then
    table.insert(out, id)
    for i = 1, 10 do table.insert(out, c[i]) end
  end
end
return out
