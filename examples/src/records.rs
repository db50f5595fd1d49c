//! `--idempotency-store URL`: the idempotency records in Redis or Valkey instead of the
//! service's SQL database.
//!
//! Both example servers keep their own state in SQL (`--database`) and, by default, their
//! idempotency records in a table of that database. With this flag the records go to
//! Redis (one server, `redis://host:port[/db]`, or a cluster,
//! `redis+cluster://host:port,host:port`), where they expire by themselves: no purge task
//! is needed. Replicas then share the Redis server as well as the database. The URL's
//! query sets the store's other options (`?replica-acks=1&replica-ack-timeout=250ms`,
//! `key-prefix`, timeouts…: `RedisOptions::from_url` lists them), read by the store's
//! own parser, so a flag means what the store URL means everywhere else.

use idempotency_store_redis::{RedisOptions, RedisStore};

/// Connects to the Redis store `url` names, as `--idempotency-store` gives it. Errors
/// name the flag and say what to write instead (a URL that is not Redis, a parameter it
/// does not know or cannot use, a server that does not answer, an evicting
/// `maxmemory-policy`).
pub async fn connect_redis(
    url: &str,
) -> Result<RedisStore, Box<dyn std::error::Error + Send + Sync>> {
    let options = RedisOptions::from_url(url).map_err(|error| {
        format!(
            "--idempotency-store: {error}; or leave it out to keep the records in \
             --database"
        )
    })?;
    let store = RedisStore::connect_with(options)
        .await
        .map_err(|error| format!("--idempotency-store: {error}"))?;
    Ok(store)
}
