//! The connection a store runs on, and how a script is sent over it.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisError, RedisFuture, RedisResult, Value};

use crate::scripts::Script;

/// The connection a [`RedisStore`](crate::RedisStore) sends its scripts over: one
/// multiplexed connection to a single server that reconnects by itself, or a cluster
/// connection that routes each command to the primary of its key's slot, follows
/// `MOVED`/`ASK` redirections and reconnects to nodes by itself.
///
/// Cheap to clone (clones share the connection). It implements
/// [`redis::aio::ConnectionLike`], so your own commands can use it too.
#[derive(Clone)]
pub enum RedisConnection {
    /// A single server.
    Server(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConnection::Server(_) => "RedisConnection::Server",
            RedisConnection::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Server(connection) => connection.req_packed_command(cmd),
            RedisConnection::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Server(connection) => {
                connection.req_packed_commands(cmd, offset, count)
            }
            RedisConnection::Cluster(connection) => {
                connection.req_packed_commands(cmd, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Server(connection) => connection.get_db(),
            RedisConnection::Cluster(connection) => connection.get_db(),
        }
    }
}

pub(crate) fn lost_connection(error: &RedisError) -> bool {
    error.is_timeout() || error.is_io_error() || error.is_connection_dropped()
}

/// `verb` (`EVALSHA` or `EVAL`) with `script_ref` (the script's SHA-1 or its source),
/// `keys`, and the arguments `args` appends.
pub(crate) fn script_command(
    verb: &str,
    script_ref: &str,
    keys: &[Vec<u8>],
    args: impl Fn(&mut Cmd),
) -> Cmd {
    let mut cmd = redis::cmd(verb);
    cmd.arg(script_ref).arg(keys.len());
    for key in keys {
        cmd.arg(&key[..]);
    }
    args(&mut cmd);
    cmd
}

impl RedisConnection {
    /// Runs `script` on `keys` (the record's first, then any of its scope's accounting
    /// keys, all in one slot): `EVALSHA`, and after a server that does not know the
    /// script yet (first use, a restart, a failover) answers `NOSCRIPT`, `EVAL` with the
    /// whole source, which also caches it there. `args` appends the script's arguments to
    /// either command.
    pub(crate) async fn run(
        &self,
        script: &Script,
        keys: &[Vec<u8>],
        args: impl Fn(&mut Cmd),
    ) -> RedisResult<Value> {
        let command = |verb: &str, script_ref: &str| script_command(verb, script_ref, keys, &args);
        let mut connection = self.clone();
        match command("EVALSHA", script.sha1())
            .query_async(&mut connection)
            .await
        {
            Err(error)
                if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                command("EVAL", script.source())
                    .query_async(&mut connection)
                    .await
            }
            answer => answer,
        }
    }

    /// Runs `script` as [`run`](Self::run) does, followed on the same connection by
    /// `WAIT replicas timeout_ms`, pipelined so that both go to the node the script runs
    /// on (on a cluster, the primary of the keys' slot: `WAIT` names no key, so the
    /// pipeline is routed by the script's). Answers the script's value and how many
    /// replicas acknowledged every write this connection made up to then, the script's
    /// included.
    pub(crate) async fn run_acknowledged(
        &self,
        script: &Script,
        keys: &[Vec<u8>],
        args: impl Fn(&mut Cmd),
        replicas: u32,
        timeout_ms: u64,
    ) -> RedisResult<(Value, i64)> {
        let pipeline = |verb: &str, script_ref: &str| {
            let mut pipeline = redis::pipe();
            pipeline.add_command(script_command(verb, script_ref, keys, &args));
            pipeline.cmd("WAIT").arg(replicas).arg(timeout_ms);
            pipeline
        };
        let mut connection = self.clone();
        let mut answers = connection
            .req_packed_commands(&pipeline("EVALSHA", script.sha1()), 0, 2)
            .await?;
        if let Some(Value::ServerError(error)) = answers.first()
            && error.kind() == Some(redis::ServerErrorKind::NoScript)
        {
            answers = connection
                .req_packed_commands(&pipeline("EVAL", script.source()), 0, 2)
                .await?;
        }
        let [answer, acknowledged]: [Value; 2] = answers.try_into().map_err(|_| {
            redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "a script and WAIT did not answer two values",
            ))
        })?;
        let answer = answer.extract_error()?;
        match acknowledged.extract_error()? {
            Value::Int(count) => Ok((answer, count)),
            _ => Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "WAIT did not answer an integer",
            ))),
        }
    }
}
