-- Claim one queued operation for dispatch (see claim_op). ARGV: P, opid, now.
return claim_op(ARGV[2], tonumber(ARGV[3]))
