//! The SQL stores against raw SQL: reserve + finalize through the store against the same
//! two statements issued raw through the same sqlx pool, and a replay against one raw
//! `SELECT`, on PostgreSQL, MariaDB/MySQL and SQLite. Also the purge-under-load scale test.
//!
//! The raw side issues the very statements the store sends, bound by the functions the
//! store's own reserve and finalize bind them with (`reserve_query`, `finalize_query`), so
//! that statement and parameters cannot drift apart; through the store's own pool.

use std::cell::Cell;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_core::{
    Binding, FencingToken, IdempotencyLayer, IdempotencyStore, Ownership, Purged, RecordId,
    RecordState, Reservation, StoredResponse, purge_all_expired,
};
use idempotency_store_sql::sqlx::{self, Row as _};
use idempotency_store_sql::{
    EncodedAnswer, MySqlStore, Operation, PoolSettings, PostgresStore, SqliteStore,
};
use tokio::runtime::Runtime;

use crate::harness::{Paired, median, paired, quantile};
use crate::report::{Row, Table, Verdict, micros, nanos};

/// The table every SQL benchmark uses (never the default one, which tests may use).
const TABLE: &str = "bench_idempotency";
/// The table of the HTTP benchmark servers.
const HTTP_TABLE: &str = "bench_idempotency_http";
/// The table of the purge test.
const PURGE_TABLE: &str = "bench_idempotency_purge";

const LEASE: Duration = Duration::from_secs(20);
const LIFETIME: Duration = Duration::from_secs(30 * 60);

/// How long the SQL benchmarks run.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Interleaved rounds per comparison.
    pub rounds: usize,
    /// Operations per round.
    pub iters: u64,
    /// Expired rows the purge test deletes.
    pub purge_rows: u64,
    /// Reservations timed with no purge running.
    pub purge_baseline: usize,
}

impl Settings {
    /// Under a minute for the three databases.
    pub fn quick() -> Self {
        Self {
            rounds: 9,
            iters: 50,
            purge_rows: 1_000_000,
            purge_baseline: 4_000,
        }
    }

    /// Seconds: every figure once, for `compare --smoke`, not for reading. The purge
    /// still has enough rows to outlast 100 reservations in a debug build.
    pub fn smoke() -> Self {
        Self {
            rounds: 1,
            iters: 10,
            purge_rows: 3_000,
            purge_baseline: 200,
        }
    }

    /// A few minutes.
    pub fn full() -> Self {
        Self {
            rounds: 21,
            iters: 100,
            purge_rows: 1_000_000,
            purge_baseline: 4_000,
        }
    }
}

/// The layer the `bench-server` binary runs for `--mode sqlite|postgres|mysql`.
pub async fn server_layer(mode: &str, url: Option<&str>) -> Result<IdempotencyLayer, String> {
    let settings = PoolSettings::default();
    let store: Arc<dyn IdempotencyStore> = match mode {
        "postgres" => Arc::new(
            PostgresStore::connect(url.ok_or("--database-url is required")?, &settings)
                .await
                .map_err(|e| e.to_string())?
                .with_table_name(HTTP_TABLE)
                .map_err(|e| e.to_string())?
                .migrate()
                .await
                .map_err(|e| e.to_string())?,
        ),
        "mysql" => Arc::new(
            MySqlStore::connect(url.ok_or("--database-url is required")?, &settings)
                .await
                .map_err(|e| e.to_string())?
                .with_table_name(HTTP_TABLE)
                .map_err(|e| e.to_string())?
                .migrate()
                .await
                .map_err(|e| e.to_string())?,
        ),
        "sqlite" => Arc::new(http_sqlite_store(url, "idempotency-bench").await?),
        other => return Err(format!("unknown SQL mode {other}")),
    };
    Ok(IdempotencyLayer::from_shared_store(store))
}

/// The SQLite store of the HTTP benchmarks, at `url` or in a file `<name>-<pid>.sqlite` of
/// the temporary directory, with its table migrated.
async fn http_sqlite_store(url: Option<&str>, name: &str) -> Result<SqliteStore, String> {
    let default = format!(
        "sqlite:{}",
        std::env::temp_dir()
            .join(format!("{name}-{}.sqlite", std::process::id()))
            .display()
    );
    SqliteStore::connect(url.unwrap_or(&default), &PoolSettings::default())
        .await
        .map_err(|e| e.to_string())?
        .with_table_name(HTTP_TABLE)
        .map_err(|e| e.to_string())?
        .migrate()
        .await
        .map_err(|e| e.to_string())
}

/// The binding every benchmark record carries.
fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: crate::app::PATH.to_owned(),
        body_sha256: [7; 32],
    }
}

/// The response every benchmark record stores.
fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from_static(crate::app::RESPONSE_BODY.as_bytes()),
        trailers: vec![],
    }
}

/// One database: the typed store, whose pool and statement builders the raw side uses.
enum Raw {
    Postgres(PostgresStore),
    MySql(MySqlStore),
    Sqlite(SqliteStore),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Db {
    name: &'static str,
    store: Arc<dyn IdempotencyStore>,
    raw: Raw,
}

impl Db {
    /// The raw reserve statement; returns whether it reserved the key.
    async fn raw_reserve(&self, key: &str, token: i64) -> Result<bool, BoxError> {
        let id = RecordId::new("", key);
        let b = binding();
        let token = FencingToken(token);
        Ok(match &self.raw {
            Raw::Postgres(store) => {
                let row = store
                    .reserve_query(&id, &b, token, LEASE, LIFETIME)
                    .fetch_optional(store.pool())
                    .await?;
                match row {
                    Some(row) => row.try_get::<bool, _>("reserved")?,
                    None => false,
                }
            }
            Raw::MySql(store) => {
                let query = store.reserve_query(&id, &b, token, LEASE, LIFETIME);
                if store.sql(Operation::Reserve).contains("RETURNING") {
                    // MariaDB: the row comes back, reserved if it carries our token (the
                    // fourth column; MariaDB sends no column names for RETURNING to a
                    // prepared statement).
                    query.fetch_one(store.pool()).await?.try_get::<i64, _>(3)? == token.0
                } else {
                    // MySQL 8: the outcome is in the OK packet.
                    let done = query.execute(store.pool()).await?;
                    done.rows_affected() == 1 && done.last_insert_id() == 1
                }
            }
            Raw::Sqlite(store) => {
                // The row comes back whatever happened; reserved if it carries our token.
                let row = store
                    .reserve_query(&id, &b, token, LEASE, LIFETIME)
                    .fetch_one(store.pool())
                    .await?;
                row.try_get::<i64, _>("fencing_token")? == token.0
            }
        })
    }

    /// The raw finalize statement; returns whether it matched the row.
    async fn raw_finalize(&self, key: &str, token: i64) -> Result<bool, BoxError> {
        let id = RecordId::new("", key);
        let answer = EncodedAnswer::new(&response());
        let token = FencingToken(token);
        Ok(match &self.raw {
            // It returns a row iff the token held (and announces the record to waiters).
            Raw::Postgres(store) => store
                .finalize_query(&id, token, &answer)
                .fetch_optional(store.pool())
                .await?
                .is_some(),
            Raw::MySql(store) => {
                store
                    .finalize_query(&id, token, &answer)
                    .execute(store.pool())
                    .await?
                    .rows_affected()
                    == 1
            }
            Raw::Sqlite(store) => {
                store
                    .finalize_query(&id, token, &answer)
                    .execute(store.pool())
                    .await?
                    .rows_affected()
                    == 1
            }
        })
    }

    /// The raw load `SELECT`; returns whether it found the row.
    async fn raw_load(&self, key: &str) -> Result<bool, BoxError> {
        Ok(match &self.raw {
            Raw::Postgres(store) => sqlx::query(store.sql(Operation::Load))
                .bind("")
                .bind(key)
                .fetch_optional(store.pool())
                .await?
                .is_some(),
            Raw::MySql(store) => sqlx::query(store.sql(Operation::Load))
                .bind("")
                .bind(key)
                .fetch_optional(store.pool())
                .await?
                .is_some(),
            Raw::Sqlite(store) => sqlx::query(store.sql(Operation::Load))
                .bind("")
                .bind(key)
                .fetch_optional(store.pool())
                .await?
                .is_some(),
        })
    }

    async fn store_reserve_finalize(&self, key: &str) -> Result<(), BoxError> {
        let id = RecordId::new("", key);
        let Reservation::Reserved(token) =
            self.store.reserve(&id, &binding(), LEASE, LIFETIME).await?
        else {
            return Err(format!("{key} was already reserved").into());
        };
        match self.store.finalize(&id, token, &response()).await? {
            Ownership::Held => Ok(()),
            Ownership::Lost => Err(format!("{key}: finalize lost the record").into()),
        }
    }

    async fn raw_reserve_finalize(&self, key: &str, token: i64) -> Result<(), BoxError> {
        if !self.raw_reserve(key, token).await? {
            return Err(format!("raw reserve of {key} did not reserve").into());
        }
        if !self.raw_finalize(key, token).await? {
            return Err(format!("raw finalize of {key} matched no row").into());
        }
        Ok(())
    }

    /// A replay as the layer does it: `reserve` finds the completed record.
    async fn store_replay(&self, key: &str) -> Result<(), BoxError> {
        let id = RecordId::new("", key);
        match self.store.reserve(&id, &binding(), LEASE, LIFETIME).await? {
            Reservation::Exists(record) if matches!(record.state, RecordState::Completed(_)) => {
                Ok(())
            }
            other => Err(format!("{key} did not replay: {other:?}").into()),
        }
    }

    async fn store_load(&self, key: &str) -> Result<(), BoxError> {
        match self.store.load(&RecordId::new("", key)).await? {
            Some(_) => Ok(()),
            None => Err(format!("{key} not found").into()),
        }
    }
}

async fn open(name: &'static str, url: &str) -> Result<Db, BoxError> {
    let settings = PoolSettings::default();
    let (store, raw): (Arc<dyn IdempotencyStore>, Raw) = match name {
        "PostgreSQL" => {
            let store = PostgresStore::connect(url, &settings)
                .await?
                .with_table_name(TABLE)?
                .migrate()
                .await?;
            sqlx::query(&format!("TRUNCATE \"{TABLE}\""))
                .execute(store.pool())
                .await?;
            (Arc::new(store.clone()), Raw::Postgres(store))
        }
        "MariaDB" => {
            let store = MySqlStore::connect(url, &settings)
                .await?
                .with_table_name(TABLE)?
                .migrate()
                .await?;
            sqlx::query(&format!("TRUNCATE TABLE `{TABLE}`"))
                .execute(store.pool())
                .await?;
            (Arc::new(store.clone()), Raw::MySql(store))
        }
        _ => {
            let store = SqliteStore::connect(url, &settings)
                .await?
                .with_table_name(TABLE)?
                .migrate()
                .await?;
            (Arc::new(store.clone()), Raw::Sqlite(store))
        }
    };
    Ok(Db { name, store, raw })
}

struct Timer<'a> {
    runtime: &'a Runtime,
    counter: Cell<u64>,
    prefix: String,
}

impl Timer<'_> {
    fn next_key(&self) -> (String, i64) {
        let n = self.counter.get();
        self.counter.set(n + 1);
        (format!("{}-{n}", self.prefix), 1_000_000 + n as i64)
    }

    /// Times `iters` runs of `op` on fresh keys; panics on the first failure, since a
    /// benchmark that silently measures errors measures nothing.
    fn time<F, Fut>(&self, iters: u64, op: F) -> Duration
    where
        F: Fn(String, i64) -> Fut,
        Fut: Future<Output = Result<(), BoxError>>,
    {
        self.runtime.block_on(async {
            let start = Instant::now();
            for _ in 0..iters {
                let (key, token) = self.next_key();
                if let Err(error) = op(key, token).await {
                    panic!("SQL benchmark operation failed: {error}");
                }
            }
            start.elapsed()
        })
    }

    /// Completed records to replay, made before timing.
    fn completed(&self, db: &Db, count: u64) -> Vec<String> {
        self.runtime.block_on(async {
            let mut keys = Vec::new();
            for _ in 0..count {
                let (key, _) = self.next_key();
                db.store_reserve_finalize(&key)
                    .await
                    .unwrap_or_else(|e| panic!("{}: cannot set up a record: {e}", db.name));
                keys.push(key);
            }
            keys
        })
    }

    fn time_over<F, Fut>(&self, keys: &[String], iters: u64, op: F) -> Duration
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = Result<(), BoxError>>,
    {
        self.runtime.block_on(async {
            let start = Instant::now();
            for i in 0..iters {
                let key = keys[(i as usize) % keys.len()].clone();
                if let Err(error) = op(key).await {
                    panic!("SQL benchmark operation failed: {error}");
                }
            }
            start.elapsed()
        })
    }
}

fn cost_row(name: String, result: Paired, baseline: &str, target: &str, limit: Option<f64>) -> Row {
    let cost = 1.0 / result.throughput_ratio;
    Row {
        name,
        measured: format!("{}/op", nanos(result.subject_ns)),
        baseline: format!("{}/op ({baseline})", nanos(result.baseline_ns)),
        ratio: format!(
            "{cost:.2}× the raw time (median round {:.2}, rounds {:.2}–{:.2})",
            1.0 / result.median_ratio,
            1.0 / result.ratio_range.1,
            1.0 / result.ratio_range.0
        ),
        target: target.to_owned(),
        verdict: limit.map_or(Verdict::Info, |limit| Verdict::from_bool(cost <= limit)),
    }
}

/// Runs the store-vs-raw comparisons on every database that answers and adds their rows.
pub fn run(
    settings: Settings,
    postgres_url: &str,
    mysql_url: &str,
    rows: &mut Vec<Row>,
    tables: &mut Vec<Table>,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let sqlite_path = std::env::temp_dir().join(format!(
        "idempotency-bench-sql-{}.sqlite",
        std::process::id()
    ));
    let sqlite_url = format!("sqlite:{}", sqlite_path.display());
    let mut detail = Table::new(
        "SQL stores: one operation at a time (fastest round of each side, per operation)",
        &[
            "database",
            "operation",
            "through the store",
            "raw through the same pool",
            "store / raw",
        ],
    );
    for (name, url) in [
        ("PostgreSQL", postgres_url),
        ("MariaDB", mysql_url),
        ("SQLite", sqlite_url.as_str()),
    ] {
        eprintln!("sql: {name}");
        let db = match runtime.block_on(open(name, url)) {
            Ok(db) => db,
            Err(error) => {
                rows.push(Row {
                    name: format!("{name}: store vs raw SQL"),
                    measured: format!("not reachable at {url}: {error}"),
                    baseline: String::new(),
                    ratio: String::new(),
                    target: String::new(),
                    verdict: Verdict::Skipped,
                });
                continue;
            }
        };
        let shared = Arc::new(db);
        let db = &*shared;
        let timer = Timer {
            runtime: &runtime,
            counter: Cell::new(0),
            prefix: format!("sql-{}-{}", std::process::id(), name),
        };
        let first = paired(
            settings.rounds,
            settings.iters,
            |n| {
                timer.time(n, |key, token| async move {
                    db.raw_reserve_finalize(&key, token).await
                })
            },
            |n| {
                timer.time(
                    n,
                    |key, _| async move { db.store_reserve_finalize(&key).await },
                )
            },
        );
        rows.push(cost_row(
            format!("{name}: reserve + finalize, store vs the same 2 statements raw"),
            first,
            "raw",
            "≤ 1.2× raw",
            Some(1.2),
        ));
        let keys = timer.completed(db, settings.iters.min(200));
        let load = paired(
            settings.rounds,
            settings.iters,
            |n| {
                timer.time_over(
                    &keys,
                    n,
                    |key| async move { db.raw_load(&key).await.map(drop) },
                )
            },
            |n| timer.time_over(&keys, n, |key| async move { db.store_load(&key).await }),
        );
        rows.push(cost_row(
            format!("{name}: load (replay read), store vs one raw SELECT"),
            load,
            "raw SELECT",
            "",
            None,
        ));
        let replay = paired(
            settings.rounds,
            settings.iters,
            |n| {
                timer.time_over(
                    &keys,
                    n,
                    |key| async move { db.raw_load(&key).await.map(drop) },
                )
            },
            |n| timer.time_over(&keys, n, |key| async move { db.store_replay(&key).await }),
        );
        rows.push(cost_row(
            format!(
                "{name}: replay as the layer does it (reserve finds the record) vs one raw SELECT"
            ),
            replay,
            "raw SELECT",
            "one round trip (≤ 1.2× one SELECT)",
            Some(1.2),
        ));
        // The function API over this store: a piece of work that is one raw `SELECT`
        // through the store's pool, run through `AtMostOnce` with a fresh key each time,
        // against the same work called directly.
        let once = idempotency_core::AtMostOnce::new(
            idempotency_core::IdempotencyLayer::from_shared_store(db.store.clone())
                .with_scope(idempotency_core::SingleScope),
        );
        let work = |db: Arc<Db>| async move {
            db.raw_load("the-work")
                .await
                .map(drop)
                .map_err(|error| idempotency_core::WorkError::Retryable(error.to_string()))
        };
        let function = paired(
            settings.rounds,
            settings.iters,
            |n| {
                timer.time(n, |_, _| {
                    let db = shared.clone();
                    async move { work(db).await.map_err(|error| format!("{error:?}").into()) }
                })
            },
            |n| {
                timer.time(n, |key, _| {
                    let (db, once) = (shared.clone(), &once);
                    async move {
                        once.run("", &key, &(), move || work(db))
                            .await
                            .map_err(|error| error.to_string().into())
                    }
                })
            },
        );
        rows.push(cost_row(
            format!(
                "{name}: `AtMostOnce::run` (first execution) of one `SELECT` vs the `SELECT` called directly"
            ),
            function,
            "direct call",
            "",
            None,
        ));
        for (op, result) in [
            ("reserve + finalize", first),
            ("load", load),
            ("replay (reserve on a completed key)", replay),
        ] {
            detail.push(vec![
                name.to_owned(),
                op.to_owned(),
                nanos(result.subject_ns),
                nanos(result.baseline_ns),
                format!("{:.2}×", 1.0 / result.throughput_ratio),
            ]);
        }
    }
    let _ = std::fs::remove_file(&sqlite_path);
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", sqlite_path.display()));
    }
    tables.push(detail);
}

fn p(latencies: &mut [f64], q: f64) -> f64 {
    latencies.sort_by(f64::total_cmp);
    quantile(latencies, q)
}

async fn reservation_latencies(
    store: &PostgresStore,
    prefix: &str,
    count: usize,
    stop: impl Fn() -> bool,
) -> Result<Vec<f64>, BoxError> {
    let mut latencies = Vec::with_capacity(count);
    let b = binding();
    for n in 0..count {
        if stop() {
            break;
        }
        let id = RecordId::new("", format!("{prefix}-{n}"));
        let start = Instant::now();
        let reservation = store.reserve(&id, &b, LEASE, LIFETIME).await?;
        latencies.push(start.elapsed().as_secs_f64() * 1e6);
        if !matches!(reservation, Reservation::Reserved(FencingToken(_))) {
            return Err(format!("{id} was not reserved").into());
        }
    }
    Ok(latencies)
}

async fn fill_expired(pool: &sqlx::PgPool, rows: u64) -> Result<f64, BoxError> {
    // Expired by the database clock, as the store reads it.
    const PG_NOW: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
    let filled = Instant::now();
    sqlx::query(&format!("TRUNCATE \"{PURGE_TABLE}\""))
        .execute(pool)
        .await?;
    sqlx::query(&format!(
        "INSERT INTO \"{PURGE_TABLE}\"
            (scope, idempotency_key, method, path, body_sha256, fencing_token,
             created_at_ms, expires_at_ms, lease_expires_at_ms,
             response_status, response_headers, response_body)
         SELECT '', 'expired-' || g, 'POST', '/orders', decode(repeat('07', 32), 'hex'), g,
                now_ms - 3600000, now_ms - 1000, now_ms - 3590000,
                201, convert_to('content-type:application/json\n', 'UTF8'),
                convert_to($2, 'UTF8')
         FROM generate_series(1, $1::bigint) AS g,
              (SELECT {PG_NOW} AS now_ms) AS clock"
    ))
    .bind(i64::try_from(rows)?)
    .bind(crate::app::RESPONSE_BODY)
    .execute(pool)
    .await?;
    sqlx::query(&format!("VACUUM ANALYZE \"{PURGE_TABLE}\""))
        .execute(pool)
        .await?;
    Ok(filled.elapsed().as_secs_f64())
}

struct Phase {
    batch: usize,
    wal_bytes: i64,
    quiet: Vec<f64>,
    busy: Vec<f64>,
    deleted: u64,
    purge_seconds: f64,
    fill_seconds: f64,
}

async fn purge_phase(
    store: &PostgresStore,
    settings: Settings,
    batch: usize,
    prefix: &str,
) -> Result<Phase, BoxError> {
    let fill_seconds = fill_expired(store.pool(), settings.purge_rows).await?;
    let quiet = reservation_latencies(
        store,
        &format!("{prefix}-quiet"),
        settings.purge_baseline,
        || false,
    )
    .await?;
    let wal = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint";
    let wal_before: i64 = sqlx::query_scalar(wal).fetch_one(store.pool()).await?;
    let purger = store.clone();
    let started = Instant::now();
    // The helper `spawn_purge_task` runs: batches, paced, until one comes back short.
    let purge = tokio::spawn(async move {
        let deleted = match purge_all_expired(&purger, batch).await? {
            Purged::Deleted(deleted) => deleted,
            _ => 0,
        };
        Ok::<_, idempotency_core::StoreError>((deleted, started.elapsed()))
    });
    let deadline = Instant::now() + Duration::from_secs(600);
    let busy = reservation_latencies(store, &format!("{prefix}-busy"), 1_000_000, || {
        purge.is_finished() || Instant::now() > deadline
    })
    .await?;
    let (deleted, took) = purge.await??;
    let wal_after: i64 = sqlx::query_scalar(wal).fetch_one(store.pool()).await?;
    if busy.len() < 100 {
        return Err(format!(
            "the purge finished after only {} reservations; nothing to compare",
            busy.len()
        )
        .into());
    }
    Ok(Phase {
        batch,
        wal_bytes: wal_after - wal_before,
        quiet,
        busy,
        deleted,
        purge_seconds: took.as_secs_f64(),
        fill_seconds,
    })
}

/// The p99 of each run of `window` consecutive reservations during the purge, as (median,
/// lowest, highest, how many windows). Over a purge of several minutes on a shared machine
/// the pooled p99 takes in whatever else the machine did meanwhile, while the quiet p99 is
/// one window of a second or two; the windows' median compares like with like.
fn window_p99s(busy: &[f64], window: usize) -> Option<(f64, f64, f64, usize)> {
    let mut p99s: Vec<f64> = busy
        .chunks_exact(window.max(100))
        .map(|chunk| p(&mut chunk.to_vec(), 0.99))
        .collect();
    let (&lowest, &highest) = (
        p99s.iter().min_by(|a, b| a.total_cmp(b))?,
        p99s.iter().max_by(|a, b| a.total_cmp(b))?,
    );
    Some((median(&mut p99s), lowest, highest, p99s.len()))
}

fn purge_row(name: String, mut phase: Phase, rows: u64, target: bool) -> Row {
    // Before the latencies are sorted: the windows are runs of reservations in time order.
    let windows = match window_p99s(&phase.busy, phase.quiet.len()) {
        Some((median, lowest, highest, count)) => format!(
            "; p99 per {} reservations: median {} over {count} such windows ({}–{}), {:.2}× the quiet p99",
            phase.quiet.len(),
            micros(median),
            micros(lowest),
            micros(highest),
            median / p(&mut phase.quiet.clone(), 0.99)
        ),
        None => String::new(),
    };
    let (quiet_p99, busy_p99) = (p(&mut phase.quiet, 0.99), p(&mut phase.busy, 0.99));
    let (quiet_p50, busy_p50) = (p(&mut phase.quiet, 0.5), p(&mut phase.busy, 0.5));
    let ratio = busy_p99 / quiet_p99;
    Row {
        name,
        measured: format!(
            "p99 {} (p50 {}) over {} reservations during the purge ({} rows deleted in {:.1} s in batches of {}, {:.0} MB of WAL written meanwhile; table filled in {:.1} s){windows}",
            micros(busy_p99),
            micros(busy_p50),
            phase.busy.len(),
            phase.deleted,
            phase.purge_seconds,
            phase.batch,
            phase.wal_bytes as f64 / 1e6,
            phase.fill_seconds
        ),
        baseline: format!(
            "p99 {} (p50 {}) over {} reservations just before, no purge",
            micros(quiet_p99),
            micros(quiet_p50),
            phase.quiet.len()
        ),
        ratio: format!("{ratio:.2}× p99"),
        target: if target { "≤ 2× p99" } else { "" }.to_owned(),
        verdict: if !target {
            Verdict::Info
        } else {
            Verdict::from_bool(ratio <= 2.0 && phase.deleted >= rows)
        },
    }
}

/// Reservation p99 on PostgreSQL while `settings.purge_rows` expired rows are purged by
/// `purge_all_expired` in batches of 100 (the batch of the config-built purge task and of
/// the docs), against the p99 with no purge running just before (same run, same table);
/// then, if `with_larger`, the same with batches of 1,000, to show what the batch size
/// changes (it doubles the time the benchmark takes).
pub fn purge_scale(postgres_url: &str, settings: Settings, with_larger: bool) -> Vec<Row> {
    let shipped = format!(
        "PostgreSQL: reservation p99 while {} expired rows are purged (`purge_all_expired`, batches of 100)",
        settings.purge_rows
    );
    let larger = "PostgreSQL: the same purge in batches of 1,000".to_owned();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let outcome: Result<Vec<Row>, BoxError> = runtime.block_on(async {
        let store = PostgresStore::connect(postgres_url, &PoolSettings::default())
            .await?
            .with_table_name(PURGE_TABLE)?
            .migrate()
            .await?;
        let prefix = format!("purge-{}", std::process::id());
        let first = purge_phase(&store, settings, 100, &format!("{prefix}-a")).await?;
        let mut rows = vec![purge_row(shipped.clone(), first, settings.purge_rows, true)];
        if with_larger {
            let second = purge_phase(&store, settings, 1_000, &format!("{prefix}-b")).await?;
            rows.push(purge_row(larger, second, settings.purge_rows, false));
        }
        sqlx::query(&format!("TRUNCATE \"{PURGE_TABLE}\""))
            .execute(store.pool())
            .await?;
        Ok(rows)
    });
    outcome.unwrap_or_else(|error| {
        vec![Row {
            name: shipped,
            measured: format!("failed: {error}"),
            baseline: String::new(),
            ratio: String::new(),
            target: String::new(),
            verdict: Verdict::Skipped,
        }]
    })
}

/// The baseline of `bench-server --mode sqlite-raw`: what the SQLite store does for a
/// keyed first execution, done by hand. Each keyed request issues the store's own reserve
/// `INSERT` and finalize `UPDATE`, bound by the store's own builders
/// (`SqliteStore::reserve_query`, `SqliteStore::finalize_query`)
/// on a file, table and pragmas set up by `SqliteStore::connect` exactly as for
/// `--mode sqlite` (WAL, sqlx's default `synchronous = FULL`: a committed finalize
/// survives a crash), but through ONE writer connection that every request shares,
/// behind a fair (first come, first served) async mutex. No fencing, leases, binding
/// checks or replays: the cost of the two statements alone.
/// (A pool of at most one connection, tried first, measured no faster: in one quick run
/// each at 16 connections the store did 2.9× the pool's throughput and 4.6× the
/// mutex's, both within that loaded machine's noise of each other.)
struct RawSqlite {
    connection: tokio::sync::Mutex<sqlx::SqliteConnection>,
    /// The store, for its statement builders only: every statement runs on `connection`.
    store: SqliteStore,
    tokens: std::sync::atomic::AtomicI64,
}

/// The app of `bench-server --mode sqlite-raw`, set up and ready to serve.
pub struct SqliteRawApp(Arc<RawSqlite>);

/// Sets up the app of `bench-server --mode sqlite-raw`: the file, table and pragmas as
/// `--mode sqlite` has them, and one writer connection.
pub async fn sqlite_raw_app(url: Option<&str>) -> Result<SqliteRawApp, String> {
    let store = http_sqlite_store(url, "idempotency-bench-raw").await?;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| i64::try_from(d.as_nanos() >> 8).unwrap_or(1));
    // One connection opened by the store's pool (so with its pragmas), taken out of it.
    let connection = store
        .pool()
        .acquire()
        .await
        .map_err(|e| e.to_string())?
        .detach();
    Ok(SqliteRawApp(Arc::new(RawSqlite {
        connection: tokio::sync::Mutex::new(connection),
        store,
        tokens: std::sync::atomic::AtomicI64::new(seed),
    })))
}

impl SqliteRawApp {
    /// Serves the benchmark app wrapped (as a whole, as the layer wraps it) in a
    /// middleware that runs the store's two statements around the handler for requests
    /// with an `Idempotency-Key`, through the one writer connection.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        let app = tower::Layer::layer(
            &axum::middleware::from_fn_with_state(self.0, raw_keyed),
            crate::app::bare(),
        );
        axum::serve(
            listener,
            axum::ServiceExt::<axum::extract::Request>::into_make_service(app),
        )
        .await
    }
}

async fn raw_keyed(
    axum::extract::State(raw): axum::extract::State<Arc<RawSqlite>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    use http_body_util::BodyExt as _;
    let failed = |what: &str, error: String| {
        (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("{what}: {error}"),
        )
            .into_response()
    };
    let Some(key) = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return next.run(request).await;
    };
    let token = raw
        .tokens
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = RecordId::new("", key.as_str());
    let b = Binding {
        method: request.method().as_str().to_owned(),
        path: request.uri().path().to_owned(),
        ..binding()
    };
    let reserved = raw
        .store
        .reserve_query(&id, &b, FencingToken(token), LEASE, LIFETIME)
        .fetch_one(&mut *raw.connection.lock().await)
        .await
        .and_then(|row| row.try_get::<i64, _>("fencing_token"));
    match reserved {
        Ok(t) if t == token => {}
        Ok(_) => return failed("reserve", format!("{key} was already reserved")),
        Err(error) => return failed("reserve", error.to_string()),
    }
    let (parts, body) = next.run(request).await.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => return failed("body", error.to_string()),
    };
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        // What the layer stores of this answer: its headers less the framing.
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| *name != http::header::CONTENT_LENGTH)
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    Bytes::copy_from_slice(value.as_bytes()),
                )
            })
            .collect(),
        body,
        trailers: vec![],
    };
    let answer = EncodedAnswer::new(&stored);
    let finalized = raw
        .store
        .finalize_query(&id, FencingToken(token), &answer)
        .execute(&mut *raw.connection.lock().await)
        .await;
    match finalized {
        Ok(done) if done.rows_affected() == 1 => {}
        Ok(_) => return failed("finalize", format!("{key}: no row matched")),
        Err(error) => return failed("finalize", error.to_string()),
    }
    axum::response::Response::from_parts(parts, axum::body::Body::from(stored.body))
}
