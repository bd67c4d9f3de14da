-- keys: claimed depth
-- Claim one queued operation for dispatch (see claim_op). ARGS: opid, now.
-- Result: the claim's fields, or an empty list when it is not claimable.
return claim_op(ARGS[1], tonumber(ARGS[2])) or {}
