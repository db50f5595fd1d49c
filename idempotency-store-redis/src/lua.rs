//! The Lua source of the scripts, one constant per operation; each script sent to the
//! server is [`PRELUDE`] followed by its operation's part. (Kept in Rust strings, not
//! `.lua` files, so that the published crate, which carries only `.rs` sources, has
//! them.)

/// The prelude every script starts with: the server clock, and the helpers the operations share.
pub(crate) const PRELUDE: &str = r#"
-- Shared by every script of idempotency-store-redis (prepended to each one).
--
-- A record is one hash at KEYS[1]. Times are epoch milliseconds by this server's clock;
-- a lease or an expiry that ends at t is over at t. The server deletes a record's key as
-- its expiry begins (`expire_at`), so a record that is there has not expired. Fencing
-- tokens are decimal strings and are only ever compared as strings: Lua numbers are
-- doubles and would round a 63-bit token.

-- Redis 6 needs this before a write that follows TIME; Redis 7+ and Valkey always
-- replicate a script's effects, and keep the call as a no-op.
if redis.replicate_commands then
    redis.replicate_commands()
end

-- The server's clock, read when a script first needs it: a replay never does.
local now_ms
local function now()
    if not now_ms then
        local clock = redis.call('TIME')
        now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
    end
    return now_ms
end

-- Integers go to Redis as plain digits, never in exponent notation.
local function digits(number)
    return string.format('%d', number)
end

-- Has the server delete the record's key as its expiry at `expires_at` begins: Redis
-- keeps a key through the millisecond its time is set to, and a record expires at it.
local function expire_at(key, expires_at)
    redis.call('PEXPIREAT', key, digits(expires_at - 1))
end

-- The record's small fields, when `token` owns it: it exists, has not expired, is in
-- flight (no response yet) and holds that token. Otherwise nil.
local function owned_by(key, token)
    local record = redis.call('HMGET', key,
        'expires_at_ms', 'fencing_token', 'response_status', 'lease_expires_at_ms')
    if record[1] and now() < tonumber(record[1]) and not record[3] and record[2] == token then
        return record
    end
    return nil
end

-- Scope accounting, on a store with a scope quota only (the layout by scope): then
-- KEYS[2] is the scope's sorted set of records (member: a record's key; score: its
-- expiry) and KEYS[3] the scope's hash of bytes (field: a record's key, value: its bytes;
-- field 'total': their sum; no record key is 'total', every one holds a '{'). Both live
-- as long as the scope's last record. Without a quota, scripts get KEYS[1] alone.
local accounted = #KEYS == 3

-- Keeps the accounting keys until the scope's last record expires.
local function keep_accounting()
    local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
    if last[2] then
        local until_ms = digits(tonumber(last[2]))
        redis.call('PEXPIREAT', KEYS[2], until_ms)
        redis.call('PEXPIREAT', KEYS[3], until_ms)
    end
end

-- Stops counting `member` (a record's key) in its scope.
local function forget(member)
    local bytes = redis.call('HGET', KEYS[3], member)
    if bytes then
        redis.call('HINCRBY', KEYS[3], 'total', digits(-tonumber(bytes)))
        redis.call('HDEL', KEYS[3], member)
    end
    redis.call('ZREM', KEYS[2], member)
end

-- Stops counting the record at KEYS[1] (released or evicted); drops the accounting keys
-- with the scope's last record.
local function forget_record()
    if not accounted then
        return
    end
    forget(KEYS[1])
    if redis.call('ZCARD', KEYS[2]) == 0 then
        redis.call('DEL', KEYS[3])
    end
end

-- Stops counting up to `limit` records that expired (the server deleted them by
-- itself); answers whether more may be left.
local function prune(limit)
    local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', digits(now()),
        'LIMIT', 0, limit)
    for _, member in ipairs(expired) do
        forget(member)
    end
    return #expired == limit
end

-- Announces that the record at KEYS[1] settled, for the duplicates waiting on it: `how`
-- is 'PUBLISH' (a single server) or 'SPUBLISH' (a cluster: `channel` is then a shard
-- channel in the record's slot); anything else announces nothing.
local function announce(how, channel)
    if how == 'PUBLISH' or how == 'SPUBLISH' then
        redis.call(how, channel, KEYS[1])
    end
end

-- Starts a lease of `lease_ms` from now. A record in flight under a live lease never
-- expires, so the expiry (the field and the key's TTL) moves out to the lease's end when
-- the lease would outlive it.
local function lease_for(key, expires_at, lease_ms)
    local lease_end = now() + lease_ms
    redis.call('HSET', key, 'lease_expires_at_ms', digits(lease_end))
    if lease_end > expires_at then
        redis.call('HSET', key, 'expires_at_ms', digits(lease_end))
        expire_at(key, lease_end)
        if accounted then
            redis.call('ZADD', KEYS[2], 'XX', digits(lease_end), key)
            keep_accounting()
        end
    end
end

-- What an operator sees of the live record (no headers, no body), or false if there is
-- none: created, expires, lease end, status (false in flight), method, path, body
-- SHA-256, and now.
local function operator_view(key)
    local record = redis.call('HMGET', key,
        'expires_at_ms', 'created_at_ms', 'lease_expires_at_ms', 'response_status',
        'method', 'path', 'body_sha256')
    if not record[1] or now() >= tonumber(record[1]) then
        return false
    end
    return {record[2], record[1], record[3], record[4], record[5], record[6], record[7],
            digits(now())}
end

-- What `load` and a conflicting `reserve` answer: the live record, or false if there is
-- none. Reads the response body only when the record has one. A finished record that is
-- there is live (its key goes as it expires), and is answered without the clock; one in
-- flight reads its expiry and lease against it.
local function live_record(key)
    local record = redis.call('HMGET', key,
        'fencing_token', 'response_status', 'method', 'path', 'body_sha256',
        'response_headers', 'response_body', 'response_trailers')
    if not record[1] then
        return false
    end
    local lapsed = 0
    if not record[2] then
        local times = redis.call('HMGET', key, 'expires_at_ms', 'lease_expires_at_ms')
        if now() >= tonumber(times[1]) then
            return false
        end
        if now() >= tonumber(times[2]) then
            lapsed = 1
        end
    end
    return {record[1], lapsed, record[3], record[4], record[5],
            record[2], record[6], record[7], record[8]}
end
"#;

/// `reserve`.
pub(crate) const RESERVE: &str = r#"
-- reserve: insert an in-flight record unless a live one holds the key.
-- KEYS[1] record (KEYS[2], KEYS[3] the scope's accounting, with a quota);
-- ARGV: token, lease_ms, lifetime_ms, method, path, body_sha256, and with a quota: the
-- most records ('' for no bound), the most bytes ('' for none), this record's bytes.
-- Answers {'reserved'}, {'exists', <live record>}, {'token-taken'} when the expired
-- record being replaced holds the very token proposed (the client draws another), or
-- {'over-quota', records, bytes, ms until the scope's next expiry or -1}.
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
if accounted then
    -- The expired record being replaced, if any, no longer counts; nor do up to 64 that
    -- expired since (each is pruned once: the work is spread over the reservations).
    forget(key)
    local more = prune(64)
    local records = redis.call('ZCOUNT', KEYS[2], '(' .. digits(now()), '+inf')
    local bytes = tonumber(redis.call('HGET', KEYS[3], 'total') or '0')
    local max_records = tonumber(ARGV[7])
    local max_bytes = tonumber(ARGV[8])
    -- The record count is exact without pruning; the byte total is exact once every
    -- expired record is pruned, which is done before refusing for bytes.
    while more and max_bytes and bytes >= max_bytes do
        more = prune(1024)
        bytes = tonumber(redis.call('HGET', KEYS[3], 'total') or '0')
    end
    if (max_records and records >= max_records) or (max_bytes and bytes >= max_bytes) then
        local wait = -1
        local soonest = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. digits(now()), '+inf',
            'WITHSCORES', 'LIMIT', 0, 1)
        if soonest[2] then
            wait = tonumber(soonest[2]) - now()
        end
        return {'over-quota', records, bytes, wait}
    end
end
-- An expired record that the server has not dropped yet counts as absent.
redis.call('DEL', key)
local expires_at = now() + math.max(lifetime_ms, lease_ms)
redis.call('HSET', key,
    'method', ARGV[4], 'path', ARGV[5], 'body_sha256', ARGV[6],
    'fencing_token', ARGV[1],
    'created_at_ms', digits(now()),
    'expires_at_ms', digits(expires_at),
    'lease_expires_at_ms', digits(now() + lease_ms))
-- At its expiry the server deletes the record by itself (immediately, if that is now).
expire_at(key, expires_at)
if accounted then
    redis.call('ZADD', KEYS[2], digits(expires_at), key)
    redis.call('HSET', KEYS[3], key, ARGV[9])
    redis.call('HINCRBY', KEYS[3], 'total', ARGV[9])
    keep_accounting()
end
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
-- finalize: store the owner's response. KEYS[1] record (KEYS[2], KEYS[3] the scope's
-- accounting, with a quota); ARGV: token, status, encoded headers, body, encoded trailers
-- (empty for none), how and where to announce (see `announce`; '' for not at all), and
-- with a quota the bytes the answer adds.
-- Answers 1 if held, 0 otherwise. Never refused for the quota: the request already ran.
-- The record keeps its expiry: it lives its lifetime from its first submission.
if not owned_by(KEYS[1], ARGV[1]) then
    return 0
end
if accounted then
    redis.call('HINCRBY', KEYS[3], KEYS[1], ARGV[8])
    redis.call('HINCRBY', KEYS[3], 'total', ARGV[8])
end
redis.call('HSET', KEYS[1],
    'response_status', ARGV[2], 'response_headers', ARGV[3], 'response_body', ARGV[4])
if ARGV[5] ~= '' then
    redis.call('HSET', KEYS[1], 'response_trailers', ARGV[5])
end
announce(ARGV[6], ARGV[7])
return 1
"#;

/// `release`.
pub(crate) const RELEASE: &str = r#"
-- release: delete the owner's in-flight record, so a retry runs again.
-- KEYS[1] record (and the scope's accounting, with a quota); ARGV: token, how and where
-- to announce (see `announce`). Answers 1 if held, 0 otherwise.
if not owned_by(KEYS[1], ARGV[1]) then
    return 0
end
redis.call('DEL', KEYS[1])
forget_record()
announce(ARGV[2], ARGV[3])
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
if not record or now() < tonumber(record[4]) then
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
-- KEYS[1] record (and the scope's accounting, with a quota); ARGV: 'force' to delete a
-- record in flight too, anything else to leave it; how and where to announce (see
-- `announce`). Answers nil (no live record), {'in-flight', <view>} (left alone) or
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
forget_record()
announce(ARGV[2], ARGV[3])
return {'evicted', view}
"#;
