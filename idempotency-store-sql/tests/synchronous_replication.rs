//! `synchronous-replication`: an operator who relies on a synchronous standby says so,
//! and the PostgreSQL store checks, when it connects, `synchronous_standby_names` and
//! `synchronous_commit` on the server it connected to. Tested against a primary with a
//! synchronous standby and one with an asynchronous standby, each a pair of the test's
//! own (`test-support/postgres_pair.rs`), through every way in: `PoolSettings`, the URL
//! parameter and the properties.
#![cfg(feature = "postgres")]

#[path = "../../test-support/postgres_pair.rs"]
mod postgres_pair;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_core::config::{ConfigError, IdempotencyConfig};
use idempotency_core::{IdempotencyStore, RecordId, Reservation};
use idempotency_store_sql::{PoolSettings, PostgresStore, SqlConfig, SynchronousReplication};
use postgres_pair::{Pair, postgres_bin, streaming};

fn settings(expect: SynchronousReplication) -> PoolSettings {
    PoolSettings::default()
        .max_connections(2)
        .synchronous_replication(expect)
}

async fn started(synchronous: bool) -> Option<Pair> {
    let bin = postgres_bin()?;
    let pair = tokio::task::spawn_blocking(move || Pair::start(&bin, synchronous))
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&pair.primary.url()).await.unwrap();
    streaming(&pool, synchronous).await;
    Some(pair)
}

fn properties(url: &str, extra: &[(&str, &str)]) -> Result<IdempotencyConfig, ConfigError> {
    IdempotencyConfig::from_properties(
        [
            ("idempotency-store-type", "sql"),
            ("idempotency-database-url", url),
        ]
        .into_iter()
        .chain(extra.iter().copied()),
    )
}

/// What the store logs while `during` runs (on this thread: the test's runtime is
/// single-threaded).
async fn logged<T>(during: impl Future<Output = T>) -> (T, String) {
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);
    impl Write for Log {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let value = during.await;
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    (value, text)
}

#[tokio::test(flavor = "current_thread")]
async fn a_primary_with_a_synchronous_standby_passes_the_check() {
    let Some(pair) = started(true).await else {
        return;
    };
    let url = pair.primary.url();
    let (store, log) = logged(PostgresStore::connect(
        &url,
        &settings(SynchronousReplication::Require),
    ))
    .await;
    let store = store.expect("a synchronous standby satisfies require");
    assert_eq!(log, "", "nothing to warn about");
    // The URL parameter, and the properties.
    PostgresStore::connect(
        &format!("{url}?synchronous-replication=require"),
        &PoolSettings::default().max_connections(2),
    )
    .await
    .expect("the URL parameter");
    let config = properties(
        &url,
        &[("idempotency-database-synchronous-replication", "require")],
    )
    .unwrap();
    let opened = idempotency_store_sql::open(&config)
        .await
        .expect("the property");
    // Its commits go through: the standby acknowledges them.
    let reserved = tokio::time::timeout(
        Duration::from_secs(10),
        opened.reserve(
            &RecordId::new("", "sync-1"),
            &idempotency_core::Binding {
                method: "POST".into(),
                path: "/orders".into(),
                body_sha256: [1; 32],
            },
            Duration::from_secs(30),
            Duration::from_secs(60),
        ),
    )
    .await
    .expect("a commit waited for a standby that never answered")
    .unwrap();
    assert!(matches!(reserved, Reservation::Reserved(_)));

    // A session that does not wait for the standby (synchronous_commit = local, here
    // from the connection's options) does not pass.
    let error = PostgresStore::connect(
        &format!("{url}?options=-c%20synchronous_commit%3Dlocal"),
        &settings(SynchronousReplication::Require),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("synchronous_commit = 'local'"), "{error}");
    assert!(error.contains("synchronous_standby_names = '*'"), "{error}");
    drop(store);
}

#[tokio::test(flavor = "current_thread")]
async fn a_primary_without_one_is_refused_or_warned_about() {
    let Some(pair) = started(false).await else {
        return;
    };
    let url = pair.primary.url();
    // require: refused, naming both settings, their values and what to set.
    let error = PostgresStore::connect(&url, &settings(SynchronousReplication::Require))
        .await
        .unwrap_err()
        .to_string();
    for part in [
        "synchronous_standby_names = ''",
        "synchronous_commit = 'on'",
        "set synchronous_standby_names to your standby",
        "synchronous-replication to warn or off",
    ] {
        assert!(error.contains(part), "{part:?} missing from: {error}");
    }
    let error = PostgresStore::connect(
        &format!("{url}?synchronous-replication=require"),
        &PoolSettings::default().max_connections(2),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("synchronous_standby_names = ''"), "{error}");
    let config = properties(
        &url,
        &[("idempotency-database-synchronous-replication", "require")],
    )
    .unwrap();
    let Err(error) = idempotency_store_sql::open(&config).await else {
        panic!("open accepted a primary without a synchronous standby");
    };
    assert!(matches!(error, ConfigError::Store(_)), "{error:?}");
    assert!(
        error.to_string().contains("synchronous_standby_names = ''"),
        "{error}"
    );

    // warn: connects, and says so in one line.
    let (store, log) = logged(PostgresStore::connect(
        &url,
        &settings(SynchronousReplication::Warn),
    ))
    .await;
    store.expect("warn connects anyway");
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(log.contains("WARN"), "{log}");
    assert!(log.contains("synchronous_standby_names = ''"), "{log}");
    assert!(log.contains("synchronous_commit = 'on'"), "{log}");

    // off (the default): no check, no word.
    let (store, log) = logged(PostgresStore::connect(
        &url,
        &PoolSettings::default().max_connections(2),
    ))
    .await;
    store.expect("no check by default");
    assert_eq!(log, "");
}

#[test]
fn bad_and_repeated_values_are_refused() {
    let url = "postgres://db.example/catalog";
    let error = properties(
        url,
        &[("idempotency-database-synchronous-replication", "yes")],
    )
    .and_then(|config| SqlConfig::from_config(&config))
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("idempotency-database-synchronous-replication"),
        "{error}"
    );
    assert!(error.contains("\"yes\""), "{error}");
    assert!(error.contains("`require`, `warn` or `off`"), "{error}");
    let error = IdempotencyConfig::from_properties([
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", "sqlite:/tmp/x.db"),
        ("idempotency-database-synchronous-replication", "require"),
    ])
    .and_then(|config| SqlConfig::from_config(&config))
    .unwrap_err();
    assert!(
        matches!(error, ConfigError::NotApplicable { .. }),
        "{error:?}"
    );
}

#[tokio::test]
async fn the_url_and_the_properties_must_not_both_say_it() {
    let config = properties(
        "postgres://127.0.0.1:1/x?synchronous-replication=require",
        &[("idempotency-database-synchronous-replication", "warn")],
    )
    .unwrap();
    let Err(error) = idempotency_store_sql::open(&config).await else {
        panic!("open accepted the setting given twice");
    };
    assert!(
        matches!(error, ConfigError::DuplicateKey { .. }),
        "{error:?}"
    );
    let error = PostgresStore::connect(
        "postgres://127.0.0.1:1/x?synchronous-replication=maybe",
        &PoolSettings::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("\"maybe\""), "{error}");
}
