//! Crash tests with real processes: `mutation-server` processes share one database, as
//! replicas would (PostgreSQL, MariaDB), or one SQLite file, restarted; the process
//! running a keyed request is killed with SIGKILL at a chosen instant, and the retry goes
//! to another process.
//!
//! The server writes its side effect and its answer in one transaction (its `Tx`), so a kill at any instant leaves both or neither: the retry replays
//! or runs once. Every instant is tested on both paths: the key reserved in a commit of
//! its own first (`Reservations::Leased`: the retry takes the dead owner's lapsed reservation
//! over), and reserved in the side effect's own transaction (`OneCommitStore`, one commit
//! for the record, the side effect and the answer: a dead owner leaves no reservation,
//! and the retry runs at once). One test pins what is left for a handler that does not (its side effect
//! lives elsewhere): a kill between the side effect and the layer's finalize runs the
//! mutation again.
//!
//! PostgreSQL is taken from `IDEMPOTENCY_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), MariaDB from `IDEMPOTENCY_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`). Under `CI=true` an unreachable database
//! fails the tests.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotency_store_sql::sqlx::{self, AnyPool, Connection as _};

/// How the servers reserve a key: in a commit of its own before the handler runs (a
/// typed store), or in the transaction the side effect is written in (`OneCommitStore`,
/// `--commits one`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Commits {
    Two,
    One,
}

impl Commits {
    fn flag(self) -> &'static str {
        match self {
            Self::Two => "two",
            Self::One => "one",
        }
    }

    /// The outcome of a retry that runs the mutation after the owner was killed: a
    /// reservation committed on its own is taken over once its lease lapses; one that
    /// died with its transaction left nothing to take over.
    fn rerun_outcome(self) -> &'static str {
        match self {
            Self::Two => "took-over",
            Self::One => "executed",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Postgres,
    MariaDb,
    Sqlite,
}

impl Backend {
    /// The database URL; SQLite's is a file in `dir`.
    fn url(self, dir: &Path) -> String {
        let from_env = |variable: &str, default: &str| {
            std::env::var(variable).unwrap_or_else(|_| default.to_owned())
        };
        match self {
            Self::Postgres => from_env(
                "IDEMPOTENCY_TEST_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            Self::MariaDb => from_env(
                "IDEMPOTENCY_TEST_MYSQL_URL",
                "mysql://root@127.0.0.1:3306/test",
            ),
            Self::Sqlite => format!("sqlite://{}/crash.db?mode=rwc", dir.display()),
        }
    }
}

/// One database for a test: its URL, a pool of the test's own, and fresh tables.
struct Database {
    backend: Backend,
    commits: Commits,
    url: String,
    pool: AnyPool,
    table: String,
    /// Holds the SQLite file.
    _dir: tempfile::TempDir,
}

impl Database {
    /// `None` (skip) when the server is unreachable outside CI.
    async fn open(backend: Backend, commits: Commits) -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = backend.url(dir.path());
        sqlx::any::install_default_drivers();
        let options = sqlx::any::AnyPoolOptions::new().max_connections(2);
        // SQLite: connect once the server made the file (and set its journal mode).
        let connected = match backend {
            Backend::Sqlite => options.connect_lazy(&url),
            Backend::Postgres | Backend::MariaDb => options.connect(&url).await,
        };
        let pool = match connected {
            Ok(pool) => pool,
            Err(error) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("{backend:?} at {url} is unreachable under CI: {error}")
            }
            Err(error) => {
                eprintln!("skipping: {backend:?} at {url} is unreachable: {error}");
                return None;
            }
        };
        Some(Self {
            backend,
            commits,
            url,
            pool,
            table: format!("crash_{}", uuid::Uuid::new_v4().simple()),
            _dir: dir,
        })
    }

    async fn side_effects(&self, name: &str) -> i64 {
        // `name` is one of this file's constants.
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {}_side_effects WHERE name = '{name}'",
            self.table
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Waits until `name`'s side effect has committed.
    async fn wait_for_side_effect(&self, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.side_effects(name).await == 0 {
            assert!(Instant::now() < deadline, "the side effect never committed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the handler's transaction is open with its side effect written in it
    /// (PostgreSQL: a transaction holds a write lock on the side effects table; MariaDB:
    /// a locking read of that table meets an uncommitted row; SQLite: the database's
    /// write lock, taken when the transaction began). The record is written with the
    /// answer by `Tx::commit`, just before `COMMIT`.
    async fn transaction_is_open(&self) -> bool {
        let mut connection = self.pool.acquire().await.unwrap();
        match self.backend {
            Backend::Postgres => {
                let writers: i64 = sqlx::query_scalar(&format!(
                    "SELECT count(*) FROM pg_locks l JOIN pg_class c ON l.relation = c.oid \
                     WHERE c.relname = '{}_side_effects' AND l.mode = 'RowExclusiveLock'",
                    self.table
                ))
                .fetch_one(&mut *connection)
                .await
                .unwrap();
                writers > 0
            }
            Backend::MariaDb => {
                let mut tx = connection.begin().await.unwrap();
                let probe = sqlx::query(&format!(
                    "SELECT 1 FROM `{}_side_effects` FOR UPDATE NOWAIT",
                    self.table
                ))
                .fetch_all(&mut *tx)
                .await;
                tx.rollback().await.unwrap();
                probe.is_err()
            }
            Backend::Sqlite => {
                sqlx::query("PRAGMA busy_timeout = 0")
                    .execute(&mut *connection)
                    .await
                    .unwrap();
                let probe = sqlx::query("BEGIN IMMEDIATE")
                    .execute(&mut *connection)
                    .await;
                if probe.is_ok() {
                    sqlx::query("ROLLBACK")
                        .execute(&mut *connection)
                        .await
                        .unwrap();
                }
                probe.is_err()
            }
        }
    }

    /// Waits until the handler holds its transaction open with its side effect in it.
    async fn wait_until_in_transaction(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.transaction_is_open().await {
            assert!(
                Instant::now() < deadline,
                "the handler never held its transaction open"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn drop_tables(&self) {
        if self.backend == Backend::Sqlite {
            return; // the file goes with the temporary directory
        }
        for name in [self.table.clone(), format!("{}_side_effects", self.table)] {
            let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {name}"))
                .execute(&self.pool)
                .await;
        }
    }
}

/// A `mutation-server` child process, killed when dropped.
struct Replica {
    child: Child,
    base: String,
}

impl Replica {
    async fn start(database: &Database, lease_ms: u64) -> Self {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_mutation-server"))
            .args(["--database", &database.url])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--table", &database.table])
            .args(["--lease-ms", &lease_ms.to_string()])
            .args(["--commits", database.commits.flag()])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("mutation-server did not start");
        let replica = Replica {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while reqwest::get(format!("{}/health", replica.base))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "mutation-server did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        replica
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        // SIGKILL: no destructor, no graceful shutdown, no finalize, no commit.
        self.child.kill().expect("kill failed");
        self.child.wait().expect("wait failed");
    }

    fn post(&self, name: &str, key: &str) -> reqwest::RequestBuilder {
        reqwest::Client::new()
            .post(format!("{}/mutations/{name}", self.base))
            .header("idempotency-key", key)
            .timeout(Duration::from_secs(60))
            .body("{}")
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Two replicas on one database, or (SQLite) one process that is restarted after the
/// kill: `second` starts the process the retry goes to.
async fn first_and_second(database: &Database) -> (Replica, Option<Replica>) {
    let first = Replica::start(database, 1000).await;
    let second = match database.backend {
        Backend::Sqlite => None,
        Backend::Postgres | Backend::MariaDb => Some(Replica::start(database, 1000).await),
    };
    (first, second)
}

async fn after_the_kill(database: &Database, second: Option<Replica>) -> Replica {
    match second {
        Some(replica) => replica,
        None => Replica::start(database, 1000).await,
    }
}

/// The owner is killed before its side effect: the retry on the other replica waits for
/// the lease to lapse and takes over (one commit: the reservation died with the owner's
/// transaction, and the retry runs at once), and the mutation runs exactly once.
async fn killed_before_the_side_effect_the_retry_takes_over_and_runs_once(commits: Commits) {
    let Some(database) = Database::open(Backend::Postgres, commits).await else {
        return;
    };
    let mut a = Replica::start(&database, 1000).await;
    let b = Replica::start(&database, 1000).await;
    let key = uuid::Uuid::new_v4().to_string();

    let slow = a
        .post("create-order", &key)
        .header("x-sleep-before-ms", "5000")
        .send();
    let in_flight = tokio::spawn(slow);
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.kill();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the killed replica must not answer"
    );

    let retry = b.post("create-order", &key).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(
        retry.headers()["x-idempotency-outcome"],
        commits.rerun_outcome()
    );
    assert_eq!(database.side_effects("create-order").await, 1);

    let again = b.post("create-order", &key).send().await.unwrap();
    assert_eq!(again.headers()["x-idempotency-outcome"], "replayed");
    assert_eq!(database.side_effects("create-order").await, 1);
    database.drop_tables().await;
}

/// The owner finalized, then died: the retry on the other replica is a replay.
async fn killed_after_finalize_the_retry_on_the_other_replica_replays(commits: Commits) {
    let Some(database) = Database::open(Backend::Postgres, commits).await else {
        return;
    };
    let mut a = Replica::start(&database, 1000).await;
    let b = Replica::start(&database, 1000).await;
    let key = uuid::Uuid::new_v4().to_string();

    let first = a.post("pay-invoice", &key).send().await.unwrap();
    assert_eq!(first.status(), 201);
    let first_body = first.text().await.unwrap();
    a.kill();

    let retry = b.post("pay-invoice", &key).send().await.unwrap();
    assert_eq!(retry.headers()["x-idempotency-outcome"], "replayed");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.text().await.unwrap(),
        first_body,
        "replayed byte for byte"
    );
    assert_eq!(database.side_effects("pay-invoice").await, 1);
    database.drop_tables().await;
}

/// The window the layer alone leaves, closed (exactly once with the handler's own
/// transaction): the side effect and the record committed in one transaction, then the
/// owner died before it answered. The retry, on the other replica (or the restarted
/// process), is a replay of the answer the dead owner never sent, and the mutation ran
/// once. (Before the handler finalized in its transaction, this retry took over and ran
/// the mutation again: 2 rows.)
async fn killed_between_side_effect_and_answer_the_retry_replays(
    backend: Backend,
    commits: Commits,
) {
    let Some(database) = Database::open(backend, commits).await else {
        return;
    };
    let (mut a, b) = first_and_second(&database).await;
    let a_pid = a.pid();
    let key = uuid::Uuid::new_v4().to_string();

    let slow = a
        .post("ship-parcel", &key)
        .header("x-sleep-after-ms", "10000")
        .send();
    let in_flight = tokio::spawn(slow);
    database.wait_for_side_effect("ship-parcel").await;
    a.kill();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the killed process must not answer"
    );

    let b = after_the_kill(&database, b).await;
    let retry = b.post("ship-parcel", &key).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["x-idempotency-outcome"], "replayed");
    assert_eq!(
        retry.text().await.unwrap(),
        format!(r#"{{"mutation":"ship-parcel","pid":{a_pid}}}"#),
        "the answer the killed process stored in its transaction"
    );
    assert_eq!(
        database.side_effects("ship-parcel").await,
        1,
        "committed with its record: the retry does not run it again"
    );
    database.drop_tables().await;
}

/// The owner is killed while its transaction is open, with the side effect written in it
/// and not committed (the record is written with it by the commit): nothing is left, and the retry takes
/// the lapsed reservation over and runs the mutation once.
async fn killed_inside_the_transaction_the_retry_takes_over_and_runs_once(
    backend: Backend,
    commits: Commits,
) {
    let Some(database) = Database::open(backend, commits).await else {
        return;
    };
    let (mut a, b) = first_and_second(&database).await;
    let key = uuid::Uuid::new_v4().to_string();

    let slow = a
        .post("cancel-order", &key)
        .header("x-sleep-in-transaction-ms", "10000")
        .send();
    let in_flight = tokio::spawn(slow);
    database.wait_until_in_transaction().await;
    // SQLite's write lock is taken at BEGIN IMMEDIATE: give the handler time to write.
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill();
    assert!(in_flight.await.unwrap().is_err());
    assert_eq!(
        database.side_effects("cancel-order").await,
        0,
        "the side effect rolled back with the process"
    );

    let b = after_the_kill(&database, b).await;
    let retry = b.post("cancel-order", &key).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(
        retry.headers()["x-idempotency-outcome"],
        commits.rerun_outcome()
    );
    assert_eq!(database.side_effects("cancel-order").await, 1);
    let again = b.post("cancel-order", &key).send().await.unwrap();
    assert_eq!(again.headers()["x-idempotency-outcome"], "replayed");
    assert_eq!(database.side_effects("cancel-order").await, 1);
    database.drop_tables().await;
}

/// What is left for a handler that does not record its answer in its transaction (its
/// side effect lives elsewhere, or it does not commit through its `Tx`): the side effect committed,
/// then the owner died before the layer could finalize. The layer alone cannot know the
/// mutation happened; after the lease lapses the retry takes over and runs it again.
/// This pins that behaviour, as the README's Guarantees state it.
async fn a_handler_that_leaves_the_finalize_to_the_layer_still_runs_again(commits: Commits) {
    let Some(database) = Database::open(Backend::Postgres, commits).await else {
        return;
    };
    let mut a = Replica::start(&database, 1000).await;
    let b = Replica::start(&database, 1000).await;
    let key = uuid::Uuid::new_v4().to_string();

    let slow = a
        .post("ship-parcel", &key)
        .header("x-finalize-by-layer", "true")
        .header("x-sleep-after-ms", "5000")
        .send();
    let in_flight = tokio::spawn(slow);
    database.wait_for_side_effect("ship-parcel").await;
    a.kill();
    assert!(in_flight.await.unwrap().is_err());

    let retry = b.post("ship-parcel", &key).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(
        retry.headers()["x-idempotency-outcome"],
        commits.rerun_outcome()
    );
    assert_eq!(
        database.side_effects("ship-parcel").await,
        2,
        "the window a handler closes only by finalizing in its transaction"
    );
    database.drop_tables().await;
}

// Each instant on both paths: two commits (leased reservations) and one (the default).

macro_rules! on_both_paths {
    ($($test:ident => $run:expr;)*) => {
        mod two_commits {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $test() {
                    let run = $run;
                    run(Commits::Two).await;
                }
            )*
        }
        mod one_commit {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $test() {
                    let run = $run;
                    run(Commits::One).await;
                }
            )*
        }
    };
}

on_both_paths! {
    killed_before_the_side_effect_the_retry_runs_once =>
        super::killed_before_the_side_effect_the_retry_takes_over_and_runs_once;
    killed_after_finalize_the_retry_on_the_other_replica_replays =>
        super::killed_after_finalize_the_retry_on_the_other_replica_replays;
    killed_between_side_effect_and_answer_on_postgres =>
        |c| killed_between_side_effect_and_answer_the_retry_replays(Backend::Postgres, c);
    killed_between_side_effect_and_answer_on_mariadb =>
        |c| killed_between_side_effect_and_answer_the_retry_replays(Backend::MariaDb, c);
    killed_between_side_effect_and_answer_on_sqlite_after_a_restart =>
        |c| killed_between_side_effect_and_answer_the_retry_replays(Backend::Sqlite, c);
    killed_inside_the_transaction_on_postgres =>
        |c| killed_inside_the_transaction_the_retry_takes_over_and_runs_once(Backend::Postgres, c);
    killed_inside_the_transaction_on_mariadb =>
        |c| killed_inside_the_transaction_the_retry_takes_over_and_runs_once(Backend::MariaDb, c);
    killed_inside_the_transaction_on_sqlite =>
        |c| killed_inside_the_transaction_the_retry_takes_over_and_runs_once(Backend::Sqlite, c);
    a_handler_that_leaves_the_finalize_to_the_layer_still_runs_again =>
        super::a_handler_that_leaves_the_finalize_to_the_layer_still_runs_again;
}
