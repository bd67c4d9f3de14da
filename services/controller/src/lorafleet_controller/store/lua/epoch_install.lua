-- keys: group_epoch
-- Install a new leader's epoch in the call's group (Store.take_epoch), never lowering it: a
-- slower, older leader's install that arrives late changes nothing. ARGS: epoch.
-- Result: epoch = the group's epoch now.
local epoch = tonumber(ARGS[1])
local current = tonumber(redis.call('GET', keys.group_epoch) or '0')
if epoch > current then
  redis.call('SET', keys.group_epoch, epoch)
  current = epoch
end
return result('epoch', current)
