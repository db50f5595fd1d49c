//! The SQL store's keys in a properties configuration (the general keys are read by
//! `idempotency_core::config`, the store's own by `SqlConfig`): every key, every bad
//! value, a key of another store, and opening the SQL stores it names.

use std::collections::HashMap;
use std::time::Duration;

use idempotency_core::config::{ConfigError, IdempotencyConfig};
use idempotency_core::{IdempotencyStore, Reservation};
use idempotency_store_sql::{PoolSettings, SqlConfig};

/// A URL of a server backend compiled into this build, if any.
fn server_url() -> Option<&'static str> {
    if cfg!(feature = "postgres") {
        Some("postgres://db.example:5432/catalog")
    } else if cfg!(feature = "mysql") {
        Some("mysql://db.example:3306/catalog")
    } else {
        None
    }
}

/// A URL of any backend compiled into this build.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
fn any_url() -> &'static str {
    server_url().unwrap_or("sqlite:/tmp/idempotency-config-test.db")
}

fn parse(pairs: &[(&str, &str)]) -> Result<IdempotencyConfig, ConfigError> {
    IdempotencyConfig::from_properties(pairs.iter().copied())
}

/// The SQL store's reading of `pairs`: the general keys by the core, the store's own by
/// `SqlConfig`.
fn sql(pairs: &[(&str, &str)]) -> Result<SqlConfig, ConfigError> {
    SqlConfig::from_config(&parse(pairs)?)
}

fn error(pairs: &[(&str, &str)]) -> String {
    sql(pairs)
        .expect_err("configuration should be refused")
        .to_string()
}

#[test]
fn every_key_is_read() {
    let Some(url) = server_url() else { return };
    let properties: HashMap<String, String> = [
        ("idempotency-enabled", " TRUE "),
        ("idempotency-key-lifetime", "PT1H"),
        ("idempotency-store-type", "SQL"),
        ("idempotency-database-url", url),
        ("idempotency-database-user", "catalog"),
        ("idempotency-database-password", " s3cret "),
        ("idempotency-database-pool-size", "20"),
        ("idempotency-purge-interval", "PT5M"),
        ("idempotency-scope-max-records", "1000"),
        ("idempotency-scope-max-bytes", "1048576"),
        ("catalog-name", "not ours, ignored"),
        ("warehouse", "s3://bucket"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let config = IdempotencyConfig::from_properties(&properties).unwrap();
    assert!(config.enabled);
    assert_eq!(config.key_lifetime, Duration::from_secs(3600));
    assert_eq!(
        config.store_type,
        idempotency_store_sql::properties::STORE_TYPE
    );
    assert_eq!(config.purge_interval, Some(Duration::from_secs(300)));
    assert_eq!(
        config.scope_quota,
        Some(
            idempotency_core::ScopeQuota::default()
                .with_max_records(1000)
                .with_max_bytes(1_048_576)
        )
    );
    let sql = SqlConfig::from_config(&config).unwrap();
    assert_eq!(sql.url, url);
    assert_eq!(sql.user.as_deref(), Some("catalog"));
    assert_eq!(sql.password.as_deref(), Some("s3cret"));
    assert_eq!(sql.pool_size, Some(20));
    assert_eq!(sql.synchronous_replication, None);
    assert_eq!(sql.pool_settings().max_connections, 20);
    for debug in [format!("{config:?}"), format!("{sql:?}")] {
        assert!(
            !debug.contains("s3cret"),
            "Debug leaks the password: {debug}"
        );
    }
    // Nothing but the URL: the pool's defaults.
    let defaults = self::sql(&[
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", url),
    ])
    .unwrap();
    assert_eq!(defaults.pool_settings(), PoolSettings::default());
}

// These cases need a URL of a backend compiled into the build.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[test]
fn each_bad_value_names_its_key_value_and_what_is_expected() {
    type Properties<'a> = &'a [(&'a str, &'a str)];
    let cases: &[(Properties, &[&str])] = &[
        (
            &[
                ("idempotency-store-type", "sql"),
                ("idempotency-database-url", "oracle://db/x"),
            ],
            &["idempotency-database-url", "oracle://db/x", "postgres://"],
        ),
        (
            &[
                ("idempotency-store-type", "sql"),
                ("idempotency-database-url", "jdbc:postgresql://u:pw@db/x"),
            ],
            &["idempotency-database-url", "postgres://"],
        ),
        (
            &[
                ("idempotency-store-type", "sql"),
                ("idempotency-database-url", any_url()),
                ("idempotency-database-pool-size", "0"),
            ],
            &[
                "idempotency-database-pool-size",
                "\"0\"",
                "positive integer",
            ],
        ),
        (
            &[
                ("idempotency-store-type", "sql"),
                ("idempotency-database-url", any_url()),
                ("idempotency-database-pool-size", "lots"),
            ],
            &[
                "idempotency-database-pool-size",
                "\"lots\"",
                "positive integer",
            ],
        ),
        (
            &[
                ("idempotency-store-type", "sql"),
                ("idempotency-database-url", any_url()),
                ("idempotency-database-user", ""),
            ],
            &["idempotency-database-user", "non-empty"],
        ),
    ];
    for (pairs, needles) in cases {
        let message = error(pairs);
        for needle in *needles {
            assert!(
                message.contains(needle),
                "{pairs:?}: {message:?} lacks {needle:?}"
            );
        }
    }
}

// These cases need a URL of a backend compiled into the build.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[test]
fn unknown_keys_and_other_stores_keys_are_refused() {
    // A misspelt key, and keys of the other stores: each named, with the keys the SQL
    // store takes.
    for key in [
        "idempotency-database-pool-sizes",
        "idempotency-max-entries",
        "idempotency-redis-url",
    ] {
        let error = sql(&[
            ("idempotency-store-type", "sql"),
            ("idempotency-database-url", any_url()),
            (key, "10"),
        ])
        .unwrap_err();
        assert!(matches!(error, ConfigError::UnknownKey { .. }), "{error:?}");
        let message = error.to_string();
        for needle in [
            format!("unknown property `{key}`"),
            "idempotency-store-type=sql".to_owned(),
            "the sql store takes idempotency-database-url, idempotency-database-user, \
             idempotency-database-password, idempotency-database-pool-size, \
             idempotency-database-synchronous-replication"
                .to_owned(),
        ] {
            assert!(message.contains(&needle), "{needle}: {message}");
        }
    }
    let message = error(&[
        ("idempotency-enabled", "true"),
        ("idempotency-enabled", "false"),
    ]);
    assert!(
        message.contains("`idempotency-enabled` is given more than once"),
        "{message}"
    );
    let message = error(&[
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", any_url()),
        ("idempotency-database-url", any_url()),
    ]);
    assert!(
        message.contains("`idempotency-database-url` is given more than once"),
        "{message}"
    );
}

// These cases need a URL of a backend compiled into the build.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[test]
fn the_store_type_and_the_url_are_required() {
    let message = error(&[("idempotency-store-type", "sql")]);
    assert_eq!(
        message,
        "`idempotency-database-url` is required when idempotency-store-type=sql"
    );
    // The SQL store opens the SQL store only.
    for store_type in ["memory", "redis"] {
        let message = error(&[
            ("idempotency-store-type", store_type),
            ("idempotency-database-url", any_url()),
        ]);
        assert!(
            message.starts_with(&format!(
                "invalid value \"{store_type}\" for `idempotency-store-type`: expected `sql`"
            )),
            "{message}"
        );
    }
    // Without a store type the configuration names the memory store.
    let message = error(&[("idempotency-database-url", any_url())]);
    assert!(message.contains("\"memory\""), "{message}");
    if cfg!(feature = "sqlite") {
        for key in ["idempotency-database-password", "idempotency-database-user"] {
            let message = error(&[
                ("idempotency-store-type", "sql"),
                ("idempotency-database-url", "sqlite:/tmp/x.db"),
                (key, "pw"),
            ]);
            assert_eq!(
                message,
                format!("`{key}` does not apply to a sqlite: database; remove it")
            );
        }
    }
}

#[test]
fn passwords_never_appear_in_errors() {
    let message = error(&[
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", "oracle://app:hunter2@db/x"),
    ]);
    assert!(!message.contains("hunter2"), "{message}");
    assert!(message.contains("oracle://app:***@db/x"), "{message}");
}

async fn reserve_works(store: &dyn IdempotencyStore) {
    let id = idempotency_core::RecordId::new("", uuid::Uuid::new_v4().to_string());
    let binding = idempotency_core::Binding {
        method: "POST".into(),
        path: "/x".into(),
        body_sha256: [0; 32],
    };
    let long = Duration::from_secs(60);
    assert!(matches!(
        store.reserve(&id, &binding, long, long).await.unwrap(),
        Reservation::Reserved(_)
    ));
    assert!(matches!(
        store.reserve(&id, &binding, long, long).await.unwrap(),
        Reservation::Exists(_)
    ));
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn builds_a_migrated_sqlite_store_with_a_purge_task() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("config.db").display());
    let config = parse(&[
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", &url),
        ("idempotency-database-pool-size", "2"),
        ("idempotency-purge-interval", "PT0.05S"),
    ])
    .unwrap();
    let store = idempotency_store_sql::open(&config).await.unwrap();
    reserve_works(store.as_ref()).await;
    let purge = config.spawn_purge_task(store).expect("purge task started");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(!purge.is_finished(), "the purge task must keep running");
    purge.abort();
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn builds_a_postgres_store_with_the_user_from_its_own_key() {
    let url = std::env::var("IDEMPOTENCY_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    // Take the user out of the URL and give it as its own key.
    let (without_user, user) = match url.split_once("://").and_then(|(s, rest)| {
        rest.split_once('@')
            .map(|(userinfo, host)| (format!("{s}://{host}"), userinfo.to_owned()))
    }) {
        Some((without, userinfo)) => (without, userinfo.split(':').next().unwrap_or("").to_owned()),
        None => (url.clone(), String::new()),
    };
    let mut pairs = vec![
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", without_user.as_str()),
    ];
    if !user.is_empty() {
        pairs.push(("idempotency-database-user", user.as_str()));
    }
    match idempotency_store_sql::open(&parse(&pairs).unwrap()).await {
        Ok(store) => reserve_works(store.as_ref()).await,
        Err(error) => {
            if std::env::var("CI").is_ok_and(|ci| ci == "true") {
                panic!("PostgreSQL at {without_user} is unreachable under CI=true: {error}");
            }
            eprintln!("SKIPPED: PostgreSQL at {without_user} is unreachable: {error}");
        }
    }
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn builds_a_mysql_store_from_a_mariadb_url() {
    let url = std::env::var("IDEMPOTENCY_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
        .replacen("mysql:", "mariadb:", 1);
    let config = parse(&[
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", &url),
        ("idempotency-database-pool-size", "3"),
    ])
    .unwrap();
    match idempotency_store_sql::open(&config).await {
        Ok(store) => reserve_works(store.as_ref()).await,
        Err(error) => {
            if std::env::var("CI").is_ok_and(|ci| ci == "true") {
                panic!("MariaDB at {url} is unreachable under CI=true: {error}");
            }
            eprintln!("SKIPPED: MariaDB at {url} is unreachable: {error}");
        }
    }
}

#[cfg(not(feature = "postgres"))]
#[tokio::test]
async fn a_backend_that_is_not_compiled_in_is_named() {
    let config = parse(&[
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", "postgres://db/x"),
    ])
    .unwrap();
    // The store has no `Debug`, so no `expect_err`.
    let Err(error) = idempotency_store_sql::open(&config).await else {
        panic!("postgres is not compiled in, yet a store was opened");
    };
    let message = error.to_string();
    assert!(
        message.contains("enable the `postgres` feature"),
        "{message}"
    );
}

#[tokio::test]
async fn open_refuses_another_stores_configuration_before_connecting() {
    for pairs in [
        &[
            ("idempotency-store-type", "redis"),
            ("idempotency-redis-url", "redis://127.0.0.1:1"),
        ][..],
        &[("idempotency-max-entries", "10")],
    ] {
        let config = parse(pairs).unwrap();
        let Err(error) = idempotency_store_sql::open(&config).await else {
            panic!("{pairs:?}: a SQL store was opened");
        };
        let message = error.to_string();
        assert!(message.contains("`idempotency-store-type`"), "{message}");
        assert!(message.contains("expected `sql`"), "{message}");
    }
}
