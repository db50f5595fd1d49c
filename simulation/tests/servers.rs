//! The simulation on the real servers: SQLite, PostgreSQL, MariaDB and Redis, each as a
//! store of its own and, for the SQL databases, the one-commit store whose reservations
//! live in the handler's transaction (with what it holds per request watched from the
//! database's side). Real time on several threads: the seed fixes the workload and the
//! faults, the servers the schedule. Under `CI=true` an unreachable server fails.

#[path = "../../test-support/innodb.rs"]
mod innodb;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use idempotency_core::ReservationHandle;
use idempotency_core::conformance::Leftovers;
use idempotency_core::{FullStore, async_trait};
use idempotency_store_redis::{RedisOptions, RedisStore};
use idempotency_store_sql::sqlx::{self, Executor};
use idempotency_store_sql::{CommitError, Transactions, Tx, TxError, Writes};
use idempotency_store_sql::{
    MySqlStore, OneCommitStore, PoolSettings, PostgresStore, RecordDatabase, Reservations,
    SqliteStore, TableName,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use simulation::proxy::{CommitProxy, Cut, Wire};
use simulation::{Change, Effects, KeyOf, OwnFaults, Settings, Target, seeds, simulate};

const POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/test";
const MYSQL: &str = "mysql://root@127.0.0.1:3306/test";
const REDIS: &str = "redis://127.0.0.1:6379";

/// Seeds per store in the default sweep: the servers run in real time, about 5 s a seed.
const RUNS: u64 = 3;

fn settings() -> Settings {
    Settings {
        // A database's clock and its round trips against the simulation's clock.
        clock_tolerance: Duration::from_millis(50),
        ..Settings::quick()
    }
}

fn url(env: &str, default: &str) -> String {
    std::env::var(env).unwrap_or_else(|_| default.to_owned())
}

/// Under `CI=true` an unreachable server fails the test; elsewhere it is skipped.
fn unreachable(what: &str, error: impl std::fmt::Display) {
    let message = format!("{what} is unreachable ({error}); run scripts/services");
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{message} (CI=true: an unreachable server fails the run)");
    }
    eprintln!("SKIPPED: {message}");
}

/// Some `COMMIT` answers were lost, some connections cut, and the server restarted.
fn assert_lost_commits(proxy: &CommitProxy) {
    assert!(proxy.lost() > 0, "no COMMIT answer was lost");
    assert_cut(proxy);
}

/// Some connections were cut, and the server restarted.
fn assert_cut(proxy: &CommitProxy) {
    assert!(proxy.cuts() > 0, "no connection was cut before a statement");
    assert!(
        proxy.cuts_during() > 0,
        "no connection was cut while its statement ran"
    );
    assert!(proxy.restarts() > 0, "the server was never restarted");
}

/// The faults of a [`CommitProxy`]: it loses the answer to the first `COMMIT` of a run
/// and to a seeded share of the others, cuts the connections of the first two statements
/// (one before the server sees it, one while it runs) and of a seeded share of the others,
/// and restarts the server once, at a seeded instant of the run for a seeded while, until
/// the run is quiet.
struct ProxyFaults(Arc<CommitProxy>);

impl OwnFaults for ProxyFaults {
    fn start(&self, seed: u64, dropped: Arc<dyn Fn() + Send + Sync>) {
        let proxy = &self.0;
        proxy.on_dropped_connections(Some(dropped));
        proxy.lose_next_commit_answer();
        proxy.lose_commit_answers(LOST_COMMITS, seed);
        proxy.cut_next_statement(Cut::Before);
        proxy.cut_next_statement(Cut::During);
        proxy.cut_connections(CUT_CONNECTIONS, seed.rotate_left(32));
        let mut rng = StdRng::seed_from_u64(seed.rotate_left(16));
        let at = Duration::from_millis(rng.random_range(200..1_000));
        let down_for = Duration::from_millis(rng.random_range(50..400));
        let proxy = proxy.clone();
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            proxy.restart(down_for);
        });
    }

    fn stop(&self) {
        self.0.stop_losing();
        self.0.on_dropped_connections(None);
    }
}

fn proxy_faults(proxy: Arc<CommitProxy>) -> Arc<dyn OwnFaults> {
    Arc::new(ProxyFaults(proxy))
}

/// What share of the handlers' `COMMIT`s lose their answer (through a [`CommitProxy`]).
const LOST_COMMITS: f64 = 0.1;

/// What share of the statements sent through a [`CommitProxy`] find their connection
/// cut (half before the server sees them, half while it runs them).
const CUT_CONNECTIONS: f64 = 0.02;

/// A proxy in front of the server of `url` (see [`ProxyFaults`]), and `url` pointed at
/// it.
async fn through_proxy(url: &str, wire: Wire) -> (Arc<CommitProxy>, String) {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (user, rest) = rest.split_once('@').unwrap_or(("", rest));
    let (server, path) = rest.split_once('/').unwrap_or((rest, ""));
    let upstream = tokio::net::lookup_host(server)
        .await
        .expect("the server's address")
        .next()
        .expect("an address");
    let proxy = Arc::new(CommitProxy::start(wire, upstream).await);
    let at = if user.is_empty() {
        String::new()
    } else {
        format!("{user}@")
    };
    let proxied = format!("{scheme}://{at}127.0.0.1:{}/{path}", proxy.port());
    (proxy, proxied)
}

fn namespace() -> String {
    format!("sim-{}-", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

fn table() -> String {
    format!(
        "idem_sim_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Runs the seeds on `target`; the histories as text.
async fn sweep(name: &str, target: Target) -> Vec<String> {
    let settings = settings();
    let seeds = seeds(RUNS);
    eprintln!("{name}: seeds {seeds:?}");
    let mut histories = Vec::new();
    for seed in seeds {
        let run = simulate(&target, &settings, seed).await;
        run.assert_passed(name);
        histories.push(run.history.render(None));
    }
    histories
}

fn store_target(store: Arc<dyn FullStore>) -> Target {
    Target {
        store: store.clone(),
        purge: Some(store),
        leftovers: None,
        namespace: namespace(),
        effects: None,
        own_faults: None,
        reservations_unseen: false,
    }
}

async fn sqlite_store(dir: &std::path::Path) -> SqliteStore {
    let url = format!("sqlite://{}/sim.db?mode=rwc", dir.display());
    SqliteStore::connect(&url, &PoolSettings::default())
        .await
        .expect("SQLite opens")
        .migrate()
        .await
        .expect("migrate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    let dir = std::env::temp_dir().join(namespace());
    std::fs::create_dir_all(&dir).unwrap();
    sweep("SQLite", store_target(Arc::new(sqlite_store(&dir).await))).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A PostgreSQL store at `url` on a table of its own; `None` (after
/// [`unreachable`]) when the server does not answer.
async fn postgres_store(url: &str) -> Option<PostgresStore> {
    match PostgresStore::connect(url, &PoolSettings::default()).await {
        Ok(store) => {
            let store = store.with_table_name(&table()).unwrap().migrate().await;
            Some(store.unwrap())
        }
        Err(error) => {
            unreachable("PostgreSQL", error);
            None
        }
    }
}

/// The same on MariaDB.
async fn mysql_store(url: &str) -> Option<MySqlStore> {
    match MySqlStore::connect(url, &PoolSettings::default()).await {
        Ok(store) => {
            let store = store.with_table_name(&table()).unwrap().migrate().await;
            Some(store.unwrap())
        }
        Err(error) => {
            unreachable("MariaDB", error);
            None
        }
    }
}

/// A typed store's own connections through a proxy (see [`ProxyFaults`]): its
/// statements run in autocommit, so what it meets is cut connections and a restart.
async fn typed_store_through_proxy<S: FullStore>(
    name: &str,
    connect: impl AsyncFnOnce(&str) -> Option<S>,
    wire: Wire,
    url: &str,
) {
    let (proxy, proxied) = through_proxy(url, wire).await;
    let Some(store) = connect(&proxied).await else {
        return;
    };
    let mut target = store_target(Arc::new(store));
    target.own_faults = Some(proxy_faults(proxy.clone()));
    sweep(name, target).await;
    assert_cut(&proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    let url = url("IDEMPOTENCY_TEST_POSTGRES_URL", POSTGRES);
    typed_store_through_proxy("PostgreSQL", postgres_store, Wire::Postgres, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb() {
    let url = url("IDEMPOTENCY_TEST_MYSQL_URL", MYSQL);
    typed_store_through_proxy("MariaDB", mysql_store, Wire::MySql, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    let options = RedisOptions::server(url("IDEMPOTENCY_TEST_REDIS_URL", REDIS))
        .key_prefix(format!("{}:", namespace()))
        .unwrap();
    let store = match RedisStore::connect_with(options).await {
        Ok(store) => store,
        Err(error) => return unreachable("Redis", error),
    };
    sweep("Redis", store_target(Arc::new(store))).await;
}

/// What the handlers' pool of a one-commit store holds: connections checked out, and
/// (PostgreSQL, MariaDB) its connections in an open transaction, seen by the server.
struct HandlerPool<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    /// A connection of its own that asks the server.
    observer: Option<Arc<dyn Fn() -> OpenTransactions + Send + Sync>>,
}

type OpenTransactions = std::pin::Pin<Box<dyn Future<Output = i64> + Send>>;

#[async_trait]
impl<DB: sqlx::Database> Leftovers for HandlerPool<DB> {
    async fn held(&self) -> Vec<String> {
        let mut held = Vec::new();
        let in_use = self.pool.size() as usize - self.pool.num_idle();
        if in_use > 0 {
            held.push(format!(
                "{in_use} of the handlers' pooled connections in use"
            ));
        }
        if let Some(observer) = &self.observer {
            let open = observer().await;
            if open > 0 {
                held.push(format!(
                    "{open} of the handlers' connections in an open transaction"
                ));
            }
        }
        held
    }
}

/// The handler's change, a row of `table` naming its execution, written through `Tx`
/// on a one-commit store: the change, the record and the answer commit once.
macro_rules! tx_effects {
    ($name:ident, $database:ty, insert: $insert:literal, select: $select:literal) => {
        struct $name<T> {
            transactions: T,
            pool: sqlx::Pool<$database>,
            table: String,
            records_with_changes: bool,
        }

        #[async_trait]
        impl<T: Transactions<Database = $database>> Effects for $name<T> {
            async fn write(
                &self,
                reservation: Option<ReservationHandle>,
                exec: u64,
                key: &KeyOf,
                answer: Response<Full<Bytes>>,
            ) -> (Response<Full<Bytes>>, Change) {
                let mut tx = match Tx::begin(&self.transactions, reservation.as_ref()).await {
                    Ok(tx) => tx,
                    Err(error) => return (unavailable(error), Change::NotCommitted),
                };
                let written = sqlx::query(&format!($insert, self.table))
                    .bind(exec as i64)
                    .bind(key.scope.as_str())
                    .bind(key.key.as_str())
                    .execute(&mut *tx)
                    .await;
                if let Err(error) = written {
                    return (unavailable(error), Change::NotCommitted);
                }
                match tx.commit(answer).await {
                    Ok(answer) => (answer, Change::Committed),
                    Err(
                        error @ (TxError::Unknown(_)
                        | TxError::NotCommitted(CommitError::Unknown(_))),
                    ) => (error.into_response(), Change::Unknown),
                    Err(error) => (error.into_response(), Change::NotCommitted),
                }
            }

            async fn in_database(&self, namespace: &str) -> Vec<u64> {
                sqlx::query_scalar::<_, i64>(&format!($select, self.table))
                    .bind(format!("{namespace}%"))
                    .fetch_all(&self.pool)
                    .await
                    .expect("the effects table")
                    .into_iter()
                    .map(|exec| exec as u64)
                    .collect()
            }

            fn records_commit_with_changes(&self) -> bool {
                self.records_with_changes
            }
        }

        impl<T: Transactions<Database = $database>> $name<T> {
            /// Changes written in a table of their own on `pool`, in `transactions`.
            async fn with_table(transactions: T, pool: sqlx::Pool<$database>) -> Arc<dyn Effects> {
                let table = format!("{}_effects", table());
                sqlx::query(&format!(
                    "CREATE TABLE {table} (exec BIGINT NOT NULL, scope VARCHAR(200) NOT NULL, \
                     idem_key VARCHAR(200) NOT NULL)"
                ))
                .execute(&pool)
                .await
                .expect("the effects table");
                let records_with_changes = transactions.records_in_transaction();
                Arc::new(Self {
                    transactions,
                    pool,
                    table,
                    records_with_changes,
                })
            }
        }
    };
}

tx_effects!(PostgresEffects, sqlx::Postgres,
    insert: "INSERT INTO {} (exec, scope, idem_key) VALUES ($1, $2, $3)",
    select: "SELECT exec FROM {} WHERE scope LIKE $1");
tx_effects!(MySqlEffects, sqlx::MySql,
    insert: "INSERT INTO {} (exec, scope, idem_key) VALUES (?, ?, ?)",
    select: "SELECT exec FROM {} WHERE scope LIKE ?");
tx_effects!(SqliteEffects, sqlx::Sqlite,
    insert: "INSERT INTO {} (exec, scope, idem_key) VALUES (?, ?, ?)",
    select: "SELECT exec FROM {} WHERE scope LIKE ?");

fn unavailable(error: impl std::fmt::Display) -> Response<Full<Bytes>> {
    let mut answer = Response::new(Full::new(Bytes::from(error.to_string())));
    *answer.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
    answer
}

/// Sweeps a one-commit store on `pool` (the handlers' pool) over `records` in `table`,
/// its reservations as `reservations` says, whose handler writes its change through `Tx`
/// (`effects`, made for the store).
async fn one_commit<DB: RecordDatabase>(
    name: &str,
    (records, table, reservations): (Arc<dyn FullStore>, &TableName, Reservations),
    pool: sqlx::Pool<DB>,
    observer: Option<Arc<dyn Fn() -> OpenTransactions + Send + Sync>>,
    effects: impl AsyncFnOnce(Writes<DB>, sqlx::Pool<DB>) -> Arc<dyn Effects>,
    proxy: Option<Arc<CommitProxy>>,
) {
    let store = Arc::new(
        OneCommitStore::new(records.clone(), pool.clone(), table)
            .await
            .expect("the one-commit store")
            .with_reservations(reservations),
    );
    let target = Target {
        store: store.clone(),
        purge: Some(records),
        leftovers: Some(Arc::new(HandlerPool {
            pool: pool.clone(),
            observer,
        })),
        namespace: namespace(),
        effects: Some(effects(Writes::with_records(store), pool).await),
        own_faults: proxy.clone().map(proxy_faults),
        reservations_unseen: reservations == Reservations::Uncommitted,
    };
    let histories = sweep(name, target).await;
    assert!(
        histories
            .iter()
            .any(|history| history.contains("its change committed")),
        "{name}: no handler committed its change through Tx"
    );
    if let Some(proxy) = proxy {
        assert_lost_commits(&proxy);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_sqlite() {
    let dir = std::env::temp_dir().join(namespace());
    std::fs::create_dir_all(&dir).unwrap();
    let records = sqlite_store(&dir).await;
    let table = records.table_name().clone();
    let pool = records.pool().clone();
    one_commit(
        "the one-commit store on SQLite, writing through Tx",
        (Arc::new(records), &table, Reservations::Uncommitted),
        pool,
        None,
        SqliteEffects::with_table,
        None,
    )
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_postgres() {
    through_tx_on_postgres(
        "the one-commit store on PostgreSQL, writing through Tx",
        Reservations::Uncommitted,
    )
    .await;
}

/// Leased reservations: the reservation committed first, the handler's `Tx` writing its
/// change and answer in a second commit, whose answer the proxy loses at times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_postgres() {
    through_tx_on_postgres(
        "leased reservations on PostgreSQL, writing through Tx",
        Reservations::Leased,
    )
    .await;
}

async fn through_tx_on_postgres(name: &str, reservations: Reservations) {
    let url = url("IDEMPOTENCY_TEST_POSTGRES_URL", POSTGRES);
    let Some(records) = postgres_store(&url).await else {
        return;
    };
    let table = records.table_name().clone();
    // The handlers' pool, its connections named so that the server can tell them apart.
    let marker = format!("handlers_{}", table.as_str());
    // Through a proxy that loses the answer to some of their COMMITs.
    let (proxy, proxied) = through_proxy(&url, Wire::Postgres).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&format!("{proxied}?application_name={marker}"))
        .await
        .unwrap();
    let observer = records.pool().clone();
    let open: Arc<dyn Fn() -> OpenTransactions + Send + Sync> = Arc::new(move || {
        let (observer, marker) = (observer.clone(), marker.clone());
        Box::pin(async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = $1 AND xact_start IS NOT NULL",
            )
            .bind(marker)
            .fetch_one(&observer)
            .await
            .expect("pg_stat_activity")
        })
    });
    one_commit(
        name,
        (Arc::new(records), &table, reservations),
        pool,
        Some(open),
        PostgresEffects::with_table,
        Some(proxy),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_mariadb() {
    let url = url("IDEMPOTENCY_TEST_MYSQL_URL", MYSQL);
    let Some(records) = mysql_store(&url).await else {
        return;
    };
    let table = records.table_name().clone();
    // The handlers' pool, its connections' ids noted so that the server's transaction
    // list can be read for them alone.
    let (proxy, proxied) = through_proxy(&url, Wire::MySql).await;
    let ids = Arc::new(Mutex::new(Vec::<i64>::new()));
    let noted = ids.clone();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .after_connect(move |connection, _| {
            let noted = noted.clone();
            Box::pin(async move {
                let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
                    .fetch_one(&mut *connection)
                    .await?;
                noted.lock().unwrap().push(id);
                Ok(())
            })
        })
        .connect(&proxied)
        .await
        .unwrap();
    let observer = records.pool().clone();
    let open: Arc<dyn Fn() -> OpenTransactions + Send + Sync> = Arc::new(move || {
        let (observer, ids) = (observer.clone(), ids.lock().unwrap().clone());
        Box::pin(async move {
            if ids.is_empty() {
                return 0;
            }
            let status = observer
                .fetch_one(innodb::STATUS)
                .await
                .expect("the InnoDB status");
            innodb::active_transactions(&sqlx::Row::get::<String, _>(&status, 2), &ids) as i64
        })
    });
    one_commit(
        "the one-commit store on MariaDB, writing through Tx",
        (Arc::new(records), &table, Reservations::Uncommitted),
        pool,
        Some(open),
        MySqlEffects::with_table,
        Some(proxy),
    )
    .await;
}

/// Records in Redis, the handler's change in PostgreSQL through `Tx` on
/// `Writes::records_elsewhere`: the layer records the answer after the handler committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_in_redis_changes_in_postgres() {
    let options = RedisOptions::server(url("IDEMPOTENCY_TEST_REDIS_URL", REDIS))
        .key_prefix(format!("{}:", namespace()))
        .unwrap();
    let records = match RedisStore::connect_with(options).await {
        Ok(store) => Arc::new(store),
        Err(error) => return unreachable("Redis", error),
    };
    let (proxy, proxied) = through_proxy(
        &url("IDEMPOTENCY_TEST_POSTGRES_URL", POSTGRES),
        Wire::Postgres,
    )
    .await;
    let pool = match sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&proxied)
        .await
    {
        Ok(pool) => pool,
        Err(error) => return unreachable("PostgreSQL", error),
    };
    let effects =
        PostgresEffects::with_table(Writes::records_elsewhere(pool.clone()), pool.clone()).await;
    let target = Target {
        store: records.clone(),
        purge: Some(records),
        leftovers: Some(Arc::new(HandlerPool {
            pool,
            observer: None,
        })),
        namespace: namespace(),
        effects: Some(effects),
        own_faults: Some(proxy_faults(proxy.clone())),
        reservations_unseen: false,
    };
    let histories = sweep("records in Redis, changes in PostgreSQL", target).await;
    assert!(
        histories
            .iter()
            .any(|history| history.contains("its change committed")),
        "no handler committed its change through Tx"
    );
    assert_lost_commits(&proxy);
}
