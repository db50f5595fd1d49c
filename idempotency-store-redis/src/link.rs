//! What a store holds: its main connection, how a cluster connection that stopped
//! answering is replaced, and the lanes of the writes that wait for replicas.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisResult, Value};

use crate::connection::RedisConnection;
use crate::lanes::AckLanes;
use crate::scripts::Script;

/// What a store holds: the connection its commands go over (a single server's connection
/// manager, which reconnects by itself, or a cluster connection and the client to make a
/// new one with), and, when writes wait for replicas, the lanes those writes take.
#[derive(Clone)]
pub(crate) struct Link {
    main: Main,
    lanes: Option<Arc<AckLanes>>,
}

#[derive(Clone)]
enum Main {
    Server(ConnectionManager),
    Cluster(Arc<ClusterLink>),
}

/// A cluster connection that is replaced when it stops answering.
///
/// The cluster client reconnects to nodes by itself, and re-sends a command whose
/// connection dropped. But after every connection to every node was killed at once
/// (`CLIENT KILL` on each primary, under load), its connection was seen to stop
/// answering altogether: every command timed out, for as long as anyone waited. So an
/// operation that times out or loses its connection also starts (in the background, one
/// at a time) a fresh cluster connection, which takes the old one's place once it is up.
pub(crate) struct ClusterLink {
    client: ClusterClient,
    current: Mutex<ClusterConnection>,
    replacing: AtomicBool,
    connect_budget: Duration,
}

impl Link {
    pub(crate) fn server(manager: ConnectionManager) -> Self {
        Self {
            main: Main::Server(manager),
            lanes: None,
        }
    }

    pub(crate) fn cluster(
        client: ClusterClient,
        connection: ClusterConnection,
        connect_budget: Duration,
    ) -> Self {
        Self {
            main: Main::Cluster(Arc::new(ClusterLink {
                client,
                current: Mutex::new(connection),
                replacing: AtomicBool::new(false),
                connect_budget,
            })),
            lanes: None,
        }
    }

    /// Sends the writes that wait for replicas over `lanes` instead of the main
    /// connection.
    pub(crate) fn with_lanes(mut self, lanes: AckLanes) -> Self {
        self.lanes = Some(Arc::new(lanes));
        self
    }

    /// The connection to send the next command over.
    pub(crate) fn connection(&self) -> RedisConnection {
        match &self.main {
            Main::Server(manager) => RedisConnection::Server(manager.clone()),
            Main::Cluster(link) => RedisConnection::Cluster(
                link.current
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .clone(),
            ),
        }
    }

    /// Runs `script` followed by `WAIT replicas timeout_ms`, as
    /// [`RedisConnection::run_acknowledged`] does, over the store's lanes when it has
    /// them (see [`AckLanes`]): the `WAIT` then holds up no other request.
    pub(crate) async fn run_acknowledged(
        &self,
        script: &Script,
        keys: &[Vec<u8>],
        args: impl Fn(&mut Cmd),
        replicas: u32,
        timeout_ms: u64,
    ) -> RedisResult<(Value, i64)> {
        match &self.lanes {
            Some(lanes) => {
                lanes
                    .run_acknowledged(script, keys, args, replicas, timeout_ms)
                    .await
            }
            None => {
                self.connection()
                    .run_acknowledged(script, keys, args, replicas, timeout_ms)
                    .await
            }
        }
    }

    /// Called when an operation timed out or lost its connection: a cluster connection
    /// is replaced in the background (a single server's manager reconnects by itself).
    pub(crate) fn suspect(&self) {
        let Main::Cluster(link) = &self.main else {
            return;
        };
        if link.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = link.clone();
        tokio::spawn(async move {
            let fresh =
                tokio::time::timeout(link.connect_budget, link.client.get_async_connection()).await;
            match fresh {
                Ok(Ok(connection)) => {
                    *link
                        .current
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()) = connection;
                    tracing::info!("idempotency store: replaced the Redis Cluster connection");
                }
                Ok(Err(error)) => tracing::warn!(
                    %error,
                    "idempotency store: a new Redis Cluster connection failed; the next failing operation tries again"
                ),
                Err(_) => tracing::warn!(
                    "idempotency store: a new Redis Cluster connection timed out; the next failing operation tries again"
                ),
            }
            link.replacing.store(false, Ordering::Release);
        });
    }
}
