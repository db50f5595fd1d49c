-- Shared by every script of idempotency-store-redis (prepended to each one).
--
-- A record is one hash at KEYS[1]. Times are epoch milliseconds by this server's clock;
-- a lease or an expiry that ends at t is over at t. Fencing tokens are decimal strings
-- and are only ever compared as strings: Lua numbers are doubles and would round a
-- 63-bit token.

-- Redis 6 needs this before a write that follows TIME; Redis 7+ and Valkey always
-- replicate a script's effects, and keep the call as a no-op.
if redis.replicate_commands then
    redis.replicate_commands()
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

-- Integers go to Redis as plain digits, never in exponent notation.
local function digits(number)
    return string.format('%d', number)
end

-- The record's small fields, when `token` owns it: it exists, has not expired, is in
-- flight (no response yet) and holds that token. Otherwise nil.
local function owned_by(key, token)
    local record = redis.call('HMGET', key,
        'expires_at_ms', 'fencing_token', 'response_status', 'lease_expires_at_ms')
    if record[1] and now < tonumber(record[1]) and not record[3] and record[2] == token then
        return record
    end
    return nil
end

-- Starts a lease of `lease_ms` from now. A record in flight under a live lease never
-- expires, so the expiry (the field and the key's TTL) moves out to the lease's end when
-- the lease would outlive it.
local function lease_for(key, expires_at, lease_ms)
    local lease_end = now + lease_ms
    redis.call('HSET', key, 'lease_expires_at_ms', digits(lease_end))
    if lease_end > expires_at then
        redis.call('HSET', key, 'expires_at_ms', digits(lease_end))
        redis.call('PEXPIREAT', key, digits(lease_end))
    end
end

-- What `load` and a conflicting `reserve` answer: the live record, or false if there is
-- none. Reads the response body only when the record has one.
local function live_record(key)
    local record = redis.call('HMGET', key,
        'expires_at_ms', 'fencing_token', 'lease_expires_at_ms', 'response_status',
        'method', 'path', 'body_sha256', 'response_headers', 'response_body')
    if not record[1] or now >= tonumber(record[1]) then
        return false
    end
    local lapsed = 0
    if not record[4] and now >= tonumber(record[3]) then
        lapsed = 1
    end
    return {record[2], lapsed, record[5], record[6], record[7],
            record[4], record[8], record[9]}
end
