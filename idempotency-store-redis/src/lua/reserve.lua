-- reserve: insert an in-flight record unless a live one holds the key.
-- KEYS[1] record; ARGV: token, lease_ms, lifetime_ms, method, path, body_sha256.
-- Answers {'reserved'}, {'exists', <live record>}, or {'token-taken'} when the expired
-- record being replaced holds the very token proposed (the client draws another).
local key = KEYS[1]
local existing = live_record(key)
if existing then
    return {'exists', existing}
end
local previous = redis.call('HGET', key, 'fencing_token')
if previous == ARGV[1] then
    return {'token-taken'}
end
local lease_ms = tonumber(ARGV[2])
local lifetime_ms = tonumber(ARGV[3])
-- An expired record that the server has not dropped yet counts as absent.
redis.call('DEL', key)
local expires_at = now + math.max(lifetime_ms, lease_ms)
redis.call('HSET', key,
    'method', ARGV[4], 'path', ARGV[5], 'body_sha256', ARGV[6],
    'fencing_token', ARGV[1],
    'created_at_ms', digits(now),
    'expires_at_ms', digits(expires_at),
    'lease_expires_at_ms', digits(now + lease_ms))
-- At its expiry the server deletes the record by itself (immediately, if that is now).
redis.call('PEXPIREAT', key, digits(expires_at))
return {'reserved'}
