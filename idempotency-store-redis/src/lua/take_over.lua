-- take_over: a new owner for an in-flight record whose lease has lapsed.
-- KEYS[1] record; ARGV: the lapsed token, the new token, lease_ms.
-- Answers 1 if taken over, 0 otherwise. The record keeps its creation time and expiry
-- (moved out only as far as the new lease needs).
-- A takeover re-sent after its answer was lost (the cluster client re-sends a command
-- whose connection dropped) finds the record already held by its own new token.
if owned_by(KEYS[1], ARGV[2]) then
    return 1
end
local record = owned_by(KEYS[1], ARGV[1])
if not record or now < tonumber(record[4]) then
    return 0
end
redis.call('HSET', KEYS[1], 'fencing_token', ARGV[2])
lease_for(KEYS[1], tonumber(record[1]), tonumber(ARGV[3]))
return 1
