//! The `nats-orders` consumer against a real NATS JetStream server and PostgreSQL: a
//! publisher that retries (every third order sent twice), three consumers on one durable
//! consumer, killed with SIGKILL at random instants and exiting on their own between a
//! commit and its ack (so that JetStream delivers again what was already applied). With
//! the layer every order is applied exactly once; the control run, the same consumers
//! without the layer, shows the duplicates it prevents.
//!
//! NATS is taken from `IDEMPOTENCY_TEST_NATS_URL` (default `nats://127.0.0.1:4222`, as
//! `scripts/services` starts it), PostgreSQL from `IDEMPOTENCY_TEST_POSTGRES_URL`. Under
//! `CI=true` an unreachable server fails the test.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use idempotency_store_sql::sqlx::{self, PgPool};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ORDERS: usize = 300;
const CONSUMERS: usize = 3;

fn nats_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

fn postgres_url() -> String {
    std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Both servers, or `None` (a skip) when one does not answer outside CI.
async fn servers() -> Option<(async_nats::Client, PgPool)> {
    let ci = std::env::var("CI").is_ok_and(|value| value == "true");
    let nats = async_nats::connect(nats_url()).await;
    let postgres = PgPool::connect(&postgres_url()).await;
    match (nats, postgres) {
        (Ok(nats), Ok(postgres)) => Some((nats, postgres)),
        (nats, postgres) => {
            let why = format!(
                "NATS: {:?}; PostgreSQL: {:?} (scripts/services starts both)",
                nats.err(),
                postgres.err()
            );
            assert!(!ci, "a server is unreachable under CI=true: {why}");
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// One run: its own stream, durable consumer and tables.
struct Run {
    stream: String,
    prefix: String,
    without_idempotency: bool,
}

impl Run {
    fn new(without_idempotency: bool) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Self {
            stream: format!("ORDERS_{}", &id[..12]),
            prefix: format!("nats_{}", &id[..12]),
            without_idempotency,
        }
    }

    fn consumer(&self) -> Child {
        let mut command = Command::new(env!("CARGO_BIN_EXE_nats-orders"));
        command
            .args(["--nats", &nats_url(), "--database", &postgres_url()])
            .args(["--stream", &self.stream, "--table-prefix", &self.prefix])
            .args(["--ack-wait", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Both runs' consumers die between a commit and its ack, now and then.
        command.args(["--crash-after-commit-percent", "4"]);
        if self.without_idempotency {
            command.arg("--without-idempotency");
        }
        command.spawn().expect("start nats-orders")
    }

    /// Publishes the orders (every third one twice, the retry with a later `sent_at`),
    /// runs the consumers with kills until JetStream has nothing left to deliver, and
    /// answers how many rows each order id got, how many messages were published, and
    /// how many deliveries JetStream made beyond one per message.
    async fn consume(
        &self,
        nats: &async_nats::Client,
        postgres: &PgPool,
        seed: u64,
    ) -> (HashMap<String, i64>, usize, u64) {
        let jetstream = jetstream::new(nats.clone());
        let mut random = StdRng::seed_from_u64(seed);
        let mut consumers: Vec<Child> = (0..CONSUMERS).map(|_| self.consumer()).collect();
        // The first consumer creates the stream, its durable consumer and the tables.
        let deadline = Instant::now() + Duration::from_secs(60);
        while jetstream.get_stream(&self.stream).await.is_err()
            || sqlx::query(&format!("SELECT 1 FROM {}_orders LIMIT 1", self.prefix))
                .execute(postgres)
                .await
                .is_err()
        {
            assert!(Instant::now() < deadline, "the consumers did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The publisher sends while the consumers run and are killed: 20 orders every
        // 100 ms.
        let publisher = {
            let jetstream = jetstream.clone();
            let subject = format!("{}.placed", self.stream);
            tokio::spawn(async move {
                let mut published = 0;
                for order in 0..ORDERS {
                    let copies = if order % 3 == 0 { 2 } else { 1 };
                    for copy in 0..copies {
                        let payload = serde_json::json!({
                            "order_id": format!("order-{order}"),
                            "item": format!("item-{}", order % 17),
                            "sent_at": copy,
                        });
                        jetstream
                            .publish(subject.clone(), payload.to_string().into())
                            .await
                            .expect("publish")
                            .await
                            .expect("JetStream acknowledges the publish");
                        published += 1;
                    }
                    if order % 20 == 19 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                published
            })
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut kills = 0;
        let delivered = loop {
            tokio::time::sleep(Duration::from_millis(200 + random.random_range(0..600))).await;
            for child in &mut consumers {
                if child.try_wait().expect("consumer status").is_some() {
                    *child = self.consumer();
                }
            }
            if kills < 8 || !publisher.is_finished() {
                let victim = random.random_range(0..CONSUMERS);
                consumers[victim].kill().expect("SIGKILL a consumer");
                consumers[victim].wait().expect("reap a consumer");
                consumers[victim] = self.consumer();
                kills += 1;
                continue;
            }
            let info = jetstream
                .get_stream(&self.stream)
                .await
                .expect("the stream")
                .get_consumer::<jetstream::consumer::pull::Config>("orders-writer")
                .await
                .expect("the durable consumer")
                .get_info()
                .await
                .expect("the consumer's state");
            if publisher.is_finished() && info.num_pending == 0 && info.num_ack_pending == 0 {
                break info.delivered.consumer_sequence;
            }
            assert!(
                Instant::now() < deadline,
                "JetStream still has {} to deliver and {} unacknowledged",
                info.num_pending,
                info.num_ack_pending
            );
        };
        for mut child in consumers {
            let _ = child.kill();
            let _ = child.wait();
        }
        let published = publisher.await.expect("the publisher");
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT order_id, COUNT(*) FROM {}_orders GROUP BY order_id",
            self.prefix
        ))
        .fetch_all(postgres)
        .await
        .expect("count the orders' rows");
        let redelivered = delivered - published as u64;
        (rows.into_iter().collect(), published, redelivered)
    }

    async fn clean_up(&self, nats: &async_nats::Client, postgres: &PgPool) {
        let _ = jetstream::new(nats.clone())
            .delete_stream(&self.stream)
            .await;
        for table in ["orders", "records"] {
            let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {}_{table}", self.prefix))
                .execute(postgres)
                .await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_is_applied_once_through_redeliveries_duplicates_and_kills() {
    let Some((nats, postgres)) = servers().await else {
        return;
    };
    let seed = std::env::var("NATS_ORDERS_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(7);

    let control = Run::new(true);
    let (control_rows, published, control_redelivered) =
        control.consume(&nats, &postgres, seed).await;
    control.clean_up(&nats, &postgres).await;
    let layered = Run::new(false);
    let (rows, _, redelivered) = layered.consume(&nats, &postgres, seed).await;
    let records: (i64,) =
        sqlx::query_as(&format!("SELECT COUNT(*) FROM {}_records", layered.prefix))
            .fetch_one(&postgres)
            .await
            .expect("count the records");
    // One commit per order: its row and its record were written by one transaction.
    let one_commit: (i64,) = sqlx::query_as(&format!(
        "SELECT COUNT(*) FROM {p}_orders o JOIN {p}_records r \
         ON r.scope = $1 AND r.idempotency_key = o.order_id WHERE o.xmin::text = r.xmin::text",
        p = layered.prefix
    ))
    .bind(&layered.stream)
    .fetch_one(&postgres)
    .await
    .expect("compare the rows' transactions");
    layered.clean_up(&nats, &postgres).await;

    let duplicates = |rows: &HashMap<String, i64>| rows.values().map(|n| n - 1).sum::<i64>();
    eprintln!(
        "nats-orders, seed {seed}: {ORDERS} orders, {published} messages published ({} publisher \
         duplicates), {CONSUMERS} consumers, 8 or more kills a run. Without the layer: {control_redelivered} redeliveries, {} \
         rows, {} duplicates. With it: {redelivered} redeliveries, {} rows, {} duplicates, {} \
         records.",
        published - ORDERS,
        control_rows.values().sum::<i64>(),
        duplicates(&control_rows),
        rows.values().sum::<i64>(),
        duplicates(&rows),
        records.0,
    );
    assert!(
        duplicates(&control_rows) > 0,
        "the control run applied no order twice: the test did not produce duplicates"
    );
    assert!(
        redelivered > 0,
        "JetStream delivered nothing twice to the layered consumers: the kills tested nothing"
    );
    assert_eq!(rows.len(), ORDERS, "every order is applied");
    for (order, count) in &rows {
        assert_eq!(*count, 1, "{order} was applied {count} times");
    }
    assert_eq!(records.0, ORDERS as i64, "one record per order");
    assert_eq!(
        one_commit.0, ORDERS as i64,
        "every order's row commits with its record, in one transaction"
    );
}
