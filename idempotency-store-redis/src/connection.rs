//! The connection a store runs on, and how a script is sent over it.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisFuture, RedisResult, Value};

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

impl RedisConnection {
    /// Runs `script` on the record at `key`: `EVALSHA`, and after a server that does not
    /// know the script yet (first use, a restart, a failover) answers `NOSCRIPT`, `EVAL`
    /// with the whole source, which also caches it there. `args` appends the script's
    /// arguments to either command.
    pub(crate) async fn run(
        &self,
        script: &Script,
        key: &[u8],
        args: impl Fn(&mut Cmd),
    ) -> RedisResult<Value> {
        let command = |verb: &str, script_ref: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(script_ref).arg(1).arg(key);
            args(&mut cmd);
            cmd
        };
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
}
