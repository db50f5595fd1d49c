//! The Redis store's name and keys in a properties configuration
//! ([`IdempotencyConfig`](idempotency_core::config::IdempotencyConfig)), read by
//! [`RedisOptions::from_config`](crate::RedisOptions::from_config) and
//! [`open`](crate::open).
//!
//! `idempotency-store-type=redis` names the Redis store. Besides the keys every store
//! shares (`idempotency-enabled`, `idempotency-key-lifetime`, `idempotency-store-type`,
//! `idempotency-purge-interval`, `idempotency-scope-max-*`: see
//! `idempotency_core::config`), it takes the URL and, as `idempotency-redis-*` keys, the
//! store URL's parameters of the same name
//! ([`RedisOptions::from_url`](crate::RedisOptions::from_url)):
//! `idempotency-redis-replica-acks=1` is `redis://…?replica-acks=1`. One parser reads
//! both; a setting given both ways is refused.
//!
//! | key | default | value |
//! | --- | --- | --- |
//! | `idempotency-redis-url` | — (required) | `redis://…`, `rediss://…` (TLS), `redis+cluster://host:port,host:port`, with the store's URL parameters if you like |
//! | `idempotency-redis-key-prefix` | `idempotency:` | a key prefix without `{` or `}` |
//! | `idempotency-redis-connect-timeout` | `2s` | a positive duration: `500ms`, `2s`, `1m` or ISO-8601 (`PT2S`) |
//! | `idempotency-redis-operation-timeout` | `2s` | a positive duration |
//! | `idempotency-redis-replica-acks` | `0` (off) | the replicas that must acknowledge each write |
//! | `idempotency-redis-replica-ack-timeout` | `250ms` | how long a write waits for them (needs `replica-acks`), at least 1 ms |
//! | `idempotency-redis-replica-ack-connections` | `2`; `16` on a cluster | the connections that carry the writes waiting for replicas, 1 to 1024 |
//! | `idempotency-redis-accept-evicting-policy` | `false` | `true` or `false`: connect although `maxmemory-policy` may evict records |
//! | `idempotency-redis-cluster` | from the URL's scheme | `true` or `false`: `true` makes a `redis://` URL a cluster's seed node |
//!
//! Any other store property (a misspelt key, or another store's) is refused, with an
//! error that names it and these keys; a bad value is refused with an error that names
//! the key, the value and what is expected, never the URL's password.
//!
//! ```text
//! idempotency-enabled=true
//! idempotency-store-type=redis
//! idempotency-redis-url=redis+cluster://10.0.0.1:7000,10.0.0.2:7000
//! idempotency-redis-replica-acks=1
//! ```

/// `idempotency-store-type=redis`: the Redis store.
pub const STORE_TYPE: &str = "redis";
/// `idempotency-redis-url`
pub const REDIS_URL: &str = "idempotency-redis-url";
/// `idempotency-redis-key-prefix`
pub const REDIS_KEY_PREFIX: &str = "idempotency-redis-key-prefix";
/// `idempotency-redis-connect-timeout`
pub const REDIS_CONNECT_TIMEOUT: &str = "idempotency-redis-connect-timeout";
/// `idempotency-redis-operation-timeout`
pub const REDIS_OPERATION_TIMEOUT: &str = "idempotency-redis-operation-timeout";
/// `idempotency-redis-replica-acks`
pub const REDIS_REPLICA_ACKS: &str = "idempotency-redis-replica-acks";
/// `idempotency-redis-replica-ack-timeout`
pub const REDIS_REPLICA_ACK_TIMEOUT: &str = "idempotency-redis-replica-ack-timeout";
/// `idempotency-redis-replica-ack-connections`
pub const REDIS_REPLICA_ACK_CONNECTIONS: &str = "idempotency-redis-replica-ack-connections";
/// `idempotency-redis-accept-evicting-policy`
pub const REDIS_ACCEPT_EVICTING_POLICY: &str = "idempotency-redis-accept-evicting-policy";
/// `idempotency-redis-cluster`
pub const REDIS_CLUSTER: &str = "idempotency-redis-cluster";

/// Every key the Redis store takes, besides the general ones: the URL, then each URL
/// parameter of [`URL_PARAMETERS`](crate::URL_PARAMETERS) as `idempotency-redis-*`.
pub const KEYS: [&str; 9] = [
    REDIS_URL,
    REDIS_KEY_PREFIX,
    REDIS_CONNECT_TIMEOUT,
    REDIS_OPERATION_TIMEOUT,
    REDIS_REPLICA_ACKS,
    REDIS_REPLICA_ACK_TIMEOUT,
    REDIS_REPLICA_ACK_CONNECTIONS,
    REDIS_ACCEPT_EVICTING_POLICY,
    REDIS_CLUSTER,
];
