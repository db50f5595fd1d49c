//! A Redis / Valkey store for `idempotency-core`, on a single server or a Redis Cluster:
//! [`RedisStore`] implements the request path ([`IdempotencyStore`]), the operators'
//! [`RecordAdmin`] and maintenance's [`PurgeExpired`], so it is a
//! [`FullStore`](idempotency_core::FullStore).
//!
//! For teams whose shared state already lives in Redis: every replica of a service that
//! points at the same server (or cluster) sees every key, leases and expiry run on the
//! server's clock, and records expire by themselves at the end of their lifetime.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idempotency_core::IdempotencyLayer;
//! use idempotency_store_redis::RedisStore;
//!
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! let app: axum::Router = axum::Router::new()
//!     .route("/orders", axum::routing::post(|| async { "created" }))
//!     .layer(IdempotencyLayer::new(store));
//! # drop(app); Ok(()) }
//! ```
//!
//! A cluster, a key prefix of your own, shorter timeouts:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idempotency_store_redis::{RedisOptions, RedisStore};
//!
//! let options = RedisOptions::cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
//!     .key_prefix("orders:idempotency:")?
//!     .operation_timeout(Duration::from_millis(500));
//! let store = RedisStore::connect_with(options).await?;
//! // Or from one string (a flag, a config file), every option a URL parameter:
//! let same = RedisStore::connect(
//!     "redis+cluster://10.0.0.1:7000,10.0.0.2:7000?key-prefix=orders%3Aidempotency%3A&operation-timeout=500ms",
//! )
//! .await?;
//! # drop((store, same)); Ok(()) }
//! ```
//!
//! [`RedisOptions::from_url`] lists the parameters; a properties configuration
//! (`idempotency-store-type=redis`) gives the same ones as `idempotency-redis-*` keys
//! ([`properties`] lists them), read by [`open`].
//!
//! # Which store
//!
//! | you run | store |
//! | --- | --- |
//! | one process, tests, development | `MemoryStore` (`idempotency-store-memory`) |
//! | one host, records must survive restarts | `SqliteStore` (`idempotency-store-sql`) |
//! | several replicas with a SQL database | `PostgresStore` / `MySqlStore` (`idempotency-store-sql`) |
//! | several replicas with Redis or Valkey | `RedisStore` (this crate), single server or cluster |
//!
//! # Records
//!
//! A record is one Redis hash. Its key is the configured prefix (default
//! [`DEFAULT_KEY_PREFIX`], `idempotency:`) and the scope and key, length-prefixed inside a
//! Redis Cluster hash tag:
//!
//! ```text
//! idempotency:{6:tenant:0b7f5e2c-…}        scope "tenant", key "0b7f5e2c-…"
//! idempotency:{0::0b7f5e2c-…}              no scope
//! ```
//!
//! The scope's length in bytes comes first, so no pair of (scope, key) can share a Redis
//! key whatever bytes they hold (scope `a:b` + key `c` is `{3:a:b:c}`; scope `a` + key
//! `b:c` is `{1:a:b:c}`). The braces make the whole id the hash tag: every key a record
//! has lives in one slot, and records spread over all slots. A store with a scope quota
//! uses another layout, by scope: see [Scope quotas](#scope-quotas).
//!
//! | field | holds |
//! | --- | --- |
//! | `method`, `path`, `body_sha256` | the binding (the SHA-256 as 32 raw bytes) |
//! | `fencing_token` | the owner's token, a decimal string |
//! | `created_at_ms`, `expires_at_ms`, `lease_expires_at_ms` | epoch milliseconds, by the server's clock |
//! | `response_status`, `response_headers`, `response_body` | absent while in flight; the headers encoded by `StoredResponse::encode_headers` |
//! | `response_trailers` | absent when the answer had none; encoded by `StoredResponse::encode_trailers` |
//!
//! A hash leaves room for what later versions store beside a response (trailers, quota
//! accounting, fields an operator inspects without reading the body).
//!
//! # The scripts
//!
//! Every operation is one Lua script, so it is atomic: the server runs it to the end
//! before any other command. Each script touches the record's key only (with a scope
//! quota, also its scope's two accounting keys, in the same slot; on a cluster it
//! announces on a shard channel of that slot too), so it runs on a cluster as on a
//! single server. "Now" is the server's `TIME`, read inside
//! the script; the client's clock is never used, so clock skew between replicas cannot
//! cause a double execution. A lease or an expiry ending at `t` is over at `t`: the
//! server deletes a record's key as its expiry begins (`PEXPIREAT` one millisecond
//! before, since Redis keeps a key through its expiry's millisecond), so a finished
//! record that is there is live, and a replay reads no clock. The
//! scripts are sent by SHA-1 (`EVALSHA`); a server that does not know one yet (first
//! use, after a restart or a failover) gets it once with `EVAL`. [`RedisStore::script`]
//! shows each script.
//!
//! - **reserve**: if a live record holds the key, return it whole (so a replay is one
//!   round trip). Otherwise (absent, or expired but not yet dropped) write a fresh
//!   in-flight record: lease until `now + lease`, expiry at `now + max(lifetime, lease)`
//!   (a record in flight under a live lease never expires), and `PEXPIREAT` as that
//!   expiry begins, so the server deletes the record by itself when its life ends.
//! - **load**: the live record, with `lease_lapsed` decided by the server's clock.
//! - **renew**, **finalize**, **release**, **take over** are fenced: they act only if the
//!   record exists, has not expired, is in flight and holds the given token (an owner
//!   whose lease lapsed may still finish until someone takes over). Renew and take over
//!   start a lease of `now + lease` and move the expiry (field and TTL) out to the lease's
//!   end if it would otherwise come first. Take over also needs the lease to have lapsed,
//!   and keeps the record's creation time. Finalize keeps the expiry: a record lives its
//!   lifetime from its first submission.
//!
//! - **inspect** (for operators) returns the binding, state, status and times by the
//!   server's clock, never the stored headers or body; **evict** decides and deletes in
//!   one script (a record in flight only when forced), so a finalize cannot land between
//!   the verdict and the deletion. Waiters polling the record find it gone.
//!
//! **Fencing tokens** are 63 random bits drawn by the client for each reservation and
//! takeover, compared as strings inside the scripts (Lua numbers would round them). No
//! counter is kept on the server, so there is no auxiliary key whose loss could make a
//! token repeat; a takeover never hands out the token it replaces, and a reservation
//! never reuses the token of the expired record it replaces.
//!
//! **Expiry** is native: the key's TTL ends with the record's lifetime, and the server
//! deletes it then. [`PurgeExpired::purge_expired`] therefore deletes nothing and
//! answers [`Purged::ByBackend`]; there is no purge task to run (`spawn_purge_task` ends
//! after its first round on this store).
//!
//! # Connections, failures, timeouts
//!
//! A single server is reached through one multiplexed connection
//! ([`redis::aio::ConnectionManager`]) and a cluster through the cluster client's
//! connection, which routes every script to the primary of its record's slot and follows
//! `MOVED`/`ASK` (with [`RedisOptions::replica_acks`], writes that wait for replicas take
//! connections of their own: see [Failover](#failover)). Both reconnect by themselves: after a restart, a failover or a killed
//! connection, the operations caught in it fail (the layer answers 503 with
//! `Retry-After`) and the following ones go through, without restarting the application.
//! Every operation is bounded by [`RedisOptions::operation_timeout`] (2 s by default),
//! reconnecting included, so a dead server fails requests fast instead of holding them.
//!
//! Two details make this hold on a cluster too:
//!
//! - The cluster client re-sends a command whose connection dropped, so a script may run
//!   twice. Every script is safe to run twice: a re-sent reservation finds the record in
//!   flight under the very token it proposed (63 random bits, nobody else's) and reports
//!   it reserved; a re-sent takeover finds the record already under its new token; renew
//!   is idempotent; a re-sent finalize or release finds the record no longer in flight
//!   and reports the ownership lost, which the layer only logs (the record holds the
//!   answer, or is gone, as intended).
//! - After every connection to every node was killed at once under load, the cluster
//!   client's connection was seen to stop answering for good. So an operation that times
//!   out or loses its connection also makes a fresh cluster connection in the background
//!   (one at a time), which replaces the old one once it is up.
//!
//! # Scope quotas
//!
//! [`RedisStore::with_scope_quota`] bounds the live records and bytes each scope (each
//! tenant, each caller under a `CredentialScope`) may hold; see [`ScopeQuota`]. It is off
//! by default. The reserve script counts the scope and writes the record in one step, so
//! the bound holds across any number of replicas, on a single server and on a cluster.
//! A new key over the bound gets [`StoreError::QuotaExceeded`], whose `retry_after` is
//! the time until the scope's next record expires; the layer answers 429 with
//! `Retry-After`. A reservation that finds a live record (a replay, a duplicate in
//! flight) answers it before counting anything, so it is never refused; a finalize is
//! never refused either (the request already ran), so an answer may take a scope over its
//! byte bound, after which it reserves nothing more until it is back under. Other scopes
//! are never affected.
//!
//! **The layout by scope.** A script may only touch keys of one hash slot, so with a
//! quota the hash tag holds the scope alone, and the scope's accounting sits beside its
//! records:
//!
//! ```text
//! idempotency:{6:tenant}:0b7f5e2c-…     the record of scope "tenant", key "0b7f5e2c-…"
//! idempotency:{6:tenant}#expiries        sorted set: member a record's key, score its expiry (epoch ms)
//! idempotency:{6:tenant}#bytes           hash: a record's key → its bytes, and `total`
//! ```
//!
//! The mapping stays unambiguous: the length says where the scope ends, and after its
//! `}` a `:` starts a record's key and a `#` an accounting key. No key of one layout is a
//! key of the other. What this costs:
//!
//! - **On a cluster, one scope lives on one primary.** A busy scope loads one primary
//!   instead of all of them, and a service without scopes (every request in the scope
//!   `""`) puts every record in one slot: use a quota on a cluster together with a
//!   `CredentialScope`, or with scopes of your own. On a single server nothing changes.
//! - **Switching the quota on or off moves every record.** Records written under the
//!   other layout are not seen (they expire by themselves), so a retry that spans the
//!   switch runs again, as after a change of key prefix. Every replica must agree: a
//!   replica with a quota and one without do not see each other's records, and a
//!   duplicate sent to both would run twice. Changing the bounds alone (or setting one
//!   of the two) keeps the layout.
//!
//! **Counting.** Records expire natively, so the accounting never waits for a deletion
//! it would be told about:
//!
//! - Records are counted with `ZCOUNT` over the members whose expiry is after now:
//!   exact, whether or not expired members were removed yet.
//! - Bytes are a running `total`, as [`ScopeQuota`] counts them
//!   ([`RecordId::reserved_bytes`] at reserve, [`StoredResponse::stored_bytes`] added at
//!   finalize). Each reservation of a new key removes up to 64 expired members and takes
//!   their bytes off (each member once, so the work is spread over the reservations);
//!   before refusing for bytes, it removes all of them, so a refusal never counts an
//!   expired record.
//! - Renew and take over move a record's score when they move its expiry; release and
//!   evict remove its member; a reservation that replaces an expired record removes the
//!   old member first.
//! - Both accounting keys expire with the scope's last record (`PEXPIREAT` at the
//!   highest score), and are deleted when the scope's last record is released or
//!   evicted, so a scope that goes quiet leaves nothing behind.
//!
//! **Cost.** No round trip is added. Reserving a new key runs about ten more commands
//! inside its script (each O(log n) in the scope's records), plus the pruning; a replay
//! runs none; finalize two `HINCRBY`; release and evict three or four commands. Each
//! live record also holds a sorted-set member and a hash field, each a copy of its key.
//!
//! # Waiting duplicates
//!
//! Finalize, release and evict announce the record's key from inside their scripts:
//!
//! - on a single server with `PUBLISH` on the channel `<prefix>settled`, to which each
//!   store handle subscribes on one connection of its own, opened by its first wait;
//! - on a cluster with `SPUBLISH` on a shard channel in the record's slot,
//!   `<prefix>settled{<n>}` (`n` the smallest number whose hash slot is the record's), so
//!   the notice stays on the primary that ran the script. Each store handle opens one
//!   RESP3 cluster connection at its first wait (one more connection per primary), and
//!   `SSUBSCRIBE`s to a slot's channel when the first waiter of that slot starts; it
//!   stays subscribed, and the `redis` crate subscribes again after a reconnection.
//!
//! The store hands what it hears to every waiter of the process. A waiter subscribes,
//! loads its record, then sleeps until its record's notice comes or a second passes (a
//! lapsed lease is not announced, and a notice sent while a subscription reconnects is
//! lost), so a duplicate is woken at once and costs about one load a second instead of
//! five. After a (re)subscription or a dropped connection every waiter looks again.
//! While no subscription is up (it could not be made within the operation timeout, or a
//! single server's listener is reconnecting), new waiters poll as the trait's default
//! `wait` does (5 ms doubling to 200 ms), and the failure is logged. The payload is the
//! record's Redis key, which whoever may subscribe on the server may read anyway.
//!
//! # Failover
//!
//! A Redis primary acknowledges a write before its replicas have it. When it dies and a
//! replica is promoted, what the replica had not received is gone: a reservation whose
//! handler is running (a retry then runs it beside the owner) or a stored answer (the
//! next retry runs the mutation again). `tests/failover.rs` measures it on a Redis
//! Cluster with one replica per primary: keyed load from two service instances, a
//! primary killed (SIGKILL), the cluster promoting its replica.
//!
//! | configuration | primary killed | killed with its replica 200 ms behind |
//! | --- | --- | --- |
//! | default (asynchronous) | 0 of 963 mutations ran twice | 32 of 1,159 ran twice, 29 answers lost |
//! | `replica_acks(1, 250 ms)` | 0 of 1,494 | 0 of 965 |
//!
//! (One run on a busy 2-core machine; an earlier run: 0 of 3,320, 41 of 3,568 and 36
//! answers lost, 0 of 1,019, 0 of 1,075. On loopback a replica is well under a
//! millisecond behind, so the plain kill loses little or nothing; what the lag costs
//! grows with it.)
//!
//! [`RedisOptions::replica_acks`] closes the window for what the store acknowledged. In
//! a store URL, a properties configuration or a command-line flag it is
//! `replica-acks=1&replica-ack-timeout=250ms`:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idempotency_store_redis::{RedisOptions, RedisStore};
//!
//! let options = RedisOptions::from_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")?
//!     .replica_acks(1, Duration::from_millis(250));
//! let store = RedisStore::connect_with(options).await?;
//! // The same:
//! let same = RedisStore::connect(
//!     "redis+cluster://10.0.0.1:7000,10.0.0.2:7000?replica-acks=1&replica-ack-timeout=250ms",
//! )
//! .await?;
//! # drop((store, same)); Ok(()) }
//! ```
//!
//! - Each write script (reserve, renew, finalize, release, take over, evict) is followed
//!   by `WAIT 1 250` on the same connection, in one pipeline, so on a cluster both go to
//!   the primary of the record's slot, and the `WAIT` covers the script's write (it
//!   waits for every write the connection made before it).
//! - These writes go over connections of their own
//!   ([`RedisOptions::replica_ack_connections`]), never over the one that carries
//!   reads and the other operations, so a pending `WAIT` holds up no other request.
//!   On one server they are committed in groups: a free connection sends every
//!   acknowledged write waiting at that moment and one `WAIT` after them, which
//!   acknowledges them all. On a cluster each write and its `WAIT` take a connection
//!   for themselves (writes of several slots cannot share a pipeline), 16 at once by
//!   default.
//! - Fewer acknowledgements in time is a store error: a reservation is not granted (the
//!   layer answers 503 with `Retry-After`, the handler does not run; the store deletes
//!   the reservation it made, best effort, so the retry need not wait for the lease); a
//!   finalize is retried by the layer, and if it still fails the client gets its answer
//!   and the record waits for its lease, as after any failed finalize (the one window
//!   the layer documents: a retry after the lease lapses runs again).
//! - **What it does not do.** `WAIT` does not make a write durable against every
//!   failover: it says that *some* replicas have it, and a failover may promote another
//!   one. With one replica per primary and `replica_acks(1, …)` the promoted replica is
//!   the one that acknowledged; with two replicas per primary ask for 2 to be sure (Redis
//!   Cluster promotes the replica with the most data first, which narrows the gap for 1
//!   but does not close it). Nor does it make the replica's own copy durable on disk
//!   (that is its `appendfsync`).
//! - **What it costs.** Each write is answered after a replication round trip. On one
//!   server with one replica (loopback, release build, a shared 2-core machine), keyed
//!   requests over HTTP kept about 0.8× their throughput with 16 clients and 0.9× with
//!   64 (medians of eight runs; one `WAIT` per group of about 5 and 20 writes), against
//!   0.33× and 0.37× when every write had its own `WAIT` on the store's one connection;
//!   one client at a time pays the round trip in full (0.75×). On a cluster, where each write has its
//!   own `WAIT`, 16 clients kept 0.61× (a debug build). A shard without a connected
//!   replica refuses keyed writes until one is back (in the failover test, until the
//!   killed primary has restarted and resynced as the new primary's replica). See
//!   BENCHMARKS.md ("Replica acknowledgements").
//!
//! # Checks at connect
//!
//! [`RedisStore::connect`] fails with a [`ConnectError`] that says what to fix when:
//!
//! - the URL does not parse, or one of its parameters is unknown or has a bad value
//!   ([`RedisOptions::from_url`] lists them);
//! - no server answers in time;
//! - cluster options meet a server that is not a cluster node, or single-server options
//!   meet a cluster node;
//! - the cluster does not serve all 16384 hash slots;
//! - a primary's `maxmemory-policy` is not `noeviction`. Every record has a TTL, so the
//!   `volatile-*` policies evict live records as readily as the `allkeys-*` ones, and an
//!   evicted record runs its mutation again. [`RedisOptions::accept_evicting_policy`]
//!   turns the refusal into a logged warning.
//!
//! A server without the append-only file (`appendonly no`) is accepted with a warning, and
//! so is a primary with fewer connected replicas (`INFO replication`, `connected_slaves`)
//! than [`RedisOptions::replica_acks`] asks to acknowledge each write (its writes then
//! fail until enough replicas are connected).
//!
//! # Guarantees and limits
//!
//! - One of any number of concurrent first requests with a key wins, from any number of
//!   replicas, on a single server or a cluster.
//! - With `appendonly yes` and `appendfsync always`, a record the store reported written
//!   survives a server restart. With `appendfsync everysec` (Redis's default when AOF is
//!   on) a crash can lose the last second of writes; without AOF, everything since the
//!   last snapshot. A lost reservation lets a duplicate run beside its owner; a lost
//!   finalized record runs the mutation again on the next retry.
//! - Replication is asynchronous: a failover to a replica can lose the latest
//!   reservations and finalized records in the same way (measured: a primary killed while
//!   its replica was 200 ms behind ran 32 of 1,159 mutations twice). With
//!   [`RedisOptions::replica_acks`] every write is followed by `WAIT` on the same
//!   connection, and a write fewer replicas acknowledged fails closed (503, nothing
//!   runs): with one replica per primary and `replica_acks(1, …)`, the replica a failover
//!   promotes holds everything the store acknowledged, and no mutation ran twice in the
//!   same test. With more replicas per primary than acknowledgements asked for, a
//!   failover may still promote a replica that lacks a write; a shard whose replica is
//!   gone refuses keyed requests until one is back. The connect-time checks warn when a
//!   primary has fewer connected replicas than asked for. See
//!   [Failover](#failover).
//! - A full server (`noeviction` at `maxmemory`) refuses new reservations; the layer
//!   answers 503.
//! - Tested against Redis 7.0, a single server and a cluster. Valkey implements every
//!   command the scripts use (`EVAL`/`EVALSHA`, `TIME`, `HMGET`, `HSET`, `PEXPIREAT`,
//!   `DEL`, `PUBLISH`, and on a cluster `SPUBLISH`/`SSUBSCRIBE` (Redis 7 or Valkey 7.2+);
//!   with a scope quota also `ZADD`, `ZRANGE`, `ZRANGEBYSCORE`, `ZCOUNT`, `ZREM`,
//!   `ZCARD`, `HGET`, `HINCRBY`, `HDEL`), but no Valkey server runs in these tests.
//!
//! # Tests
//!
//! The crate's tests start their own `redis-server` processes on free ports of
//! 127.0.0.1: a single server with `appendonly yes`, and a three-primary Redis Cluster
//! made with `redis-cli --cluster create`. They run the conformance suite and the
//! reference model on both (with and without a scope quota), race 64 requests through
//! the layer over two store handles, race two handles for a scope's last places, wake 50
//! waiters by a notice and count their loads, restart the server and kill its
//! connections under load, and check each connect-time error.
//!
//! # Feature flags
//!
//! This crate has no cargo features. It uses the `redis` crate (1.x) with `tokio-comp`,
//! `connection-manager`, `cluster-async` and `script`, and re-exports it as
//! [`redis`].
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod answers;
mod config;
mod connect;
mod connection;
mod keys;
mod lanes;
mod link;
mod lua;
mod notices;
mod options;
mod parameters;
pub mod properties;
mod scripts;

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId, RecordState,
    Reservation, ScopeQuota, StoreError, StoredResponse, Waited, async_trait, wait_by_polling,
};
use redis::{Cmd, Value};
use tokio::sync::broadcast;

pub use config::open;
pub use connect::ConnectError;
pub use connection::RedisConnection;
pub use keys::{DEFAULT_KEY_PREFIX, InvalidKeyPrefix, KeyPrefix};
pub use options::{
    DEFAULT_CLUSTER_REPLICA_ACK_CONNECTIONS, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_REPLICA_ACK_CONNECTIONS, DEFAULT_REPLICA_ACK_TIMEOUT, RedisOptions, ReplicaAcks,
    Target, UnsupportedUrl,
};
pub use parameters::{OptionsError, URL_PARAMETERS};
/// The `redis` crate this store is built on (1.x), for options and your own commands.
pub use redis;
pub use scripts::{Operation, Script};

use answers::{
    OperationError, Unacknowledged, as_bytes, decode_record, decode_view, hint, unexpected,
};

/// Durations are clamped to this many milliseconds (about 100 years), so that
/// `now + duration` stays exact in a Lua number (a double).
const MAX_DURATION_MS: u128 = 100 * 366 * 24 * 60 * 60 * 1000;

/// How many times a reservation draws a new token after drawing the very token of the
/// expired record it would replace (a one-in-2^63 event each time).
const MAX_TOKEN_DRAWS: usize = 4;

/// An [`IdempotencyStore`] on Redis or Valkey: one server, or a Redis Cluster. Cheap to
/// clone: clones share the connection.
///
/// See the [crate docs](crate) for the record layout, the scripts and the guarantees.
#[derive(Clone)]
pub struct RedisStore {
    link: link::Link,
    prefix: KeyPrefix,
    operation_timeout: Duration,
    target: String,
    quota: Option<ScopeQuota>,
    /// Replicas that must acknowledge each write (see [`RedisOptions::replica_acks`]).
    replica_acks: Option<ReplicaAcks>,
    /// Where settled records are announced and heard (see [Waiting
    /// duplicates](crate#waiting-duplicates)).
    notices: Arc<notices::Board>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("target", &self.target)
            .field("prefix", &self.prefix)
            .field("operation_timeout", &self.operation_timeout)
            .field("scope_quota", &self.quota)
            .field("replica_acks", &self.replica_acks)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to `url` with the default options: `redis://host:port[/db]` for one
    /// server, `redis+cluster://host:port,host:port` for a cluster (see
    /// [`RedisOptions::from_url`]).
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::connect_with(RedisOptions::from_url(url)?).await
    }

    /// Connects as `options` say, and checks the server(s): see
    /// [Checks at connect](crate#checks-at-connect).
    pub async fn connect_with(options: RedisOptions) -> Result<Self, ConnectError> {
        let (link, board) = connect::open(&options).await?;
        let target = options.target.redacted();
        Ok(Self {
            link,
            prefix: options.prefix,
            operation_timeout: options.operation_timeout,
            target,
            quota: None,
            replica_acks: options.replica_acks,
            notices: Arc::new(board),
        })
    }

    /// Bounds what each scope may hold (see [`ScopeQuota`]): a reservation of a new key
    /// that would take its scope over gets [`StoreError::QuotaExceeded`] (the layer
    /// answers 429 with `Retry-After`), decided inside the reserve script, so atomically
    /// across every replica, on a single server and on a cluster.
    ///
    /// **This changes the key layout** to the layout by scope (see
    /// [Scope quotas](crate#scope-quotas)): a scope's records and its accounting share
    /// one hash slot, so on a cluster one scope's load lands on one primary. Records
    /// written without a quota are not seen with one, and the other way round: every
    /// replica must have a quota, or none, and switching is like changing the key prefix
    /// (a retry that spans the switch runs again).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idempotency_core::ScopeQuota;
    /// use idempotency_store_redis::RedisStore;
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .with_scope_quota(ScopeQuota::default().with_max_records(10_000));
    /// # drop(store); Ok(()) }
    /// ```
    pub fn with_scope_quota(mut self, quota: ScopeQuota) -> Self {
        self.quota = Some(quota);
        self
    }

    /// The scope quota, if one is set.
    pub fn scope_quota(&self) -> Option<&ScopeQuota> {
        self.quota.as_ref()
    }

    /// The replica acknowledgement each write waits for, if the options asked for one
    /// ([`RedisOptions::replica_acks`]).
    pub fn replica_acks(&self) -> Option<ReplicaAcks> {
        self.replica_acks
    }

    /// The connection the store runs on, for your own commands beside it.
    pub fn connection(&self) -> RedisConnection {
        self.link.connection()
    }

    /// The prefix of every key the store writes.
    pub fn key_prefix(&self) -> &KeyPrefix {
        &self.prefix
    }

    /// The Redis key of `id`'s record, e.g. to look at it with `redis-cli HGETALL`: in
    /// the layout by scope when the store has a scope quota.
    pub fn record_key(&self, id: &RecordId) -> Vec<u8> {
        match self.quota {
            Some(_) => self.prefix.scoped_record_key(&id.scope, &id.key),
            None => self.prefix.record_key(&id.scope, &id.key),
        }
    }

    /// The keys `id`'s record runs its scripts on: the record's, and with a scope quota
    /// its scope's two accounting keys (all three in one slot).
    fn keys(&self, id: &RecordId) -> Vec<Vec<u8>> {
        let record = self.record_key(id);
        match self.quota {
            Some(_) => {
                let [expiries, bytes] = self.prefix.scope_accounting_keys(&id.scope);
                vec![record, expiries, bytes]
            }
            None => vec![record],
        }
    }

    /// The Lua script `operation` runs, exactly as the store sends it.
    pub fn script(operation: Operation) -> &'static Script {
        operation.script()
    }

    /// Runs `operation`'s script on `id`'s record within the operation timeout; a write
    /// that fewer replicas acknowledged than [`RedisOptions::replica_acks`] asks for is an
    /// error.
    async fn run(
        &self,
        operation: Operation,
        id: &RecordId,
        args: impl Fn(&mut Cmd),
    ) -> Result<Value, StoreError> {
        match self.run_unchecked(operation, id, args, true).await? {
            (value, None) => Ok(value),
            (_, Some(missing)) => Err(missing.into_error()),
        }
    }

    /// Runs `operation`'s script on `id`'s record within the operation timeout, with
    /// `WAIT` after it when replica acknowledgement is on, `acknowledged` is true and the
    /// script writes. Answers the script's value, and what acknowledgement was missing.
    async fn run_unchecked(
        &self,
        operation: Operation,
        id: &RecordId,
        args: impl Fn(&mut Cmd),
        acknowledged: bool,
    ) -> Result<(Value, Option<Unacknowledged>), StoreError> {
        let keys = self.keys(id);
        let connection = self.link.connection();
        let acks = self
            .replica_acks
            .filter(|_| acknowledged && operation.writes());
        let running = async {
            match acks {
                None => connection
                    .run(operation.script(), &keys, args)
                    .await
                    .map(|value| (value, None)),
                Some(acks) => self
                    .link
                    .run_acknowledged(
                        operation.script(),
                        &keys,
                        args,
                        acks.replicas,
                        millis(acks.timeout),
                    )
                    .await
                    .map(|(value, count)| (value, Some((acks, count)))),
            }
        };
        match tokio::time::timeout(self.operation_timeout, running).await {
            Ok(Ok((value, Some((acks, count))))) if count < i64::from(acks.replicas) => Ok((
                value,
                Some(Unacknowledged {
                    operation: operation.name(),
                    acknowledged: count.max(0),
                    acks,
                }),
            )),
            Ok(Ok((value, _))) => Ok((value, None)),
            Ok(Err(source)) => {
                if source.is_timeout() || source.is_io_error() || source.is_connection_dropped() {
                    self.link.suspect();
                }
                Err(StoreError::backend(OperationError::Failed {
                    operation: operation.name(),
                    hint: hint(&source),
                    source,
                }))
            }
            Err(_) => {
                self.link.suspect();
                Err(StoreError::backend(OperationError::TimedOut {
                    operation: operation.name(),
                    timeout: self.operation_timeout,
                }))
            }
        }
    }

    /// Lets go, best effort, of a reservation (or takeover) under `token` whose write the
    /// replicas did not acknowledge, so that the key is free for the retry at once
    /// instead of after the lease; no request ran under it. Not acknowledged either: if
    /// the reservation never reached a replica, neither needs its deletion.
    async fn let_go_unacknowledged(&self, id: &RecordId, token: FencingToken) {
        let (how, channel) = self.announcement(id);
        let released = self
            .run_unchecked(
                Operation::Release,
                id,
                |cmd| {
                    cmd.arg(token.0).arg(how).arg(&channel[..]);
                },
                false,
            )
            .await;
        if let Err(error) = released {
            tracing::debug!(%error, "idempotency store: could not release an unacknowledged reservation; its lease will lapse");
        }
    }

    /// How and where finalize, release and evict announce that `id`'s record settled, as
    /// their scripts take it: `PUBLISH` and the store's channel on a single server,
    /// `SPUBLISH` and the shard channel of the record's slot on a cluster (see [Waiting
    /// duplicates](crate#waiting-duplicates)). For running the scripts raw, as the
    /// benchmarks do.
    pub fn announcement(&self, id: &RecordId) -> (&'static str, Vec<u8>) {
        self.notices.announcement(&self.record_key(id))
    }

    /// The error for the reserve script's `{'over-quota', records, bytes, ms until the
    /// scope's next expiry or -1}`.
    fn over_quota(&self, parts: &[Value]) -> StoreError {
        let number = |at: usize| match parts.get(at) {
            Some(Value::Int(n)) => *n,
            _ => 0,
        };
        let (records, bytes, wait) = (number(1), number(2), number(3));
        let bound = self
            .quota
            .and_then(|quota| quota.refuses(records.max(0) as u64, bytes.max(0) as u64))
            .unwrap_or_else(|| "its quota".to_owned());
        StoreError::QuotaExceeded {
            bound,
            retry_after: (wait >= 0).then(|| Duration::from_millis(wait as u64)),
        }
    }

    /// Runs a fenced operation: the script answers 1 when the token held the record.
    async fn fenced(
        &self,
        operation: Operation,
        id: &RecordId,
        args: impl Fn(&mut Cmd),
    ) -> Result<Ownership, StoreError> {
        match self.run(operation, id, args).await? {
            Value::Int(1) => Ok(Ownership::Held),
            Value::Int(0) => Ok(Ownership::Lost),
            other => Err(unexpected(operation, &other)),
        }
    }
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let (lease, lifetime) = (millis(lease), millis(lifetime));
        let bound = |max: Option<u64>| max.map_or_else(String::new, |max| max.to_string());
        for _ in 0..MAX_TOKEN_DRAWS {
            let token = new_token();
            let (answer, unacknowledged) = self
                .run_unchecked(
                    Operation::Reserve,
                    id,
                    |cmd| {
                        cmd.arg(token.0)
                            .arg(lease)
                            .arg(lifetime)
                            .arg(&binding.method)
                            .arg(&binding.path)
                            .arg(&binding.body_sha256[..]);
                        if let Some(quota) = &self.quota {
                            cmd.arg(bound(quota.max_records))
                                .arg(bound(quota.max_bytes))
                                .arg(id.reserved_bytes(binding));
                        }
                    },
                    true,
                )
                .await?;
            if let Some(missing) = unacknowledged {
                // Whatever the script answered, it is not acknowledged: fail closed. A
                // reservation under this token (made now, or by a first run of a re-sent
                // command) is let go at once; the release is fenced by the token, so it
                // never touches anyone else's record.
                self.let_go_unacknowledged(id, token).await;
                return Err(missing.into_error());
            }
            let Value::Array(mut parts) = answer else {
                return Err(unexpected(Operation::Reserve, &answer));
            };
            let record = (parts.len() == 2).then(|| parts.pop()).flatten();
            match (parts.first().and_then(as_bytes), record) {
                (Some(b"reserved"), None) => return Ok(Reservation::Reserved(token)),
                (Some(b"exists"), Some(record)) => {
                    let record = decode_record(record)?;
                    // The cluster client re-sends a command whose connection dropped; a
                    // re-sent reservation whose first run went through finds the record
                    // in flight under the token it proposed (63 random bits: nobody
                    // else's), and it is this caller's.
                    if let RecordState::InFlight { token: held, .. } = record.state
                        && held == token
                    {
                        return Ok(Reservation::Reserved(token));
                    }
                    return Ok(Reservation::Exists(record));
                }
                (Some(b"token-taken"), None) => continue,
                (Some(b"over-quota"), _) => return Err(self.over_quota(&parts)),
                _ => return Err(unexpected(Operation::Reserve, &Value::Array(parts))),
            }
        }
        Err(StoreError::backend(format!(
            "reserve drew the token of the expired record it replaces {MAX_TOKEN_DRAWS} times \
             in a row; the random source is broken"
        )))
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        match self.run(Operation::Load, id, |_| {}).await? {
            Value::Nil => Ok(None),
            record => decode_record(record).map(Some),
        }
    }

    /// Waiters are woken by the notice finalize, release and evict publish, and look
    /// again at least once a second (a lapsed lease is not announced); without a
    /// subscription they poll (the trait's default).
    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        let key = self.record_key(id);
        let Some(mut heard) = self.notices.listen_for(&key, self.operation_timeout).await else {
            return wait_by_polling(self, id, timeout).await;
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let record = self.load(id).await?;
            let now = tokio::time::Instant::now();
            if let Some(waited) = Waited::after_load(record, now >= deadline) {
                return Ok(waited);
            }
            let look_again_at = deadline.min(now + notices::SAFETY_POLL);
            loop {
                match tokio::time::timeout_at(look_again_at, heard.recv()).await {
                    Ok(Ok(notice)) if notice.is_empty() || *notice == *key => break,
                    Ok(Ok(_)) => {}
                    // Missed some: this record's may be among them.
                    Ok(Err(broadcast::error::RecvError::Lagged(_))) => break,
                    Ok(Err(broadcast::error::RecvError::Closed)) => {
                        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                        return wait_by_polling(self, id, left).await;
                    }
                    Err(_time_to_look) => break,
                }
            }
        }
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        self.fenced(Operation::Renew, id, |cmd| {
            cmd.arg(token.0).arg(millis(lease));
        })
        .await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let headers = response.encode_headers();
        let trailers = response.encode_trailers();
        let (how, channel) = self.announcement(id);
        self.fenced(Operation::Finalize, id, |cmd| {
            cmd.arg(token.0)
                .arg(response.status)
                .arg(&headers[..])
                .arg(&response.body[..])
                .arg(&trailers[..])
                .arg(how)
                .arg(&channel[..]);
            if self.quota.is_some() {
                cmd.arg(response.stored_bytes());
            }
        })
        .await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let (how, channel) = self.announcement(id);
        self.fenced(Operation::Release, id, |cmd| {
            cmd.arg(token.0).arg(how).arg(&channel[..]);
        })
        .await
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        let token = new_token_other_than(lapsed);
        let (answer, unacknowledged) = self
            .run_unchecked(
                Operation::TakeOver,
                id,
                |cmd| {
                    cmd.arg(lapsed.0).arg(token.0).arg(millis(lease));
                },
                true,
            )
            .await?;
        let outcome = match answer {
            Value::Int(1) => Ownership::Held,
            Value::Int(0) => Ownership::Lost,
            other => return Err(unexpected(Operation::TakeOver, &other)),
        };
        if let Some(missing) = unacknowledged {
            if outcome == Ownership::Held {
                self.let_go_unacknowledged(id, token).await;
            }
            return Err(missing.into_error());
        }
        Ok((outcome == Ownership::Held).then_some(token))
    }
}

#[async_trait]
impl RecordAdmin for RedisStore {
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        match self.run(Operation::Inspect, id, |_| {}).await? {
            Value::Nil => Ok(None),
            view => decode_view(view).map(Some),
        }
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let force = matches!(in_flight, EvictInFlight::Force);
        let (how, channel) = self.announcement(id);
        let answer = self
            .run(Operation::Evict, id, |cmd| {
                cmd.arg(if force { "force" } else { "refuse" })
                    .arg(how)
                    .arg(&channel[..]);
            })
            .await?;
        let parts = match answer {
            Value::Nil => return Ok(Eviction::NotFound),
            Value::Array(parts) if parts.len() == 2 => parts,
            other => return Err(unexpected(Operation::Evict, &other)),
        };
        let [verdict, view]: [Value; 2] = parts.try_into().expect("two parts");
        let view = decode_view(view)?;
        match as_bytes(&verdict) {
            Some(b"evicted") => Ok(Eviction::Evicted(view)),
            Some(b"in-flight") => Ok(Eviction::InFlight(view)),
            _ => Err(unexpected(Operation::Evict, &verdict)),
        }
    }
}

#[async_trait]
impl PurgeExpired for RedisStore {
    /// Records expire natively (the key's TTL ends with the record's life, and the server
    /// deletes it), so there is nothing to purge: deletes nothing and says so.
    async fn purge_expired(&self, _batch_size: usize) -> Result<Purged, StoreError> {
        Ok(Purged::ByBackend)
    }
}

/// A duration as whole milliseconds, rounded up (a 1 µs lease is 1 ms, not 0) and
/// clamped to [`MAX_DURATION_MS`].
pub(crate) fn millis(duration: Duration) -> u64 {
    duration.as_nanos().div_ceil(1_000_000).min(MAX_DURATION_MS) as u64
}

/// A fresh fencing token: 63 random bits (positive, never zero).
fn new_token() -> FencingToken {
    loop {
        // A v4 UUID's 6 fixed bits (version: bits 12-15 of `high`; variant: bits 62-63
        // of `low`) must each meet a random bit: turned by 32, the variant lands on
        // bits 30-31. (Turned by 17 it landed on bits 15-16, and bit 15, fixed at 0 in
        // both, left every token with bit 14 clear: 62 random bits.)
        let (high, low) = uuid::Uuid::new_v4().as_u64_pair();
        let token = ((high ^ low.rotate_left(32)) >> 1) as i64;
        if token != 0 {
            return FencingToken(token);
        }
    }
}

/// A fresh token that differs from `old`.
fn new_token_other_than(old: FencingToken) -> FencingToken {
    loop {
        let token = new_token();
        if token != old {
            return token;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_round_up_and_clamp() {
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(millis(Duration::from_nanos(1)), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS as u64);
    }

    #[test]
    fn tokens_are_positive_63_bit_and_differ() {
        for _ in 0..1000 {
            let token = new_token();
            assert!(token.0 > 0);
            assert_ne!(new_token_other_than(token), token);
        }
    }

    /// Each of a token's 63 bits is set in about half of the tokens drawn: the UUID's
    /// fixed version and variant bits are mixed away, and no bit leans either way (2 000
    /// draws: 1 000 ± 22 expected, so the bounds are 9 standard deviations out).
    #[test]
    fn token_bits_are_each_set_about_half_the_time() {
        let mut ones = [0_u32; 63];
        for _ in 0..2000 {
            let token = new_token().0;
            for (bit, count) in ones.iter_mut().enumerate() {
                *count += u32::from(token >> bit & 1 == 1);
            }
        }
        for (bit, count) in ones.iter().enumerate() {
            assert!(
                (800..=1200).contains(count),
                "bit {bit} was set in {count} of 2000 tokens"
            );
        }
    }

    #[test]
    fn every_operation_has_a_script_with_the_prelude() {
        for operation in Operation::ALL {
            let script = RedisStore::script(operation);
            assert!(script.source().contains("redis.call('TIME')"));
            assert_eq!(script.sha1().len(), 40);
        }
    }
}
