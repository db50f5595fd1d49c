//! The Lua source of the scripts, one constant per operation; each script sent to the
//! server is [`PRELUDE`] followed by its operation's part. (Kept in Rust strings, not
//! `.lua` files, so that the published crate, which carries only `.rs` sources, has
//! them.)

/// The prelude every script starts with: the server clock, and the helpers the operations share.
pub(crate) const PRELUDE: &str = r#"
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

-- What an operator sees of the live record (no headers, no body), or false if there is
-- none: created, expires, lease end, status (false in flight), method, path, body
-- SHA-256, and now.
local function operator_view(key)
    local record = redis.call('HMGET', key,
        'expires_at_ms', 'created_at_ms', 'lease_expires_at_ms', 'response_status',
        'method', 'path', 'body_sha256')
    if not record[1] or now >= tonumber(record[1]) then
        return false
    end
    return {record[2], record[1], record[3], record[4], record[5], record[6], record[7],
            digits(now)}
end

-- What `load` and a conflicting `reserve` answer: the live record, or false if there is
-- none. Reads the response body only when the record has one.
local function live_record(key)
    local record = redis.call('HMGET', key,
        'expires_at_ms', 'fencing_token', 'lease_expires_at_ms', 'response_status',
        'method', 'path', 'body_sha256', 'response_headers', 'response_body',
        'response_trailers')
    if not record[1] or now >= tonumber(record[1]) then
        return false
    end
    local lapsed = 0
    if not record[4] and now >= tonumber(record[3]) then
        lapsed = 1
    end
    return {record[2], lapsed, record[5], record[6], record[7],
            record[4], record[8], record[9], record[10]}
end
"#;

/// `reserve`.
pub(crate) const RESERVE: &str = r#"
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
"#;

/// `load`.
pub(crate) const LOAD: &str = r#"
-- load: the live record, or nil. KEYS[1] record; no ARGV.
return live_record(KEYS[1])
"#;

/// `renew`.
pub(crate) const RENEW: &str = r#"
-- renew: a new lease for the owner. KEYS[1] record; ARGV: token, lease_ms.
-- Answers 1 if the token owned the record, 0 otherwise (nothing changed).
local record = owned_by(KEYS[1], ARGV[1])
if not record then
    return 0
end
lease_for(KEYS[1], tonumber(record[1]), tonumber(ARGV[2]))
return 1
"#;

/// `finalize`.
pub(crate) const FINALIZE: &str = r#"
-- finalize: store the owner's response. KEYS[1] record;
-- ARGV: token, status, encoded headers, body, encoded trailers (empty for none).
-- Answers 1 if held, 0 otherwise.
-- The record keeps its expiry: it lives its lifetime from its first submission.
if not owned_by(KEYS[1], ARGV[1]) then
    return 0
end
redis.call('HSET', KEYS[1],
    'response_status', ARGV[2], 'response_headers', ARGV[3], 'response_body', ARGV[4])
if ARGV[5] ~= '' then
    redis.call('HSET', KEYS[1], 'response_trailers', ARGV[5])
end
return 1
"#;

/// `release`.
pub(crate) const RELEASE: &str = r#"
-- release: delete the owner's in-flight record, so a retry runs again.
-- KEYS[1] record; ARGV: token. Answers 1 if held, 0 otherwise.
if not owned_by(KEYS[1], ARGV[1]) then
    return 0
end
redis.call('DEL', KEYS[1])
return 1
"#;

/// `take_over`.
pub(crate) const TAKE_OVER: &str = r#"
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
"#;

/// `inspect`.
pub(crate) const INSPECT: &str = r#"
-- inspect: the live record as an operator sees it (no headers, no body), or nil.
-- KEYS[1] record; no ARGV.
return operator_view(KEYS[1])
"#;

/// `evict`.
pub(crate) const EVICT: &str = r#"
-- evict: delete the live record on an operator's order, whatever token it holds.
-- KEYS[1] record; ARGV: 'force' to delete a record in flight too, anything else to leave
-- it. Answers nil (no live record), {'in-flight', <view>} (left alone) or
-- {'evicted', <view>}: the verdict and the deletion are one step, so a finalize cannot
-- slip between them.
local view = operator_view(KEYS[1])
if not view then
    return false
end
if not view[4] and ARGV[1] ~= 'force' then
    return {'in-flight', view}
end
redis.call('DEL', KEYS[1])
return {'evicted', view}
"#;
