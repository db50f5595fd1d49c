//! The store's settings as an operator writes them: the parameters of a store URL and the
//! `idempotency-redis-*` properties. Each must mean what the Rust builder means, and each
//! mistake must be refused with the key, the value and what is expected. No server is
//! needed.

use std::time::Duration;

use idempotency_core::config::{ConfigError, IdempotencyConfig};
use idempotency_store_redis::{OptionsError, RedisOptions, Target, URL_PARAMETERS};

const URL: &str = "redis://app:hunter2@10.0.0.1:6379/0";

fn from_url(query: &str) -> Result<RedisOptions, OptionsError> {
    RedisOptions::from_url(&format!("{URL}?{query}"))
}

fn properties(pairs: &[(&str, &str)]) -> Result<IdempotencyConfig, ConfigError> {
    IdempotencyConfig::from_properties(
        [
            ("idempotency-store-type", "redis"),
            ("idempotency-redis-url", URL),
        ]
        .into_iter()
        .chain(pairs.iter().copied()),
    )
}

fn from_properties(pairs: &[(&str, &str)]) -> Result<RedisOptions, ConfigError> {
    RedisOptions::from_config(&properties(pairs)?)
}

/// `pairs` alone, without the store type and the URL.
fn from_properties_without_url(pairs: &[(&str, &str)]) -> Result<RedisOptions, ConfigError> {
    RedisOptions::from_config(&IdempotencyConfig::from_properties(pairs.iter().copied())?)
}

#[test]
fn every_parameter_means_what_the_builder_means() {
    let built = RedisOptions::server(URL)
        .key_prefix("orders:idempotency:")
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .operation_timeout(Duration::from_secs(3))
        .replica_acks(2, Duration::from_millis(100))
        .replica_ack_connections(4)
        .accept_evicting_policy(true);
    let query = "key-prefix=orders%3Aidempotency%3A&connect-timeout=500ms&operation-timeout=PT3S\
                 &replica-acks=2&replica-ack-timeout=100ms&replica-ack-connections=4\
                 &accept-evicting-policy=true";
    assert_eq!(from_url(query).unwrap(), built);
    let from_properties = from_properties(&[
        ("idempotency-redis-key-prefix", "orders:idempotency:"),
        ("idempotency-redis-connect-timeout", "500ms"),
        ("idempotency-redis-operation-timeout", "PT3S"),
        ("idempotency-redis-replica-acks", "2"),
        ("idempotency-redis-replica-ack-timeout", "100ms"),
        ("idempotency-redis-replica-ack-connections", "4"),
        ("idempotency-redis-accept-evicting-policy", "TRUE"),
    ])
    .unwrap();
    assert_eq!(from_properties, built);
    // The parameters the docs list are the ones read.
    assert_eq!(URL_PARAMETERS.len(), 8);
    for parameter in URL_PARAMETERS {
        let error = from_url(&format!("{parameter}=%zz"))
            .unwrap_err()
            .to_string();
        assert!(error.contains(parameter), "{error}");
    }
}

#[test]
fn replica_acks_alone_take_the_default_timeout_and_zero_is_off() {
    assert_eq!(
        from_url("replica-acks=1").unwrap(),
        RedisOptions::server(URL).replica_acks(1, Duration::from_millis(250))
    );
    assert_eq!(
        from_url("replica-acks=0").unwrap(),
        RedisOptions::server(URL)
    );
    let error = from_url("replica-ack-timeout=250ms")
        .unwrap_err()
        .to_string();
    assert!(error.contains("replica-ack-timeout"), "{error}");
    assert!(error.contains("replica-acks"), "{error}");
    let error = from_properties(&[("idempotency-redis-replica-ack-timeout", "250ms")])
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("idempotency-redis-replica-ack-timeout"),
        "{error}"
    );
}

#[test]
fn a_setting_may_come_from_the_url_inside_the_properties() {
    let config = IdempotencyConfig::from_properties([
        ("idempotency-store-type", "redis"),
        (
            "idempotency-redis-url",
            "redis://10.0.0.1:6379?replica-acks=1&replica-ack-timeout=50ms",
        ),
        ("idempotency-redis-key-prefix", "svc:"),
    ])
    .unwrap();
    assert_eq!(
        config.store_type,
        idempotency_store_redis::properties::STORE_TYPE
    );
    assert_eq!(
        RedisOptions::from_config(&config).unwrap(),
        RedisOptions::server("redis://10.0.0.1:6379")
            .replica_acks(1, Duration::from_millis(50))
            .key_prefix("svc:")
            .unwrap()
    );
}

#[test]
fn cluster_mode_comes_from_the_scheme_or_the_cluster_parameter() {
    assert_eq!(
        RedisOptions::from_url("redis://10.0.0.1:7000?cluster=true")
            .unwrap()
            .target(),
        &Target::Cluster(vec!["redis://10.0.0.1:7000".to_owned()])
    );
    assert_eq!(
        from_properties(&[("idempotency-redis-cluster", "true")])
            .unwrap()
            .target(),
        &Target::Cluster(vec![URL.to_owned()])
    );
    assert_eq!(
        RedisOptions::from_url("redis+cluster://h1:7000,h2:7000?cluster=true&replica-acks=1")
            .unwrap(),
        RedisOptions::cluster(["redis://h1:7000", "redis://h2:7000"])
            .replica_acks(1, Duration::from_millis(250))
    );
    let error = RedisOptions::from_url("redis+cluster://h1:7000?cluster=false")
        .unwrap_err()
        .to_string();
    assert!(error.contains("`cluster`"), "{error}");
    assert!(error.contains("redis+cluster://"), "{error}");
    assert!(RedisOptions::from_url("unix:///run/redis.sock?cluster=true").is_err());
}

#[test]
fn the_clients_own_parameters_reach_the_client() {
    // `protocol` is the redis client's; the store's parameters are taken out of the URL.
    assert_eq!(
        RedisOptions::from_url("redis://h:6379/2?protocol=resp3&replica-acks=1")
            .unwrap()
            .target(),
        &Target::Server("redis://h:6379/2?protocol=resp3".to_owned())
    );
    assert_eq!(
        RedisOptions::from_url("rediss://h:6379/?replica-acks=1#insecure")
            .unwrap()
            .target(),
        &Target::Server("rediss://h:6379/#insecure".to_owned())
    );
}

#[test]
fn each_bad_value_names_its_key_value_and_what_is_expected() {
    let cases: &[(&str, &str, &[&str])] = &[
        ("key-prefix", "a%7Bb", &["\"a{b\"", "`{` or `}`"]),
        ("connect-timeout", "0s", &["\"0s\"", "positive duration"]),
        ("connect-timeout", "2", &["\"2\"", "500ms"]),
        ("operation-timeout", "soon", &["\"soon\"", "500ms"]),
        ("replica-acks", "one", &["\"one\"", "whole number"]),
        ("replica-acks", "-1", &["\"-1\"", "whole number"]),
        ("replica-ack-timeout", "0ms", &["\"0ms\"", "at least 1 ms"]),
        ("replica-ack-connections", "0", &["\"0\"", "1 to 1024"]),
        (
            "replica-ack-connections",
            "5000",
            &["\"5000\"", "1 to 1024"],
        ),
        (
            "accept-evicting-policy",
            "yes",
            &["\"yes\"", "`true` or `false`"],
        ),
        ("cluster", "1", &["\"1\"", "`true` or `false`"]),
    ];
    for (parameter, value, expected) in cases {
        let query = if parameter.starts_with("replica-ack-") {
            format!("replica-acks=1&{parameter}={value}")
        } else {
            format!("{parameter}={value}")
        };
        let error = from_url(&query).unwrap_err();
        assert!(
            matches!(error, OptionsError::InvalidValue { .. }),
            "{error:?}"
        );
        let message = error.to_string();
        assert!(
            message.contains(&format!("the URL parameter `{parameter}`")),
            "{message}"
        );
        for part in *expected {
            assert!(message.contains(part), "{query}: {message}");
        }
        assert!(!message.contains("hunter2"), "{message}");

        // The same value as a property: the same words, naming the property.
        let key = format!("idempotency-redis-{parameter}");
        let decoded = value.replace("%7B", "{");
        let mut pairs = vec![(key.as_str(), decoded.as_str())];
        if parameter.starts_with("replica-ack-") {
            pairs.push(("idempotency-redis-replica-acks", "1"));
        }
        let error = from_properties(&pairs).unwrap_err();
        assert!(
            matches!(error, ConfigError::InvalidValue { .. }),
            "{error:?}"
        );
        let message = error.to_string();
        assert!(message.contains(&format!("`{key}`")), "{message}");
        for part in *expected {
            assert!(message.contains(part), "{key}: {message}");
        }
    }
}

#[test]
fn unknown_and_repeated_parameters_are_refused() {
    let error = from_url("replica-ack=1").unwrap_err();
    assert!(
        matches!(&error, OptionsError::UnknownParameter { parameter, .. } if parameter == "replica-ack"),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(message.contains("`replica-ack`"), "{message}");
    assert!(message.contains("replica-acks"), "{message}");
    assert!(!message.contains("hunter2"), "{message}");

    let error = from_url("replica-acks=1&replica-acks=2").unwrap_err();
    assert!(matches!(error, OptionsError::Repeated { .. }), "{error:?}");

    // Inside the properties' URL, and given both ways.
    let error = IdempotencyConfig::from_properties([
        ("idempotency-store-type", "redis"),
        ("idempotency-redis-url", "redis://h:6379?replica-ack=1"),
    ])
    .and_then(|config| RedisOptions::from_config(&config))
    .unwrap_err()
    .to_string();
    assert!(error.contains("idempotency-redis-url"), "{error}");
    assert!(error.contains("replica-ack"), "{error}");
    let error = IdempotencyConfig::from_properties([
        ("idempotency-store-type", "redis"),
        ("idempotency-redis-url", "redis://h:6379?replica-acks=1"),
        ("idempotency-redis-replica-acks", "2"),
    ])
    .and_then(|config| RedisOptions::from_config(&config))
    .unwrap_err();
    assert!(
        matches!(error, ConfigError::DuplicateKey { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("idempotency-redis-replica-acks"),
        "{message}"
    );
    assert!(message.contains("idempotency-redis-url"), "{message}");

    // An unknown idempotency-redis-* key is refused by the store, naming the keys it takes.
    let error = from_properties(&[("idempotency-redis-replica-ack", "1")]).unwrap_err();
    assert!(matches!(error, ConfigError::UnknownKey { .. }), "{error:?}");
    let error = error.to_string();
    assert!(error.contains("`idempotency-redis-replica-ack`"), "{error}");
    assert!(error.contains("idempotency-redis-replica-acks"), "{error}");
}

#[test]
fn the_redis_store_type_takes_redis_keys_only() {
    let error = from_properties_without_url(&[("idempotency-store-type", "redis")])
        .unwrap_err()
        .to_string();
    assert_eq!(
        error,
        "`idempotency-redis-url` is required when idempotency-store-type=redis"
    );
    let error = from_properties_without_url(&[
        ("idempotency-store-type", "redis"),
        ("idempotency-redis-url", " "),
    ])
    .unwrap_err()
    .to_string();
    assert!(error.contains("`idempotency-redis-url`"), "{error}");
    // Another store's keys are not the Redis store's: each is named, with the keys the
    // Redis store takes.
    for (key, value) in [
        ("idempotency-database-url", "postgres://db/x"),
        ("idempotency-database-pool-size", "5"),
        ("idempotency-max-entries", "5"),
    ] {
        let error = from_properties(&[(key, value)]).unwrap_err();
        assert!(
            matches!(error, ConfigError::UnknownKey { .. }),
            "{key}: {error:?}"
        );
        let message = error.to_string();
        for needle in [
            format!("unknown property `{key}`"),
            "idempotency-store-type=redis".to_owned(),
            idempotency_store_redis::properties::KEYS.join(", "),
        ] {
            assert!(message.contains(&needle), "{needle}: {message}");
        }
    }
    // The Redis store opens the Redis store only: another store type is named.
    for store in [
        &[("idempotency-store-type", "memory")][..],
        &[("idempotency-store-type", "sql")],
        &[],
    ] {
        let error = from_properties_without_url(
            &store
                .iter()
                .copied()
                .chain([("idempotency-redis-url", URL)])
                .collect::<Vec<_>>(),
        )
        .unwrap_err();
        let message = error.to_string();
        assert!(message.contains("`idempotency-store-type`"), "{message}");
        assert!(message.contains("expected `redis`"), "{message}");
    }
    let config = properties(&[]).unwrap();
    let debug = format!("{config:?}");
    assert!(
        !debug.contains("hunter2"),
        "Debug shows the password: {debug}"
    );
}

#[tokio::test]
async fn open_refuses_another_stores_configuration_before_connecting() {
    let config = IdempotencyConfig::from_properties([
        ("idempotency-store-type", "sql"),
        ("idempotency-database-url", "sqlite:/tmp/x.db"),
    ])
    .unwrap();
    let Err(error) = idempotency_store_redis::open(&config).await else {
        panic!("a Redis store was opened for idempotency-store-type=sql");
    };
    assert!(
        error
            .to_string()
            .starts_with("invalid value \"sql\" for `idempotency-store-type`: expected `redis`"),
        "{error}"
    );
}
