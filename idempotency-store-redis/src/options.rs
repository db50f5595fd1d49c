//! [`RedisOptions`]: where the store connects and how patient it is.

use std::time::Duration;

use crate::keys::{InvalidKeyPrefix, KeyPrefix};

/// What the store connects to. Its `Debug` (and so [`RedisOptions`]') shows each URL with
/// the password replaced by `***`: options end up in logs.
#[derive(Clone, PartialEq, Eq)]
pub enum Target {
    /// One server (or a proxy in front of several): `redis://[user:password@]host:port[/db]`.
    Server(String),
    /// A Redis Cluster, found through any of these nodes (`redis://host:port` each).
    Cluster(Vec<String>),
}

impl Target {
    /// The target as errors and logs show it: the server's URL, or `cluster ` and the
    /// nodes' URLs, passwords replaced by `***`.
    pub(crate) fn redacted(&self) -> String {
        match self {
            Target::Server(url) => redact(url),
            Target::Cluster(nodes) => format!("cluster {}", redact_all(nodes).join(", ")),
        }
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Server(url) => f.debug_tuple("Server").field(&redact(url)).finish(),
            Target::Cluster(nodes) => f.debug_tuple("Cluster").field(&redact_all(nodes)).finish(),
        }
    }
}

/// Settings for [`RedisStore::connect_with`](crate::RedisStore::connect_with), built in
/// code or read from a store URL ([`from_url`](Self::from_url)) or a properties
/// configuration ([`from_config`](Self::from_config)), which say the same things.
///
/// ```
/// use std::time::Duration;
/// use idempotency_store_redis::{RedisOptions, Target};
///
/// let single = RedisOptions::server("redis://127.0.0.1:6379")
///     .operation_timeout(Duration::from_secs(1));
/// let cluster = RedisOptions::from_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")?
///     .key_prefix("orders-idempotency:")?;
/// assert_eq!(
///     cluster.target(),
///     &Target::Cluster(vec!["redis://10.0.0.1:7000".into(), "redis://10.0.0.2:7000".into()])
/// );
/// # drop(single); Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    pub(crate) target: Target,
    pub(crate) prefix: KeyPrefix,
    pub(crate) connect_timeout: Duration,
    pub(crate) operation_timeout: Duration,
    pub(crate) accept_evicting_policy: bool,
    pub(crate) replica_acks: Option<ReplicaAcks>,
    pub(crate) replica_ack_connections: Option<usize>,
}

/// How many replicas must acknowledge each write of the store before it counts as done,
/// and how long to wait for them: see [`RedisOptions::replica_acks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaAcks {
    /// Replicas (of the primary that ran the write) that must have it.
    pub replicas: u32,
    /// How long the primary waits for them (`WAIT`'s timeout), at least 1 ms.
    pub timeout: Duration,
}

/// How long connecting to a server may take, by default: 2 seconds.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one operation may take, reconnecting included, by default: 2 seconds. A
/// server that is down then fails requests within this bound (the layer answers 503 with
/// `Retry-After`) instead of holding them.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a write waits for its replicas when a store URL or properties ask for
/// `replica-acks` without `replica-ack-timeout`: 250 ms.
pub const DEFAULT_REPLICA_ACK_TIMEOUT: Duration = Duration::from_millis(250);

/// How many connections carry a single server's acknowledged writes, by default (see
/// [`RedisOptions::replica_ack_connections`]): 2.
pub const DEFAULT_REPLICA_ACK_CONNECTIONS: usize = 2;
/// How many writes may wait for replicas at once on a cluster, by default (see
/// [`RedisOptions::replica_ack_connections`]): 16.
pub const DEFAULT_CLUSTER_REPLICA_ACK_CONNECTIONS: usize = 16;

impl RedisOptions {
    /// One server (or a proxy): `redis://[user:password@]host:port[/db]`.
    pub fn server(url: impl Into<String>) -> Self {
        Self::new(Target::Server(url.into()))
    }

    /// A Redis Cluster, found through any of `nodes` (`redis://host:port` each; one is
    /// enough, the others are tried when it does not answer).
    pub fn cluster<S: Into<String>>(nodes: impl IntoIterator<Item = S>) -> Self {
        Self::new(Target::Cluster(nodes.into_iter().map(Into::into).collect()))
    }

    pub(crate) fn new(target: Target) -> Self {
        Self {
            target,
            prefix: KeyPrefix::default(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            accept_evicting_policy: false,
            replica_acks: None,
            replica_ack_connections: None,
        }
    }

    /// What the store connects to.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Puts every record under `prefix` instead of
    /// [`DEFAULT_KEY_PREFIX`](crate::DEFAULT_KEY_PREFIX) (`idempotency:`), e.g. to give two
    /// services on one server key spaces of their own. Refused if it holds `{` or `}`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Result<Self, InvalidKeyPrefix> {
        self.prefix = KeyPrefix::new(prefix)?;
        Ok(self)
    }

    /// How long one connection attempt may take (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long one store operation may take, waiting for a reconnection included
    /// (default 2 s). A 6 MiB response takes tens of milliseconds on a local network, so
    /// the default leaves room for large bodies on a loaded server.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Connects even when a server's `maxmemory-policy` is not `noeviction`, logging a
    /// warning instead of refusing.
    ///
    /// Every record has a TTL, so any other policy — the `volatile-*` ones included — lets
    /// the server evict live records under memory pressure: a finalized record that is
    /// evicted runs its mutation again on the next retry, and an evicted reservation lets a
    /// duplicate run beside its owner. Only opt in where the server can never reach its
    /// `maxmemory`, or where an occasional double execution is acceptable.
    pub fn accept_evicting_policy(mut self, accept: bool) -> Self {
        self.accept_evicting_policy = accept;
        self
    }

    /// Makes every write of the store (reserve, renew, finalize, release, take over,
    /// evict) wait until `replicas` replicas of the primary that ran it have it, for at
    /// most `timeout`: the script is followed by `WAIT replicas timeout` on the same
    /// connection, pipelined, so on a cluster both go to the primary of the record's
    /// slot. Off by default (replication is then asynchronous, and a failover can lose
    /// what the primary had acknowledged: a lost reservation or answer lets its mutation
    /// run again).
    ///
    /// A write that fewer replicas acknowledge in time **fails closed**: the operation
    /// answers a store error, so a reservation is not granted (the layer answers 503 with
    /// `Retry-After`, nothing runs, and the store releases the reservation it just made,
    /// best effort); a finalize is retried by the layer like any failed finalize.
    ///
    /// What it buys: with one replica per primary and `replicas = 1`, the replica a
    /// failover promotes holds every reservation and answer the store acknowledged, so a
    /// killed primary runs no mutation twice (measured in `tests/failover.rs`). It does not
    /// make a write durable against every failover: with several replicas per primary a
    /// failover may promote one that did not acknowledge it (Redis Cluster prefers the
    /// replica with the most data, which narrows but does not close that); ask for as
    /// many replicas as a shard has to close it. Until a failed primary's replacement
    /// replica has synced, a shard with too few replicas refuses keyed requests (503).
    ///
    /// What it costs: each write is answered once the replicas have acknowledged it (a
    /// replication round trip). Acknowledged writes go over connections of their own
    /// ([`replica_ack_connections`](Self::replica_ack_connections)), so a pending `WAIT`
    /// holds up no other request; on one server a `WAIT` acknowledges a whole group of
    /// writes. See the figures in BENCHMARKS.md. `timeout` should stay well below
    /// [`operation_timeout`](Self::operation_timeout), which bounds the whole operation.
    ///
    /// In a store URL or properties: `replica-acks=1&replica-ack-timeout=250ms`
    /// ([`from_url`](Self::from_url)).
    ///
    /// At connect the store warns (`tracing`) when a primary has fewer connected
    /// replicas than `replicas`: every write would then fail.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_store_redis::RedisOptions;
    ///
    /// let options = RedisOptions::from_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")?
    ///     .replica_acks(1, Duration::from_millis(500));
    /// # drop(options); Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn replica_acks(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replica_acks = (replicas > 0).then_some(ReplicaAcks {
            replicas,
            // `WAIT n 0` would block for ever.
            timeout: timeout.max(Duration::from_millis(1)),
        });
        self
    }
}

impl RedisOptions {
    /// How many connections of their own carry the writes that wait for replicas
    /// ([`replica_acks`](Self::replica_acks)), so that a pending `WAIT` holds up no other
    /// request. They are opened when first needed.
    ///
    /// - **One server** (default [`DEFAULT_REPLICA_ACK_CONNECTIONS`], 2): group commit. A
    ///   free connection takes every acknowledged write waiting at that moment and sends
    ///   them in one pipeline with one `WAIT` after them, which acknowledges them all;
    ///   while it waits for the replicas, the next group gathers for the other. More
    ///   connections make smaller groups: more `WAIT`s for the same writes.
    /// - **A cluster** (default [`DEFAULT_CLUSTER_REPLICA_ACK_CONNECTIONS`], 16): writes of
    ///   different slots cannot share a pipeline, so each write and its `WAIT` take a
    ///   cluster connection (one connection per primary) for themselves: this many writes
    ///   wait for replicas at once, the others queue for a free one.
    pub fn replica_ack_connections(mut self, connections: usize) -> Self {
        self.replica_ack_connections = Some(connections.max(1));
        self
    }

    /// [`replica_ack_connections`](Self::replica_ack_connections) for this target.
    pub(crate) fn ack_connections(&self) -> usize {
        self.replica_ack_connections.unwrap_or(match self.target {
            Target::Server(_) => DEFAULT_REPLICA_ACK_CONNECTIONS,
            Target::Cluster(_) => DEFAULT_CLUSTER_REPLICA_ACK_CONNECTIONS,
        })
    }
}

/// A URL [`RedisOptions::from_url`] does not understand.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{url:?} is not a Redis URL: use redis://host:port for one server, or \
     redis+cluster://host:port,host:port for a Redis Cluster (rediss:// for TLS)"
)]
pub struct UnsupportedUrl {
    url: String,
}

impl UnsupportedUrl {
    pub(crate) fn new(url: &str) -> Self {
        Self { url: redact(url) }
    }
}

/// Each of `urls` with its password replaced by `***`.
pub(crate) fn redact_all(urls: &[String]) -> Vec<String> {
    urls.iter().map(|url| redact(url)).collect()
}

/// `url` with its password replaced by `***`, for errors and logs.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let credentials = &url[scheme_end + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..]),
                None => format!("{}***{}", &url[..scheme_end + 3], &url[at..]),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("redis://app:hunter2@h:6379/0"),
            "redis://app:***@h:6379/0"
        );
        assert_eq!(redact("redis://hunter2@h:6379"), "redis://***@h:6379");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn options_print_no_password() {
        for url in [
            "redis://app:hunter2@h:6379/0",
            "redis+cluster://app:hunter2@h1:7000,h2:7001",
        ] {
            let printed = format!("{:?}", RedisOptions::from_url(url).unwrap());
            assert!(!printed.contains("hunter2"), "{printed}");
            assert!(printed.contains("app:***@h"), "{printed}");
        }
    }

    #[test]
    fn cluster_urls_share_credentials_path_and_query() {
        let options =
            RedisOptions::from_url("redis+cluster://app:secret@h1:7000,h2:7001/0?protocol=resp3")
                .unwrap();
        assert_eq!(
            options.target(),
            &Target::Cluster(vec![
                "redis://app:secret@h1:7000/0?protocol=resp3".to_owned(),
                "redis://app:secret@h2:7001/0?protocol=resp3".to_owned(),
            ])
        );
    }

    #[test]
    fn a_plain_url_is_one_server() {
        assert_eq!(
            RedisOptions::from_url("redis://127.0.0.1:6379/2")
                .unwrap()
                .target(),
            &Target::Server("redis://127.0.0.1:6379/2".to_owned())
        );
    }

    #[test]
    fn other_schemes_are_refused_without_showing_the_password() {
        let error = RedisOptions::from_url("postgres://u:hunter2@db/x").unwrap_err();
        let message = error.to_string();
        assert!(message.contains("redis+cluster://"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
        assert!(RedisOptions::from_url("redis+cluster:///").is_err());
        assert!(RedisOptions::from_url("localhost:6379").is_err());
    }
}
