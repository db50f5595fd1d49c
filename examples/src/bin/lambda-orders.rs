//! An AWS Lambda function (`lambda_runtime`) that places each order at most once, with
//! the key read from the event's payload, as AWS Lambda Powertools' idempotency utility
//! does with `event_key_jmespath`: here a JSON Pointer, `/order_id`. The fingerprint is
//! the order without its send time, so a client's retry with a later `sent_at` is the
//! same request, and another order under the same id is refused.
//!
//! Every instance of the function shares the records in PostgreSQL (`DATABASE_URL`): a
//! retry that another instance receives is answered with the first result, and a
//! duplicate that arrives while the first still runs waits for it.
//!
//! ```text
//! DATABASE_URL=postgres://… cargo lambda deploy     # or any way you ship a Lambda
//! ```
//!
//! Tested (`examples/tests/lambda_orders.rs`) by running this binary under
//! `lambda_runtime` against a Runtime API served by the test on loopback, as the
//! runtime's own tests do; not against AWS.

use std::sync::Arc;

use idempotency_core::{AtMostOnce, IdempotencyLayer, RunError, WorkError};
use idempotency_store_sql::{OneCommitStore, PostgresStore, TableName, Tx, Writes};
use lambda_runtime::{Error, LambdaEvent, service_fn};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::{PgPool, Postgres};

/// Where the key and the fingerprint are in the event.
const KEY: &str = "/order_id";
const FINGERPRINT: [&str; 2] = ["/order_id", "/item"];

/// What the function answers, stored with the key and replayed to retries.
#[derive(Serialize, Deserialize)]
struct Placed {
    order_id: String,
    row: i64,
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let database = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let prefix = std::env::var("TABLE_PREFIX").unwrap_or_else(|_| "lambda".to_owned());
    let pool = PgPool::connect(&database).await?;
    let orders = format!("{prefix}_orders");
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS {orders} \
         (row_id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, item TEXT NOT NULL)"
    ))
    .execute(&pool)
    .await?;
    // The order's row and its record commit together (the store's one-commit path).
    let records_table = TableName::new(format!("{prefix}_records"))?;
    let records = PostgresStore::new(pool.clone())
        .with_table_name(records_table.as_str())?
        .migrate()
        .await?;
    let store = Arc::new(OneCommitStore::new(Arc::new(records), pool, &records_table).await?);
    let writes = Writes::with_records(store.clone());
    let once = AtMostOnce::new(IdempotencyLayer::from_shared_store(store));
    let orders = Arc::new(orders);
    lambda_runtime::run(service_fn(move |event: LambdaEvent<Value>| {
        place(once.clone(), writes.clone(), orders.clone(), event.payload)
    }))
    .await
}

async fn place(
    once: AtMostOnce,
    writes: Writes<Postgres>,
    orders: Arc<String>,
    event: Value,
) -> Result<Value, Error> {
    let Some(Value::String(key)) = event.pointer(KEY) else {
        return Err(format!("the event has no string at {KEY}: it cannot be placed once").into());
    };
    let fingerprint: Vec<Option<&Value>> = FINGERPRINT.iter().map(|at| event.pointer(at)).collect();
    let item = event
        .pointer("/item")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let order_id = key.clone();
    let placed = once
        .run_with_reservation("orders", key, &fingerprint, move |reservation| async move {
            let failed = |error: &dyn std::fmt::Display| WorkError::Retryable(error.to_string());
            let mut tx = Tx::begin(&writes, reservation.handle())
                .await
                .map_err(|e| failed(&e))?;
            let (row,): (i64,) = sqlx::query_as(&format!(
                "INSERT INTO {orders} (order_id, item) VALUES ($1, $2) RETURNING row_id"
            ))
            .bind(&order_id)
            .bind(&item)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| failed(&e))?;
            let placed = Placed { order_id, row };
            let answer = reservation.answer(&placed).map_err(|e| failed(&e))?;
            match tx.commit(answer).await {
                Ok(_) => Ok(placed),
                Err(error) if error.outcome_unknown() => {
                    Err(WorkError::OutcomeUnknown(error.to_string()))
                }
                Err(error) => Err(failed(&error)),
            }
        })
        .await;
    match placed {
        Ok(placed) => Ok(serde_json::to_value(placed)?),
        Err(RunError::KeyReused) => {
            Err(format!("order id {key} was already used for another order").into())
        }
        Err(error) => Err(error.to_string().into()),
    }
}
