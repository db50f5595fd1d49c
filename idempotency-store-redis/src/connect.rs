//! Connecting, and the checks made at connect: that the target is what the options say
//! (one server, or a cluster serving every slot), and that no server may evict live
//! records.

use std::time::Duration;

use redis::aio::ConnectionManagerConfig;

use crate::notices::Board;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{IntoConnectionInfo, RedisError, Value};

use crate::connection::RedisConnection;
use crate::lanes::AckLanes;
use crate::link::Link;
use crate::options::{RedisOptions, Target, redact, redact_all};
use crate::parameters::OptionsError;

/// Why [`RedisStore::connect`](crate::RedisStore::connect) failed. Every message says what
/// to fix; URLs in them never show a password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL is not one the store understands, or one of its parameters cannot be
    /// used.
    #[error(transparent)]
    InvalidOptions(#[from] OptionsError),
    /// The Redis client could not parse a URL.
    #[error(
        "{url:?} is not a valid Redis URL ({source}); write it as \
         redis://[user:password@]host:port[/db]"
    )]
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// The client's complaint.
        #[source]
        source: RedisError,
    },
    /// No server answered at the address in time.
    #[error(
        "cannot reach Redis at {target} within {timeout:?} ({reason}); start the server, \
         or correct the host and port"
    )]
    Unreachable {
        /// The target, passwords redacted.
        target: String,
        /// How long the store waited.
        timeout: Duration,
        /// What happened.
        reason: String,
    },
    /// The server answered, but refused the store (authentication, ACL, a command the
    /// store needs).
    #[error(
        "Redis at {target} refused the store: {source}; check the user and password in the \
         URL, and that the user may run EVAL, EVALSHA and INFO"
    )]
    Refused {
        /// The target, passwords redacted.
        target: String,
        /// The server's answer.
        #[source]
        source: RedisError,
    },
    /// Cluster options without a single node to start from.
    #[error(
        "RedisOptions::cluster was given no node; list at least one redis://host:port of the \
         cluster"
    )]
    NoClusterNodes,
    /// Cluster options, but the server is not a cluster node.
    #[error(
        "Redis at {target} is not a Redis Cluster node (cluster support disabled); \
         connect to it with RedisOptions::server (redis://…), or point the options at a \
         cluster node"
    )]
    NotACluster {
        /// The target, passwords redacted.
        target: String,
    },
    /// Single-server options, but the server is a cluster node: keys of other nodes'
    /// slots would fail with `MOVED`.
    #[error(
        "Redis at {target} is a Redis Cluster node; connect with RedisOptions::cluster \
         (or a redis+cluster:// URL) so that each record goes to the node that owns its slot"
    )]
    IsACluster {
        /// The target, passwords redacted.
        target: String,
    },
    /// The cluster does not serve every hash slot, so records whose keys hash there
    /// would fail.
    #[error(
        "the Redis Cluster at {target} serves {served} of 16384 hash slots (missing: \
         {missing}); records whose keys hash there cannot be stored. Assign the missing \
         slots (redis-cli --cluster fix HOST:PORT) or wait until the cluster has formed"
    )]
    MissingSlots {
        /// The target, passwords redacted.
        target: String,
        /// How many slots some node serves.
        served: usize,
        /// The missing slot ranges, e.g. `0-99, 16000-16383`.
        missing: String,
    },
    /// A server's `maxmemory-policy` lets it evict live records.
    #[error(
        "Redis at {node} has maxmemory-policy {policy}, which may evict live idempotency \
         records (all of them have a TTL, so volatile-* policies evict them too) and then \
         run a mutation twice; set `maxmemory-policy noeviction` on every primary (full \
         memory then fails new reservations with 503 instead), or opt in with \
         RedisOptions::accept_evicting_policy(true)"
    )]
    EvictingPolicy {
        /// The node, as the server or cluster names it.
        node: String,
        /// The policy it reported.
        policy: String,
    },
    /// The server answered the checks with something the store cannot read.
    #[error("Redis at {target} answered {what} with something unexpected: {detail}")]
    Unexpected {
        /// The target, passwords redacted.
        target: String,
        /// Which check.
        what: &'static str,
        /// What came back.
        detail: String,
    },
}

/// How many times a dropped connection is re-dialled within one operation before the
/// operation fails; the next operation dials again. Kept low so that requests fail fast
/// (503) while a server is down, instead of queueing behind reconnection attempts.
const RECONNECT_ATTEMPTS: usize = 1;

/// How many times the cluster client retries a command: after a redirection (`MOVED`,
/// `ASK`) as well as after a lost connection, so it needs a few more than a single
/// server. The operation timeout still bounds the whole.
const CLUSTER_RETRIES: u32 = 4;

/// Opens the connection `options` describe and runs the connect-time checks; for a
/// single server, also returns the client that subscribes to settled records.
pub(crate) async fn open(options: &RedisOptions) -> Result<(Link, Board), ConnectError> {
    match &options.target {
        Target::Server(url) => open_server(url, options).await,
        Target::Cluster(nodes) => open_cluster(nodes, options).await,
    }
}

async fn open_server(url: &str, options: &RedisOptions) -> Result<(Link, Board), ConnectError> {
    let target = redact(url);
    let client = redis::Client::open(url).map_err(|source| ConnectError::InvalidUrl {
        url: target.clone(),
        source,
    })?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(options.connect_timeout))
        .set_response_timeout(Some(options.operation_timeout))
        .set_number_of_retries(RECONNECT_ATTEMPTS)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(500));
    let budget = options.connect_timeout + options.operation_timeout;
    let manager = within(
        &target,
        budget,
        client.get_connection_manager_with_config(config.clone()),
    )
    .await?;
    let connection = RedisConnection::Server(manager.clone());
    let info = info_of_each_primary(&connection, &target, options).await?;
    for (_, info) in &info {
        if field(info, "cluster_enabled") == Some("1") {
            return Err(ConnectError::IsACluster { target });
        }
    }
    check_servers(&info, options)?;
    let mut link = Link::server(manager);
    if let Some(acks) = options.replica_acks {
        link = link.with_lanes(AckLanes::grouped(
            client.clone(),
            config,
            options.ack_connections(),
            acks.replicas,
            crate::millis(acks.timeout),
        ));
    }
    let board = Board::server(client, options.prefix.as_str());
    Ok((link, board))
}

async fn open_cluster(
    nodes: &[String],
    options: &RedisOptions,
) -> Result<(Link, Board), ConnectError> {
    let target = redact_all(nodes).join(", ");
    if nodes.is_empty() {
        return Err(ConnectError::NoClusterNodes);
    }
    for node in nodes {
        node.as_str()
            .into_connection_info()
            .map_err(|source| ConnectError::InvalidUrl {
                url: redact(node),
                source,
            })?;
    }
    let client = ClusterClientBuilder::new(nodes.to_vec())
        .connection_timeout(options.connect_timeout)
        .response_timeout(options.operation_timeout)
        .retries(CLUSTER_RETRIES)
        .build()
        .map_err(|source| ConnectError::InvalidUrl {
            url: target.clone(),
            source,
        })?;
    let budget = options.connect_timeout + options.operation_timeout;
    let cluster = match within(&target, budget, client.get_async_connection()).await {
        Err(ConnectError::Refused { source, .. })
            if source.to_string().contains("cluster support disabled") =>
        {
            return Err(ConnectError::NotACluster { target });
        }
        other => other?,
    };
    let connection = RedisConnection::Cluster(cluster.clone());
    check_slots(&connection, &target, options).await?;
    let info = info_of_each_primary(&connection, &target, options).await?;
    check_servers(&info, options)?;
    // The connection that hears settled records: RESP3, for sharded pub/sub pushes.
    let board = Board::cluster(options.prefix.as_str(), |push| {
        ClusterClientBuilder::new(nodes.to_vec())
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.operation_timeout)
            .retries(CLUSTER_RETRIES)
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(push)
            .build()
    })
    .map_err(|source| ConnectError::InvalidUrl {
        url: target.clone(),
        source,
    })?;
    let mut link = Link::cluster(client.clone(), cluster, budget);
    if options.replica_acks.is_some() {
        link = link.with_lanes(AckLanes::leased(client, options.ack_connections()));
    }
    Ok((link, board))
}

/// Awaits `connecting` for at most `budget`, sorting its failure into unreachable (no
/// answer) or refused (an answer that says no).
async fn within<T>(
    target: &str,
    budget: Duration,
    connecting: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, ConnectError> {
    match tokio::time::timeout(budget, connecting).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error))
            if error.is_io_error()
                || error.is_connection_refusal()
                || error.is_timeout()
                || error.is_connection_dropped() =>
        {
            Err(ConnectError::Unreachable {
                target: target.to_owned(),
                timeout: budget,
                reason: error.to_string(),
            })
        }
        Ok(Err(source)) => Err(ConnectError::Refused {
            target: target.to_owned(),
            source,
        }),
        Err(_) => Err(ConnectError::Unreachable {
            target: target.to_owned(),
            timeout: budget,
            reason: "no answer".to_owned(),
        }),
    }
}

/// `INFO` from the server, or from every primary of a cluster: (node, text) pairs.
async fn info_of_each_primary(
    connection: &RedisConnection,
    target: &str,
    options: &RedisOptions,
) -> Result<Vec<(String, String)>, ConnectError> {
    let info = redis::cmd("INFO");
    let answer = match connection {
        RedisConnection::Server(manager) => {
            within(
                target,
                options.operation_timeout,
                info.query_async::<Value>(&mut manager.clone()),
            )
            .await?
        }
        RedisConnection::Cluster(cluster) => {
            let everywhere = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            within(
                target,
                options.operation_timeout,
                cluster.clone().route_command(info, everywhere),
            )
            .await?
        }
    };
    let unexpected = |detail: String| ConnectError::Unexpected {
        target: target.to_owned(),
        what: "INFO",
        detail,
    };
    match answer {
        Value::Map(per_node) => per_node
            .into_iter()
            .map(|(node, info)| {
                Ok((
                    text(&node).ok_or_else(|| unexpected(format!("{node:?}")))?,
                    text(&info).ok_or_else(|| unexpected(format!("{info:?}")))?,
                ))
            })
            .collect(),
        other => Ok(vec![(
            target.to_owned(),
            text(&other).ok_or_else(|| unexpected(format!("{other:?}")))?,
        )]),
    }
}

/// Refuses a server whose eviction policy may drop live records (unless the options
/// accept it), and warns about one that loses records when it restarts, and about one
/// with fewer connected replicas than the options want to acknowledge each write.
fn check_servers(info: &[(String, String)], options: &RedisOptions) -> Result<(), ConnectError> {
    for (node, info) in info {
        let policy = field(info, "maxmemory_policy").unwrap_or("noeviction");
        if policy != "noeviction" {
            if !options.accept_evicting_policy {
                return Err(ConnectError::EvictingPolicy {
                    node: node.clone(),
                    policy: policy.to_owned(),
                });
            }
            tracing::warn!(
                node = %node,
                policy,
                "Redis may evict live idempotency records (accepted by accept_evicting_policy): \
                 an evicted record lets its mutation run again"
            );
        }
        if let Some(acks) = options.replica_acks {
            let connected = field(info, "connected_slaves")
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(0);
            if connected < acks.replicas {
                tracing::warn!(
                    node = %node,
                    connected_replicas = connected,
                    replica_acks = acks.replicas,
                    "Redis has fewer connected replicas than RedisOptions::replica_acks asks to \
                     acknowledge each write: every write of its records will fail (503) until \
                     enough replicas are connected; add replicas, or ask for fewer acknowledgements"
                );
            }
        }
        if field(info, "aof_enabled") == Some("0") {
            tracing::warn!(
                node = %node,
                "Redis runs without the append-only file: a restart loses the records written \
                 since the last snapshot, and their mutations may run again; set `appendonly yes`"
            );
        }
    }
    Ok(())
}

/// Refuses a cluster that does not serve every hash slot.
async fn check_slots(
    connection: &RedisConnection,
    target: &str,
    options: &RedisOptions,
) -> Result<(), ConnectError> {
    let answer: Value = within(
        target,
        options.operation_timeout,
        redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut connection.clone()),
    )
    .await?;
    let mut served = vec![false; 16384];
    let Value::Array(ranges) = answer else {
        return Err(ConnectError::Unexpected {
            target: target.to_owned(),
            what: "CLUSTER SLOTS",
            detail: format!("{answer:?}"),
        });
    };
    for range in ranges {
        if let Value::Array(parts) = range
            && let [Value::Int(start), Value::Int(end), ..] = parts.as_slice()
        {
            for slot in (*start).max(0)..=(*end).min(16383) {
                served[slot as usize] = true;
            }
        }
    }
    let count = served.iter().filter(|s| **s).count();
    if count == served.len() {
        return Ok(());
    }
    let mut missing = Vec::new();
    let mut slot = 0;
    while slot < served.len() {
        if served[slot] {
            slot += 1;
            continue;
        }
        let start = slot;
        while slot < served.len() && !served[slot] {
            slot += 1;
        }
        missing.push(if start == slot - 1 {
            start.to_string()
        } else {
            format!("{start}-{}", slot - 1)
        });
    }
    Err(ConnectError::MissingSlots {
        target: target.to_owned(),
        served: count,
        missing: missing.join(", "),
    })
}

/// The value of `name:` in an `INFO` answer.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) => Some(text.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_fields_are_read_by_name() {
        let info = "# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n";
        assert_eq!(field(info, "maxmemory_policy"), Some("allkeys-lru"));
        assert_eq!(field(info, "maxmemory"), Some("0"));
        assert_eq!(field(info, "aof_enabled"), None);
    }
}
