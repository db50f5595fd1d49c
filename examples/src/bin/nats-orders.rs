//! A NATS JetStream consumer that applies each order message at most once: the order's
//! row and the message's idempotency record commit in one PostgreSQL transaction, so a
//! redelivered message (the consumer died between its commit and its ack) and a message
//! the publisher sent twice are applied once and acknowledged again.
//!
//! ```text
//! scripts/services        # PostgreSQL and NATS with JetStream, on loopback
//! cargo run -p examples --bin nats-orders -- --database postgres://postgres@127.0.0.1:5432/test
//! cargo run -p examples --bin nats-orders -- --database … --publish 10   # send 10 orders
//! ```
//!
//! Each message is JSON: `{"order_id": "…", "item": "…", "sent_at": …}`. `order_id` is the
//! key (a publisher that retries sends the same one), the rest but `sent_at` its
//! fingerprint, the stream its scope. Several consumers may share the durable consumer:
//! a duplicate delivered to another one while the first still runs waits for it, then
//! gets its result.
//!
//! Why NATS JetStream for the example: Debian ships its server as one static binary
//! (`nats-server`, started by `scripts/services` in milliseconds, with no runtime of its
//! own to install), and JetStream has what a consumer must get right: explicit acks,
//! redelivery after an ack wait, and several consumers sharing one durable consumer.
//! Its own de-duplication (`Nats-Msg-Id`) covers a publisher's retries within a window,
//! not a redelivery after a consumer died between its write and its ack: the layer
//! covers both.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use clap::Parser;
use futures_util::StreamExt;
use idempotency_core::{AtMostOnce, IdempotencyLayer, RunError, WorkError};
use idempotency_store_sql::{OneCommitStore, PostgresStore, TableName, Tx, Writes};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres};

#[derive(Parser, Debug)]
#[command(about = "Applies order messages from NATS JetStream to PostgreSQL, each at most once")]
struct Args {
    /// The NATS server, with JetStream enabled.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// The PostgreSQL database the orders and their records go to.
    #[arg(long, env = "DATABASE_URL")]
    database: String,
    /// The stream (created if missing, on the subject `<stream>.placed`).
    #[arg(long, default_value = "ORDERS")]
    stream: String,
    /// The durable pull consumer every replica shares (created if missing).
    #[arg(long, default_value = "orders-writer")]
    consumer: String,
    /// Tables: `<prefix>_orders` (the effects) and `<prefix>_records` (the records).
    #[arg(long, default_value = "nats")]
    table_prefix: String,
    /// How long JetStream waits for an ack before it delivers the message again.
    #[arg(long, default_value = "5", value_name = "SECONDS")]
    ack_wait: u64,
    /// Apply messages without the layer: every delivery writes a row (to show what the
    /// layer prevents).
    #[arg(long)]
    without_idempotency: bool,
    /// Publish this many orders (each once, with ids `<stream>-0`, `<stream>-1`, …) to
    /// the stream, and exit.
    #[arg(long, value_name = "ORDERS")]
    publish: Option<u64>,
    /// Test hook: exit at once, without acking, after this percentage of commits.
    #[cfg(feature = "test-hooks")]
    #[arg(long, default_value = "0")]
    crash_after_commit_percent: u32,
}

/// An order message as the publisher sends it.
#[derive(Deserialize)]
struct OrderMessage {
    order_id: String,
    item: String,
}

/// The result of applying an order, stored with its record and replayed to duplicates.
#[derive(Serialize, Deserialize)]
struct Applied {
    row: i64,
}

type Failure = String;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args = Args::parse();
    let pool = PgPool::connect(&args.database).await?;
    let orders_table = format!("{}_orders", args.table_prefix);
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS {orders_table} \
         (row_id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, item TEXT NOT NULL)"
    ))
    .execute(&pool)
    .await?;
    let records_table = TableName::new(format!("{}_records", args.table_prefix))?;
    let records = PostgresStore::new(pool.clone())
        .with_table_name(records_table.as_str())?
        .migrate()
        .await?;
    let store =
        Arc::new(OneCommitStore::new(Arc::new(records), pool.clone(), &records_table).await?);
    let writes = Writes::with_records(store.clone());
    let layer = IdempotencyLayer::from_shared_store(store);
    let once_lifetime = layer.lifetime();
    let once = AtMostOnce::new(layer);

    let jetstream = jetstream::new(async_nats::connect(&args.nats).await?);
    let stream = jetstream
        .get_or_create_stream(stream::Config {
            name: args.stream.clone(),
            subjects: vec![format!("{}.placed", args.stream)],
            // No message outlives its key: a delivery after the key expired would be
            // applied again.
            max_age: once_lifetime,
            ..Default::default()
        })
        .await?;
    if let Some(orders) = args.publish {
        for order in 0..orders {
            let payload = serde_json::json!({
                "order_id": format!("{}-{order}", args.stream),
                "item": format!("item-{}", order % 17),
                "sent_at": order,
            });
            let subject = format!("{}.placed", args.stream);
            jetstream
                .publish(subject, payload.to_string().into())
                .await?
                .await?;
        }
        return Ok(());
    }
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            &args.consumer,
            pull::Config {
                durable_name: Some(args.consumer.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(args.ack_wait),
                ..Default::default()
            },
        )
        .await?;
    let mut messages = consumer.messages().await?;
    eprintln!(
        "nats-orders: consuming {} as {}",
        args.stream, args.consumer
    );
    while let Some(message) = messages.next().await {
        let message = message?;
        let Ok(order) = serde_json::from_slice::<OrderMessage>(&message.payload) else {
            eprintln!("nats-orders: a message that is not an order; terminated");
            message.ack_with(AckKind::Term).await?;
            continue;
        };
        let applied = if args.without_idempotency {
            insert(&pool, &orders_table, &order)
                .await
                .map_err(|e| e.to_string())
        } else {
            apply_once(&once, &writes, &args.stream, &orders_table, order).await
        };
        match applied {
            Ok(()) => {
                #[cfg(feature = "test-hooks")]
                crash_sometimes(args.crash_after_commit_percent);
                message.ack().await?;
            }
            // Nothing committed, or the key is held: JetStream delivers it again.
            Err(why) => {
                eprintln!("nats-orders: {why}; delivered again later");
                message
                    .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                    .await?;
            }
        }
    }
    Ok(())
}

/// Applies `order` once per (stream, order id): the first delivery inserts the row and
/// commits it with the record; every later one gets the stored result.
async fn apply_once(
    once: &AtMostOnce,
    writes: &Writes<Postgres>,
    scope: &str,
    orders_table: &str,
    order: OrderMessage,
) -> Result<(), Failure> {
    // What the key is bound to: the order, not when it was sent.
    let fingerprint = serde_json::json!({ "order_id": order.order_id, "item": order.item });
    let writes = writes.clone();
    let orders_table = orders_table.to_owned();
    let key = order.order_id.clone();
    let run = once.run_with_reservation(scope, &key, &fingerprint, move |reservation| async move {
        let retryable = |error: &dyn std::fmt::Display| WorkError::Retryable(error.to_string());
        let mut tx = Tx::begin(&writes, reservation.handle())
            .await
            .map_err(|e| retryable(&e))?;
        let (row,): (i64,) = sqlx::query_as(&format!(
            "INSERT INTO {orders_table} (order_id, item) VALUES ($1, $2) RETURNING row_id"
        ))
        .bind(&order.order_id)
        .bind(&order.item)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| retryable(&e))?;
        let applied = Applied { row };
        let answer = reservation.answer(&applied).map_err(|e| retryable(&e))?;
        match tx.commit(answer).await {
            Ok(_) => Ok(applied),
            Err(error) if error.outcome_unknown() => {
                Err(WorkError::OutcomeUnknown(error.to_string()))
            }
            Err(error) => Err(retryable(&error)),
        }
    });
    match run.await {
        Ok(Applied { .. }) => Ok(()),
        // Another order under this order id: applying it would lose one of the two.
        Err(RunError::KeyReused) => {
            eprintln!("nats-orders: order id {key} was used for another order; not applied");
            Ok(())
        }
        Err(error) => Err(error.to_string()),
    }
}

async fn insert(
    pool: &PgPool,
    orders_table: &str,
    order: &OrderMessage,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO {orders_table} (order_id, item) VALUES ($1, $2)"
    ))
    .bind(&order.order_id)
    .bind(&order.item)
    .execute(pool)
    .await
    .map(drop)
}

/// Exits at once, as a killed consumer would, after `percent` of its commits.
#[cfg(feature = "test-hooks")]
fn crash_sometimes(percent: u32) {
    if percent > 0 && uuid::Uuid::new_v4().as_u128() % 100 < u128::from(percent) {
        eprintln!("nats-orders: exiting between the commit and the ack (test hook)");
        std::process::exit(101);
    }
}
