//! Failover: PostgreSQL with a streaming standby. The test makes two clusters
//! of its own on free loopback ports from the installed binaries (`initdb` with
//! `wal_level=replica`, trust for 127.0.0.1 including replication, `pg_basebackup -R`
//! for the standby), runs keyed load through the layer from two service instances over
//! `PostgresStore`, kills the primary (SIGKILL, its postmaster and every backend, as a
//! machine dies), promotes the standby with `pg_ctl promote`, and switches the address
//! the services use to it.
//!
//! The services reach the database through a TCP proxy in the test, switched to the new
//! primary as a virtual IP, a DNS name or HAProxy/PgBouncer would be: sqlx 0.8 takes one
//! host per URL and has no `target_session_attrs`, so a multi-host connection string is
//! not an option for it.
//!
//! The client and the counts are those of the Redis failover test: each key sent until it
//! gets an answer, as the Iceberg Java client sends it (the same key, up to six attempts,
//! after `Retry-After` on 503, 409 and 429); the first answer of every fourth key lost on
//! its way back; after the run every answered key sent once more, which must be a
//! replay; executions counted by the handler, outside the database.
//!
//! Two disruptions: the plain kill, and the kill of a primary whose standby lags (the
//! primary's WAL sender stopped with SIGSTOP 200 ms before, so that what the primary
//! committed in those 200 ms never left it).
//!
//! - `asynchronous_standby_reports_what_a_failover_loses`: streaming replication as it
//!   comes (asynchronous); the counts are printed, not asserted.
//! - `a_synchronous_standby_loses_nothing_in_a_failover`: `synchronous_standby_names =
//!   '*'` and `synchronous_commit = on`; no mutation may run twice and no answer may be
//!   lost. Also prints what the synchronous standby costs per keyed request.
//!
//! ```text
//! cargo test -p idempotency-store-sql --features postgres --test failover -- --nocapture --test-threads 1
//! ```
//!
//! The PostgreSQL binaries are found in the newest `/usr/lib/postgresql/*/bin`, or in
//! `IDEMPOTENCY_TEST_PG_BIN`. Without them the tests are skipped with a notice, except
//! under `CI=true`, where that is a failure. As root, the servers run as the `postgres`
//! user (PostgreSQL refuses root).
#![cfg(feature = "postgres")]

#[path = "../../test-support/keyed_load.rs"]
mod keyed_load;
#[path = "../../test-support/postgres_pair.rs"]
mod postgres_pair;

use std::net::SocketAddr;
use std::path::Path as FsPath;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use idempotency_store_sql::{PoolSettings, PostgresStore};
use tokio::net::{TcpListener, TcpStream};

use keyed_load::{Executions, Seen, app, send, send_to, send_until_answered};
use postgres_pair::{Pair, children_of, postgres_bin, signal, streaming};

// ---- the proxy the services connect through ----------------------------------------------

/// A TCP proxy whose upstream the test switches, as a virtual IP moves; a switch also
/// cuts every connection made before it.
struct Proxy {
    port: u16,
    upstream: Arc<Mutex<(SocketAddr, u64)>>,
}

impl Proxy {
    async fn start(upstream: u16) -> (Self, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Mutex::new((
            SocketAddr::from(([127, 0, 0, 1], upstream)),
            0u64,
        )));
        let target = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                let (address, generation) = *target.lock().unwrap();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(address).await else {
                        return;
                    };
                    let switched = async {
                        loop {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            if target.lock().unwrap().1 != generation {
                                return;
                            }
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        () = switched => {}
                    }
                });
            }
        });
        (
            Self {
                port,
                upstream: shared,
            },
            task,
        )
    }

    fn switch_to(&self, port: u16) {
        let mut upstream = self.upstream.lock().unwrap();
        *upstream = (SocketAddr::from(([127, 0, 0, 1], port)), upstream.1 + 1);
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

// ---- the service and its clients -------------------------------------------------------

#[derive(Debug)]
struct Counts {
    keys: usize,
    executed_twice: usize,
    answers_lost: usize,
    failed_for_good: usize,
    refused: usize,
    attempts: usize,
    promoted_after: Duration,
    last_failure_after_kill: Option<Duration>,
}

/// How the services record their keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// `PostgresStore` under the layer; the handler counts its executions in memory.
    Layer,
    /// `OneCommitStore` on the typed store's `PgPool`, the handler writing its side effect
    /// through `Tx`: executions are the side effect's rows, read on the new primary.
    #[cfg(feature = "any")]
    OneCommit,
}

/// Keyed load from 24 clients over two service instances through a failover, then every
/// answered key once more; counts.
async fn run(bin: &FsPath, synchronous: bool, lagging: bool) -> Counts {
    run_on(bin, synchronous, lagging, Path::Layer).await
}

async fn run_on(bin: &FsPath, synchronous: bool, lagging: bool, path: Path) -> Counts {
    let pair = Pair::start(bin, synchronous);
    let admin = sqlx::PgPool::connect(&pair.primary.url()).await.unwrap();
    let wal_sender = streaming(&admin, synchronous).await;
    admin.close().await;
    let (proxy, proxy_task) = Proxy::start(pair.primary.port).await;
    let settings = PoolSettings::default()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(1));
    let executions = Executions::default();
    let mut apps = Vec::new();
    for _ in 0..2 {
        let store = PostgresStore::connect(&proxy.url(), &settings)
            .await
            .unwrap()
            .migrate()
            .await
            .unwrap();
        apps.push(match path {
            Path::Layer => app(store, executions.clone()),
            #[cfg(feature = "any")]
            Path::OneCommit => one_commit::app(store).await,
        });
    }
    let apps: Arc<[Router; 2]> = Arc::new(apps.try_into().ok().unwrap());
    let seen = Arc::new(Seen::default());
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..24 {
        let (apps, seen, stop, next) = (apps.clone(), seen.clone(), stop.clone(), next.clone());
        clients.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n = next.fetch_add(1, Ordering::Relaxed);
                send_until_answered(&apps, n, &seen).await;
            }
        });
    }
    // The failover blocks this worker thread (the clients run on the others); the
    // servers stay owned by this frame, so a panic anywhere kills them.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (killed_at, promoted_after) = tokio::task::block_in_place(|| {
        if lagging {
            // Only the primary's own WAL sender (a process id can be reused).
            let postmaster = pair.primary.postmaster().expect("the primary's postmaster");
            assert!(
                children_of(postmaster).contains(&wal_sender),
                "the WAL sender {wal_sender} is no longer the primary's"
            );
            signal("STOP", &[wal_sender]);
            std::thread::sleep(Duration::from_millis(200));
        }
        pair.primary.kill();
        let killed_at = Instant::now();
        pair.standby.promote();
        proxy.switch_to(pair.standby.port);
        (killed_at, killed_at.elapsed())
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(client) = clients.join_next().await {
        client.expect("a client panicked");
    }

    let answered = seen.answered.lock().unwrap().clone();
    let mut answers_lost = 0;
    for name in &answered {
        let mut answer = send(&apps[1], name).await;
        for _ in 0..20 {
            if answer.status.is_success() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            answer = send(&apps[0], name).await;
        }
        assert!(
            answer.status.is_success(),
            "{name} answers {}",
            answer.status
        );
        if !answer.replayed {
            answers_lost += 1;
        }
    }
    let executed_twice = match path {
        Path::Layer => executions
            .0
            .lock()
            .unwrap()
            .values()
            .filter(|n| **n > 1)
            .count(),
        #[cfg(feature = "any")]
        Path::OneCommit => one_commit::executed_twice(&pair.standby.url()).await,
    };
    let last_failure = *seen.last_failure.lock().unwrap();
    drop(apps);
    proxy_task.abort();
    drop(pair);
    Counts {
        keys: next.load(Ordering::Relaxed),
        executed_twice,
        answers_lost,
        failed_for_good: seen.gave_up.load(Ordering::Relaxed),
        refused: seen.refused.load(Ordering::Relaxed),
        attempts: seen.attempts.load(Ordering::Relaxed),
        promoted_after,
        last_failure_after_kill: last_failure.and_then(|at| at.checked_duration_since(killed_at)),
    }
}

const HEADER: &str = "| PostgreSQL | disruption | keys | attempts | executed twice | answers lost | failed for good | 503/409 answers | promoted and switched after | last refusal after the kill |\n|---|---|---|---|---|---|---|---|---|---|";

fn report(configuration: &str, disruption: &str, counts: &Counts) {
    eprintln!(
        "| {configuration} | {disruption} | {} | {} | {} | {} | {} | {} | {:.1} s | {} |",
        counts.keys,
        counts.attempts,
        counts.executed_twice,
        counts.answers_lost,
        counts.failed_for_good,
        counts.refused,
        counts.promoted_after.as_secs_f64(),
        counts
            .last_failure_after_kill
            .map_or("none".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
    );
}

async fn bounded<T>(seconds: u64, test: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(seconds), test)
        .await
        .unwrap_or_else(|_| panic!("the test did not finish within {seconds} s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_standby_reports_what_a_failover_loses() {
    let Some(bin) = postgres_bin() else {
        return;
    };
    let started = Instant::now();
    bounded(150, async {
        eprintln!("{HEADER}");
        let plain = run(&bin, false, false).await;
        report("asynchronous standby (default)", "primary killed", &plain);
        let lagging = run(&bin, false, true).await;
        report(
            "asynchronous standby (default)",
            "primary killed, standby 200 ms behind",
            &lagging,
        );
        for counts in [&plain, &lagging] {
            assert!(counts.keys > 100, "the load did not run: {counts:?}");
        }
    })
    .await;
    eprintln!("took {:.0} s", started.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_loses_nothing_in_a_failover() {
    let Some(bin) = postgres_bin() else {
        return;
    };
    let started = Instant::now();
    bounded(150, async {
        cost_per_request(&bin).await;
        eprintln!("{HEADER}");
        synchronous_failovers_lose_nothing(&bin, Path::Layer, "synchronous standby").await;
    })
    .await;
    eprintln!("took {:.0} s", started.elapsed().as_secs_f64());
}

/// Both failovers (the plain kill, and the kill with the standby 200 ms behind) with a
/// synchronous standby, on `path`: reported, and nothing ran twice or was lost.
async fn synchronous_failovers_lose_nothing(bin: &FsPath, path: Path, configuration: &str) {
    let plain = run_on(bin, true, false, path).await;
    report(configuration, "primary killed", &plain);
    let lagging = run_on(bin, true, true, path).await;
    report(
        configuration,
        "primary killed, standby 200 ms behind",
        &lagging,
    );
    for counts in [&plain, &lagging] {
        assert!(counts.keys > 100, "the load did not run: {counts:?}");
        assert_eq!(
            counts.executed_twice, 0,
            "with a synchronous standby a mutation ran twice: {counts:?}"
        );
        assert_eq!(
            counts.answers_lost, 0,
            "with a synchronous standby an answer was lost: {counts:?}"
        );
        assert!(
            counts.refused > 0,
            "no request met the failover: the test tested nothing: {counts:?}"
        );
    }
}

/// Keyed requests through the layer on one primary with its standby, the standby
/// synchronous and not (switched with `ALTER SYSTEM` and a reload, in alternating
/// rounds); prints the mean and p99 latency one at a time, and the throughput of 16
/// clients at once.
async fn cost_per_request(bin: &FsPath) {
    // Asynchronous to begin with: a setting on the command line would win over
    // `ALTER SYSTEM`. `synchronous_commit` is `on` by default.
    let pair = Pair::start(bin, false);
    let admin = sqlx::PgPool::connect(&pair.primary.url()).await.unwrap();
    streaming(&admin, false).await;
    let store = PostgresStore::connect(
        &pair.primary.url(),
        &PoolSettings::default().max_connections(16),
    )
    .await
    .unwrap()
    .migrate()
    .await
    .unwrap();
    let app = app(store, Executions::default());
    let synchronous = |on: bool| {
        let admin = admin.clone();
        async move {
            let names = if on { "'*'" } else { "''" };
            sqlx::query(&format!(
                "ALTER SYSTEM SET synchronous_standby_names = {names}"
            ))
            .execute(&admin)
            .await
            .unwrap();
            sqlx::query("SELECT pg_reload_conf()")
                .execute(&admin)
                .await
                .unwrap();
            let wanted = if on { "sync" } else { "async" };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let state: Option<(String,)> =
                    sqlx::query_as("SELECT sync_state FROM pg_stat_replication")
                        .fetch_optional(&admin)
                        .await
                        .unwrap();
                if state.is_some_and(|(state,)| state == wanted) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "the standby did not turn {wanted}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let one_at_a_time = |prefix: String| {
        let app = app.clone();
        async move {
            let mut took = Vec::new();
            for n in 0..300 {
                let started = Instant::now();
                let answer = send_to(&app, "quick", &format!("{prefix}{n}")).await;
                took.push(started.elapsed());
                assert_eq!(answer.status, StatusCode::CREATED);
            }
            took
        }
    };
    let at_once = |prefix: String| {
        let app = app.clone();
        async move {
            let started = Instant::now();
            let clients = (0..16).map(|client| {
                let (app, prefix) = (app.clone(), prefix.clone());
                async move {
                    for n in 0..100 {
                        let name = format!("{prefix}{client}-{n}");
                        let answer = send_to(&app, "quick", &name).await;
                        assert_eq!(answer.status, StatusCode::CREATED);
                    }
                }
            });
            futures_util::future::join_all(clients).await;
            1600.0 / started.elapsed().as_secs_f64()
        }
    };
    let mut took = [Vec::new(), Vec::new()];
    let mut rates = [Vec::new(), Vec::new()];
    for round in 0..3 {
        for (side, on) in [(0, false), (1, true)] {
            synchronous(on).await;
            took[side].extend(one_at_a_time(format!("t{round}-{side}-")).await);
            rates[side].push(at_once(format!("r{round}-{side}-")).await);
        }
    }
    let summary = |took: &mut Vec<Duration>| {
        took.sort();
        let mean = took.iter().sum::<Duration>() / took.len() as u32;
        (mean, took[took.len() * 99 / 100])
    };
    let median = |rates: &mut Vec<f64>| {
        rates.sort_by(f64::total_cmp);
        rates[rates.len() / 2]
    };
    let [took_async, took_sync] = &mut took;
    let [rates_async, rates_sync] = &mut rates;
    let ((mean_async, p99_async), (mean_sync, p99_sync)) =
        (summary(took_async), summary(took_sync));
    let (rate_async, rate_sync) = (median(rates_async), median(rates_sync));
    eprintln!(
        "keyed request (reserve, a handler that takes no time, finalize), one at a time, {} each:\n\
         | PostgreSQL standby | mean | p99 | 16 clients at once (1,600 requests, median of 3 rounds) |\n\
         |---|---|---|---|\n\
         | asynchronous (default) | {:.2} ms | {:.2} ms | {:.0} requests/s |\n\
         | synchronous | {:.2} ms | {:.2} ms | {:.0} requests/s ({:.2}x) |",
        took_async.len(),
        mean_async.as_secs_f64() * 1e3,
        p99_async.as_secs_f64() * 1e3,
        rate_async,
        mean_sync.as_secs_f64() * 1e3,
        p99_sync.as_secs_f64() * 1e3,
        rate_sync,
        rate_sync / rate_async,
    );
    admin.close().await;
    drop(pair);
}

/// The one transactional path through a failover: a `Tx` handler on `OneCommitStore` over
/// the typed `PgPool`.
#[cfg(feature = "any")]
mod one_commit {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::Router;
    use axum::extract::{Path, State};
    use axum::http::{HeaderValue, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use idempotency_core::{IdempotencyLayer, ReservationHandle};
    use idempotency_store_sql::{LazyTx, OneCommitStore, PostgresStore, TableName, Writes};
    use sqlx::Postgres;

    const SIDE_EFFECTS: &str = "failover_side_effects";

    /// One service instance: the side effect and its record committed once.
    pub(super) async fn app(records: PostgresStore) -> Router {
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {SIDE_EFFECTS} (name TEXT NOT NULL)"
        ))
        .execute(records.pool())
        .await
        .unwrap();
        let pool = records.pool().clone();
        let store = Arc::new(
            OneCommitStore::new(Arc::new(records), pool, &TableName::default())
                .await
                .unwrap(),
        );
        Router::new()
            .route("/mutations/{name}", post(mutate))
            .with_state(Writes::with_records(store.clone()))
            .layer(
                IdempotencyLayer::from_shared_store(store)
                    .with_lease(Duration::from_secs(3))
                    .with_in_flight_wait(Duration::from_secs(2))
                    .with_finalize_retry_for(Duration::from_secs(10)),
            )
    }

    async fn mutate(
        State(writes): State<Writes<Postgres>>,
        Path(name): Path<String>,
        reservation: Option<axum::Extension<ReservationHandle>>,
    ) -> Response {
        let reservation = reservation.map(|axum::Extension(reservation)| reservation);
        let mut tx = match LazyTx::new(writes, reservation).begin().await {
            Ok(tx) => tx,
            Err(error) => return retry_later(error.to_string()),
        };
        let insert = format!("INSERT INTO {SIDE_EFFECTS} (name) VALUES ($1)");
        if let Err(error) = sqlx::query(&insert).bind(&name).execute(&mut *tx).await {
            return retry_later(error.to_string());
        }
        // Long enough that a kill also meets requests inside their transaction.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let answer = (StatusCode::CREATED, format!("created {name}")).into_response();
        match tx.commit(answer).await {
            Ok(answer) => answer,
            Err(error) => {
                let mut refused = error.into_response::<axum::body::Body>();
                refused
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                refused
            }
        }
    }

    /// A 503 the client retries after a second (the key is released: nothing committed).
    fn retry_later(error: String) -> Response {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            error,
        )
            .into_response()
    }

    /// The keys whose side effect committed more than once, read on `url` (the new
    /// primary).
    pub(super) async fn executed_twice(url: &str) -> usize {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let twice: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM (SELECT name FROM {SIDE_EFFECTS} GROUP BY name \
             HAVING count(*) > 1) AS twice"
        ))
        .fetch_one(&pool)
        .await
        .unwrap();
        pool.close().await;
        twice as usize
    }
}

/// The one transactional path (`Tx` on `OneCommitStore` over the typed `PgPool`) through
/// the same failovers with a synchronous standby: no side effect commits twice, no answer
/// is lost.
#[cfg(feature = "any")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_loses_nothing_in_a_failover_on_the_one_commit_path() {
    let Some(bin) = postgres_bin() else {
        return;
    };
    let started = Instant::now();
    bounded(150, async {
        eprintln!("{HEADER}");
        synchronous_failovers_lose_nothing(
            &bin,
            Path::OneCommit,
            "synchronous standby, one commit (Tx)",
        )
        .await;
    })
    .await;
    eprintln!("took {:.0} s", started.elapsed().as_secs_f64());
}
