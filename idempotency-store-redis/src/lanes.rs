//! The connections that carry the writes which wait for replicas (`WAIT`), apart from
//! the store's main connection.
//!
//! Redis answers a connection's commands in order, and a `WAIT` holds its connection
//! until the replicas answer. On the store's one multiplexed connection every command
//! sent behind a pending `WAIT` (other requests' writes, reads) waited for it, so
//! acknowledged writes went one replication round trip at a time. Here they never share
//! a connection with anything but other acknowledged writes:
//!
//! - **One server: group commit.** Writes queue for the next free lane, which sends
//!   every write it finds queued, and one `WAIT` after them, in one pipeline: the `WAIT`
//!   counts the replicas that have every write its connection sent before it, so one
//!   acknowledgement serves the whole group. While a lane waits, the next group gathers
//!   for another lane. The writes stay pipelined, as on the main connection.
//! - **A cluster: a lane per write.** A pipeline goes to one slot's primary, and writes
//!   of different slots cannot share one, so each write takes a lane (a cluster
//!   connection of its own) for itself and its `WAIT`; up to `count` wait at once.

use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use tokio::sync::{Semaphore, SemaphorePermit, mpsc, oneshot};

use crate::connection::{RedisConnection, lost_connection, script_command};
use crate::scripts::Script;

/// The most writes one group carries.
const MAX_GROUP: usize = 128;

/// Where a store's acknowledged writes go.
pub(crate) enum AckLanes {
    Grouped(Grouped),
    Leased(Box<Leased>),
}

impl AckLanes {
    /// `count` lanes of their own to the server `client` reaches, each sending groups of
    /// writes followed by `WAIT replicas timeout_ms`. Spawns the lanes' tasks, which end
    /// when the lanes are dropped.
    pub(crate) fn grouped(
        client: redis::Client,
        config: ConnectionManagerConfig,
        count: usize,
        replicas: u32,
        timeout_ms: u64,
    ) -> Self {
        let (queue, waiting) = mpsc::unbounded_channel();
        let waiting = Arc::new(tokio::sync::Mutex::new(waiting));
        for _ in 0..count.max(1) {
            tokio::spawn(lane(
                waiting.clone(),
                client.clone(),
                config.clone(),
                replicas,
                timeout_ms,
            ));
        }
        AckLanes::Grouped(Grouped { queue })
    }

    /// Up to `count` cluster connections of their own, each carrying one write and its
    /// `WAIT` at a time, opened when first needed.
    pub(crate) fn leased(client: ClusterClient, count: usize) -> Self {
        AckLanes::Leased(Box::new(Leased {
            client,
            idle: Mutex::new(Vec::with_capacity(count)),
            free: Semaphore::new(count.max(1)),
        }))
    }

    /// Runs `script` on `keys` and waits until `replicas` replicas have it (for at most
    /// `timeout_ms`); answers the script's value and how many did. `replicas` and
    /// `timeout_ms` are the lanes' own when grouped.
    pub(crate) async fn run_acknowledged(
        &self,
        script: &Script,
        keys: &[Vec<u8>],
        args: impl Fn(&mut Cmd),
        replicas: u32,
        timeout_ms: u64,
    ) -> RedisResult<(Value, i64)> {
        match self {
            AckLanes::Grouped(grouped) => grouped.run(script, keys, args).await,
            AckLanes::Leased(leased) => {
                let mut lane = leased.lease().await?;
                let answer = lane
                    .connection()
                    .run_acknowledged(script, keys, args, replicas, timeout_ms)
                    .await;
                match &answer {
                    Err(error) if lost_connection(error) => {
                        // Closed: the next write opens a fresh one.
                    }
                    _ => lane.give_back(),
                }
                answer
            }
        }
    }
}

/// A write waiting for a lane, and where its answer goes.
struct Write {
    command: Cmd,
    answer: oneshot::Sender<RedisResult<(Value, i64)>>,
}

pub(crate) struct Grouped {
    queue: mpsc::UnboundedSender<Write>,
}

impl Grouped {
    async fn run(
        &self,
        script: &Script,
        keys: &[Vec<u8>],
        args: impl Fn(&mut Cmd),
    ) -> RedisResult<(Value, i64)> {
        let (value, acknowledged) = self
            .send(script_command("EVALSHA", script.sha1(), keys, &args))
            .await?;
        let (value, acknowledged) = match &value {
            Value::ServerError(error) if error.kind() == Some(ServerErrorKind::NoScript) => {
                self.send(script_command("EVAL", script.source(), keys, &args))
                    .await?
            }
            _ => (value, acknowledged),
        };
        Ok((value.extract_error()?, acknowledged))
    }

    async fn send(&self, command: Cmd) -> RedisResult<(Value, i64)> {
        let (answer, answered) = oneshot::channel();
        let gone = || {
            RedisError::from((
                ErrorKind::Io,
                "the store's lanes for acknowledged writes have stopped",
            ))
        };
        self.queue
            .send(Write { command, answer })
            .map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }
}

/// One lane: takes every write queued (up to [`MAX_GROUP`]) when it is free, sends them
/// and one `WAIT` in one pipeline on its own connection, and hands each write its answer
/// and the `WAIT`'s count.
async fn lane(
    waiting: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Write>>>,
    client: redis::Client,
    config: ConnectionManagerConfig,
    replicas: u32,
    timeout_ms: u64,
) {
    let mut connection = None;
    let mut group = Vec::with_capacity(MAX_GROUP);
    loop {
        if waiting.lock().await.recv_many(&mut group, MAX_GROUP).await == 0 {
            return;
        }
        // Writes whose callers gave up (the operation timed out) are not sent.
        group.retain(|write: &Write| !write.answer.is_closed());
        if group.is_empty() {
            continue;
        }
        let answers = send_group(
            &mut connection,
            &client,
            &config,
            &mut group,
            replicas,
            timeout_ms,
        )
        .await;
        match answers {
            Ok((values, acknowledged)) => {
                for (write, value) in group.drain(..).zip(values) {
                    let _ = write.answer.send(Ok((value, acknowledged)));
                }
            }
            Err(error) => {
                if lost_connection(&error) {
                    connection = None;
                }
                for write in group.drain(..) {
                    let _ = write.answer.send(Err(error.clone()));
                }
            }
        }
    }
}

async fn send_group(
    connection: &mut Option<RedisConnection>,
    client: &redis::Client,
    config: &ConnectionManagerConfig,
    group: &mut [Write],
    replicas: u32,
    timeout_ms: u64,
) -> RedisResult<(Vec<Value>, i64)> {
    let open = match connection {
        Some(open) => open,
        None => connection.insert(RedisConnection::Server(
            client
                .get_connection_manager_with_config(config.clone())
                .await?,
        )),
    };
    let mut pipeline = redis::pipe();
    for write in group.iter_mut() {
        pipeline.add_command(std::mem::replace(&mut write.command, Cmd::new()));
    }
    pipeline.cmd("WAIT").arg(replicas).arg(timeout_ms);
    let mut values = open
        .req_packed_commands(&pipeline, 0, group.len() + 1)
        .await?;
    let unexpected = |what| RedisError::from((ErrorKind::UnexpectedReturnType, what));
    if values.len() != group.len() + 1 {
        return Err(unexpected(
            "a group of writes and WAIT did not answer one value each",
        ));
    }
    match values.pop().map(Value::extract_error).transpose()? {
        Some(Value::Int(acknowledged)) => Ok((values, acknowledged)),
        _ => Err(unexpected("WAIT did not answer an integer")),
    }
}

pub(crate) struct Leased {
    client: ClusterClient,
    idle: Mutex<Vec<RedisConnection>>,
    free: Semaphore,
}

impl Leased {
    /// A lane of its own: waits for one to be free, and opens its connection if it has
    /// none.
    async fn lease(&self) -> RedisResult<Lane<'_>> {
        let permit = self
            .free
            .acquire()
            .await
            .expect("the lanes' semaphore is never closed");
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .pop();
        let connection = match idle {
            Some(connection) => connection,
            None => RedisConnection::Cluster(self.client.get_async_connection().await?),
        };
        Ok(Lane {
            lanes: self,
            connection: Some(connection),
            _permit: permit,
        })
    }
}

/// A lane leased for one write; its connection goes back to the idle ones only when
/// [`give_back`](Self::give_back) says it is fit for the next write.
struct Lane<'a> {
    lanes: &'a Leased,
    connection: Option<RedisConnection>,
    _permit: SemaphorePermit<'a>,
}

impl Lane<'_> {
    fn connection(&self) -> &RedisConnection {
        self.connection
            .as_ref()
            .expect("a leased lane has its connection")
    }

    fn give_back(&mut self) {
        if let Some(connection) = self.connection.take() {
            self.lanes
                .idle
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(connection);
        }
    }
}
