//! The store's settings as text: the parameters of a store URL
//! (`redis://host:6379?replica-acks=1`) and the `idempotency-redis-*` properties, which
//! are the same parameters under longer names. One parser reads both, so a value means
//! the same whichever way it came in.

use std::time::Duration;

use idempotency_core::config::{ConfigError, IdempotencyConfig};

use crate::keys::KeyPrefix;
use crate::options::{DEFAULT_REPLICA_ACK_TIMEOUT, RedisOptions, Target, UnsupportedUrl, redact};
use crate::properties;

/// A setting the store reads from its URL's query (and from the `idempotency-redis-*`
/// property of the same name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parameter {
    KeyPrefix,
    ConnectTimeout,
    OperationTimeout,
    ReplicaAcks,
    ReplicaAckTimeout,
    ReplicaAckConnections,
    AcceptEvictingPolicy,
    Cluster,
}

/// The most connections [`Parameter::ReplicaAckConnections`] may ask for, per node.
const MAX_REPLICA_ACK_CONNECTIONS: usize = 1024;

impl Parameter {
    pub(crate) const ALL: [Parameter; 8] = [
        Parameter::KeyPrefix,
        Parameter::ConnectTimeout,
        Parameter::OperationTimeout,
        Parameter::ReplicaAcks,
        Parameter::ReplicaAckTimeout,
        Parameter::ReplicaAckConnections,
        Parameter::AcceptEvictingPolicy,
        Parameter::Cluster,
    ];

    /// Its name in a URL's query.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Parameter::KeyPrefix => "key-prefix",
            Parameter::ConnectTimeout => "connect-timeout",
            Parameter::OperationTimeout => "operation-timeout",
            Parameter::ReplicaAcks => "replica-acks",
            Parameter::ReplicaAckTimeout => "replica-ack-timeout",
            Parameter::ReplicaAckConnections => "replica-ack-connections",
            Parameter::AcceptEvictingPolicy => "accept-evicting-policy",
            Parameter::Cluster => "cluster",
        }
    }

    /// Its key in a properties configuration.
    pub(crate) fn property(self) -> &'static str {
        match self {
            Parameter::KeyPrefix => properties::REDIS_KEY_PREFIX,
            Parameter::ConnectTimeout => properties::REDIS_CONNECT_TIMEOUT,
            Parameter::OperationTimeout => properties::REDIS_OPERATION_TIMEOUT,
            Parameter::ReplicaAcks => properties::REDIS_REPLICA_ACKS,
            Parameter::ReplicaAckTimeout => properties::REDIS_REPLICA_ACK_TIMEOUT,
            Parameter::ReplicaAckConnections => properties::REDIS_REPLICA_ACK_CONNECTIONS,
            Parameter::AcceptEvictingPolicy => properties::REDIS_ACCEPT_EVICTING_POLICY,
            Parameter::Cluster => properties::REDIS_CLUSTER,
        }
    }

    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    fn of_property(key: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.property() == key)
    }

    /// What its value may be.
    fn expected(self) -> &'static str {
        match self {
            Parameter::KeyPrefix => "a key prefix without `{` or `}` (percent-encoded in a URL)",
            Parameter::ConnectTimeout | Parameter::OperationTimeout => {
                "a positive duration such as 500ms, 2s or PT2S"
            }
            Parameter::ReplicaAcks => {
                "a whole number of replicas that must acknowledge each write, 0 (off) or more"
            }
            Parameter::ReplicaAckTimeout => "a duration of at least 1 ms such as 250ms or PT0.25S",
            Parameter::ReplicaAckConnections => "a whole number from 1 to 1024",
            Parameter::AcceptEvictingPolicy | Parameter::Cluster => "`true` or `false`",
        }
    }
}

/// The URL parameters the store reads, e.g. for a command-line flag's help.
pub const URL_PARAMETERS: [&str; 8] = [
    "key-prefix",
    "connect-timeout",
    "operation-timeout",
    "replica-acks",
    "replica-ack-timeout",
    "replica-ack-connections",
    "accept-evicting-policy",
    "cluster",
];

/// Query parameters the `redis` client itself reads, passed on to it untouched:
/// `protocol` on every URL, and the database and credentials of a Unix socket's.
const CLIENT_PARAMETERS: [&str; 4] = ["protocol", "db", "user", "pass"];

/// Why a store URL, or its settings given as properties, cannot be used. Every message
/// names the parameter (or property) and its value, and says what it may be; a URL in a
/// message never shows its password.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptionsError {
    /// The URL's scheme is not one of the store's.
    #[error(transparent)]
    UnsupportedUrl(#[from] UnsupportedUrl),
    /// A query parameter the store does not know (often a typo).
    #[error(
        "the Redis URL {url:?} has a parameter `{parameter}` the store does not know; \
         its parameters are key-prefix, connect-timeout, operation-timeout, replica-acks, \
         replica-ack-timeout, replica-ack-connections, accept-evicting-policy and cluster \
         (and the client's own: protocol, and db, user, pass on a unix: URL)"
    )]
    UnknownParameter {
        /// The URL, password redacted.
        url: String,
        /// The parameter as given.
        parameter: String,
    },
    /// A value that cannot be used.
    #[error("invalid value {value:?} for {key}: expected {expected}")]
    InvalidValue {
        /// The parameter (`` the URL parameter `replica-acks` ``) or property
        /// (`` `idempotency-redis-replica-acks` ``).
        key: String,
        /// The value as given (decoded from the URL).
        value: String,
        /// What it may be.
        expected: &'static str,
    },
    /// The same setting given twice: twice in the URL, or in the URL and as a property.
    #[error("{key} is given more than once{also}")]
    Repeated {
        /// The parameter or property.
        key: String,
        /// Where else it was given, if elsewhere.
        also: String,
    },
    /// Settings that contradict each other.
    #[error("{key} {reason}")]
    Conflict {
        /// The parameter or property at fault.
        key: String,
        /// Why, and what to do.
        reason: &'static str,
    },
}

/// Where a setting came from, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Url,
    Property,
}

/// One setting, as given.
struct Given {
    parameter: Parameter,
    origin: Origin,
    value: String,
}

impl Given {
    fn invalid(&self) -> Problem {
        Problem::Invalid {
            parameter: self.parameter,
            origin: self.origin,
            value: self.value.clone(),
        }
    }
}

fn describe(parameter: Parameter, origin: Origin) -> String {
    match origin {
        Origin::Url => format!("the URL parameter `{}`", parameter.name()),
        Origin::Property => format!("`{}`", parameter.property()),
    }
}

/// What is wrong, before it is told as an [`OptionsError`] (from a URL) or a
/// [`ConfigError`] (from properties).
enum Problem {
    Url(OptionsError),
    Invalid {
        parameter: Parameter,
        origin: Origin,
        value: String,
    },
    Repeated {
        parameter: Parameter,
        first: Origin,
        again: Origin,
    },
    Conflict {
        parameter: Parameter,
        origin: Origin,
        value: String,
        reason: &'static str,
    },
}

impl Problem {
    fn into_options_error(self) -> OptionsError {
        match self {
            Problem::Url(error) => error,
            Problem::Invalid {
                parameter,
                origin,
                value,
            } => OptionsError::InvalidValue {
                key: describe(parameter, origin),
                value,
                expected: parameter.expected(),
            },
            Problem::Repeated {
                parameter,
                first,
                again,
            } => OptionsError::Repeated {
                key: describe(parameter, again),
                also: if first == again {
                    String::new()
                } else {
                    format!(" (also as {})", describe(parameter, first))
                },
            },
            Problem::Conflict {
                parameter,
                origin,
                reason,
                ..
            } => OptionsError::Conflict {
                key: describe(parameter, origin),
                reason,
            },
        }
    }

    /// The problem as a [`ConfigError`], for the properties whose URL is `url`.
    fn into_config_error(self, url: &str) -> ConfigError {
        match self {
            Problem::Invalid {
                parameter,
                origin: Origin::Property,
                value,
            } => ConfigError::invalid_value(parameter.property(), value, parameter.expected()),
            Problem::Conflict {
                parameter,
                origin: Origin::Property,
                value,
                reason,
            } => ConfigError::invalid_value(
                parameter.property(),
                value,
                format!("a setting that agrees with the others: it {reason}"),
            ),
            Problem::Repeated {
                parameter,
                first,
                again,
            } if first != again => ConfigError::DuplicateKey {
                key: format!(
                    "{} (also given as the parameter `{}` of {})",
                    parameter.property(),
                    parameter.name(),
                    properties::REDIS_URL
                ),
            },
            // Everything else is about the URL.
            other => {
                let error = other.into_options_error();
                ConfigError::invalid_value(
                    properties::REDIS_URL,
                    match &error {
                        OptionsError::InvalidValue { value, .. } => value.clone(),
                        OptionsError::UnknownParameter { parameter, .. } => parameter.clone(),
                        _ => redact(url),
                    },
                    format!("a Redis store URL the store can use ({error})"),
                )
            }
        }
    }
}

/// Reads a store URL, and `settings` beside it (property key, value): the target from
/// the scheme and host(s), the store's parameters from the query (the client's own are
/// left in the URL).
fn parse(url: &str, settings: &[(&str, &str)]) -> Result<RedisOptions, Problem> {
    let unsupported = || Problem::Url(UnsupportedUrl::new(url).into());
    let (without_fragment, fragment) = match url.split_once('#') {
        Some((before, fragment)) => (before, Some(fragment)),
        None => (url, None),
    };
    let (base, query) = match without_fragment.split_once('?') {
        Some((base, query)) => (base, query),
        None => (without_fragment, ""),
    };
    let mut given: Vec<Given> = Vec::new();
    let mut add = |parameter: Parameter, origin: Origin, value: String| {
        if let Some(first) = given.iter().find(|g| g.parameter == parameter) {
            return Err(Problem::Repeated {
                parameter,
                first: first.origin,
                again: origin,
            });
        }
        given.push(Given {
            parameter,
            origin,
            value,
        });
        Ok(())
    };
    let mut passed_on: Vec<&str> = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match Parameter::named(name) {
            Some(parameter) => {
                let decoded = percent_decode(value).ok_or_else(|| Problem::Invalid {
                    parameter,
                    origin: Origin::Url,
                    value: value.to_owned(),
                })?;
                add(parameter, Origin::Url, decoded)?;
            }
            None if CLIENT_PARAMETERS.contains(&name) => passed_on.push(pair),
            None => {
                return Err(Problem::Url(OptionsError::UnknownParameter {
                    url: redact(url),
                    parameter: name.to_owned(),
                }));
            }
        }
    }
    for (key, value) in settings {
        // The keys are the parameters' own (`from_config` reads no other).
        let parameter = Parameter::of_property(key).ok_or_else(unsupported)?;
        add(parameter, Origin::Property, value.trim().to_owned())?;
    }

    // The URL as the client reads it: the store's parameters taken out.
    let mut client_url = base.to_owned();
    if !passed_on.is_empty() {
        client_url.push('?');
        client_url.push_str(&passed_on.join("&"));
    }
    if let Some(fragment) = fragment {
        client_url.push('#');
        client_url.push_str(fragment);
    }
    let (target, scheme_is_cluster) = target(&client_url).ok_or_else(unsupported)?;
    let mut options = RedisOptions::new(target);

    let mut replica_acks: Option<(u32, &Given)> = None;
    let mut ack_timeout: Option<(Duration, &Given)> = None;
    for setting in &given {
        let value = setting.value.as_str();
        match setting.parameter {
            Parameter::KeyPrefix => {
                options.prefix = KeyPrefix::new(value).map_err(|_| setting.invalid())?;
            }
            Parameter::ConnectTimeout => {
                options = options.connect_timeout(
                    duration(value)
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| setting.invalid())?,
                );
            }
            Parameter::OperationTimeout => {
                options = options.operation_timeout(
                    duration(value)
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| setting.invalid())?,
                );
            }
            Parameter::ReplicaAcks => {
                let replicas = value.parse::<u32>().map_err(|_| setting.invalid())?;
                replica_acks = Some((replicas, setting));
            }
            Parameter::ReplicaAckTimeout => {
                let timeout = duration(value)
                    .filter(|d| *d >= Duration::from_millis(1))
                    .ok_or_else(|| setting.invalid())?;
                ack_timeout = Some((timeout, setting));
            }
            Parameter::ReplicaAckConnections => {
                let connections = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_REPLICA_ACK_CONNECTIONS).contains(n))
                    .ok_or_else(|| setting.invalid())?;
                options = options.replica_ack_connections(connections);
            }
            Parameter::AcceptEvictingPolicy => {
                options = options
                    .accept_evicting_policy(boolean(value).ok_or_else(|| setting.invalid())?);
            }
            Parameter::Cluster => {
                let cluster = boolean(value).ok_or_else(|| setting.invalid())?;
                let conflict = |reason| Problem::Conflict {
                    parameter: Parameter::Cluster,
                    origin: setting.origin,
                    value: setting.value.clone(),
                    reason,
                };
                match (&options.target, cluster) {
                    (Target::Cluster(_), false) if scheme_is_cluster => {
                        return Err(conflict(
                            "is false, but the URL's scheme (redis+cluster://) says the target \
                             is a cluster; use redis:// for one server",
                        ));
                    }
                    (Target::Server(url), true) => {
                        if url.starts_with("unix:") || url.starts_with("redis+unix:") {
                            return Err(conflict(
                                "is true, but a unix: socket is one server, not a cluster",
                            ));
                        }
                        options.target = Target::Cluster(vec![url.clone()]);
                    }
                    _ => {}
                }
            }
        }
    }
    match (replica_acks, ack_timeout) {
        (Some((replicas, _)), timeout) if replicas > 0 => {
            options = options.replica_acks(
                replicas,
                timeout.map_or(DEFAULT_REPLICA_ACK_TIMEOUT, |(timeout, _)| timeout),
            );
        }
        (_, Some((_, setting))) => {
            return Err(Problem::Conflict {
                parameter: Parameter::ReplicaAckTimeout,
                origin: setting.origin,
                value: setting.value.clone(),
                reason: "is set, but no replica acknowledgement is asked for; set replica-acks \
                         to 1 or more, or leave the timeout out",
            });
        }
        _ => {}
    }
    Ok(options)
}

/// The target a URL (without the store's parameters) names, and whether its scheme says
/// cluster.
fn target(url: &str) -> Option<(Target, bool)> {
    let (scheme, rest) = url.split_once("://")?;
    match scheme {
        "redis" | "rediss" | "valkey" | "valkeys" | "redis+unix" | "unix" => {
            Some((Target::Server(url.to_owned()), false))
        }
        "redis+cluster" | "rediss+cluster" | "valkey+cluster" | "valkeys+cluster" => {
            let scheme = scheme.trim_end_matches("+cluster");
            let (credentials, rest) = match rest.rsplit_once('@') {
                Some((credentials, rest)) => (format!("{credentials}@"), rest),
                None => (String::new(), rest),
            };
            let (hosts, tail) = match rest.find(['/', '?', '#']) {
                Some(at) => rest.split_at(at),
                None => (rest, ""),
            };
            let nodes: Vec<String> = hosts
                .split(',')
                .map(str::trim)
                .filter(|host| !host.is_empty())
                .map(|host| format!("{scheme}://{credentials}{host}{tail}"))
                .collect();
            (!nodes.is_empty()).then_some((Target::Cluster(nodes), true))
        }
        _ => None,
    }
}

/// `250ms`, `2s`, `1m` (whole numbers), or an ISO-8601 duration (`PT0.25S`).
pub(crate) fn duration(value: &str) -> Option<Duration> {
    if value.starts_with(['P', 'p']) {
        return idempotency_core::iso8601::parse_duration(value).ok();
    }
    let digits = value.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = value.split_at(digits);
    let number: u64 = number.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(number)),
        "s" => Some(Duration::from_secs(number)),
        "m" => Some(Duration::from_secs(number.checked_mul(60)?)),
        _ => None,
    }
}

fn boolean(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// `%XX` escapes decoded; `None` when one is malformed or the result is not UTF-8.
fn percent_decode(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            let hex = std::str::from_utf8(bytes.get(at + 1..at + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            at += 3;
        } else {
            out.push(bytes[at]);
            at += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl RedisOptions {
    /// Reads options from one string, as a command-line flag or a config file gives it.
    ///
    /// The scheme and host(s) say what to connect to: `redis://…` (or `rediss://…`, TLS)
    /// is one server; `redis+cluster://host:port,host:port/` (or `rediss+cluster://…`) a
    /// cluster found through those nodes, each getting the same credentials, path and
    /// query. The query sets the other options:
    ///
    /// | parameter | default | value |
    /// | --- | --- | --- |
    /// | `key-prefix` | `idempotency:` | [`key_prefix`](Self::key_prefix), percent-encoded |
    /// | `connect-timeout` | `2s` | [`connect_timeout`](Self::connect_timeout): `500ms`, `2s`, `1m` or ISO-8601 (`PT2S`) |
    /// | `operation-timeout` | `2s` | [`operation_timeout`](Self::operation_timeout) |
    /// | `replica-acks` | `0` (off) | [`replica_acks`](Self::replica_acks): replicas that must acknowledge each write |
    /// | `replica-ack-timeout` | `250ms` | how long a write waits for them (needs `replica-acks`) |
    /// | `replica-ack-connections` | `2`, or `16` on a cluster | [`replica_ack_connections`](Self::replica_ack_connections) |
    /// | `accept-evicting-policy` | `false` | [`accept_evicting_policy`](Self::accept_evicting_policy) |
    /// | `cluster` | from the scheme | `true` makes a `redis://` URL a cluster's seed node |
    ///
    /// `protocol` (and `db`, `user`, `pass` on a `unix:` URL) go to the `redis` client. Any
    /// other parameter, a bad value or a parameter given twice is refused with an error
    /// that names it; the error never shows the URL's password.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotency_store_redis::RedisOptions;
    ///
    /// let options = RedisOptions::from_url(
    ///     "redis://10.0.0.1:6379?replica-acks=1&replica-ack-timeout=250ms&key-prefix=orders%3A",
    /// )?;
    /// let same = RedisOptions::server("redis://10.0.0.1:6379")
    ///     .replica_acks(1, Duration::from_millis(250))
    ///     .key_prefix("orders:")?;
    /// assert_eq!(options, same);
    /// // A typo is refused, not ignored.
    /// assert!(RedisOptions::from_url("redis://10.0.0.1:6379?replica-ack=1").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_url(url: &str) -> Result<Self, OptionsError> {
        parse(url, &[]).map_err(Problem::into_options_error)
    }

    /// Reads options from a properties configuration (`idempotency-store-type=redis`):
    /// the URL in `idempotency-redis-url`, read as [`from_url`](Self::from_url) reads it,
    /// and each other `idempotency-redis-*` key as the URL parameter of the same name
    /// ([`properties`](crate::properties) lists them). Another store type, a store
    /// property the Redis store does not take, or a setting given both ways is refused.
    /// Errors name the property.
    ///
    /// ```
    /// use idempotency_core::config::IdempotencyConfig;
    /// use idempotency_store_redis::RedisOptions;
    ///
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-store-type", "redis"),
    ///     ("idempotency-redis-url", "redis://10.0.0.1:6379"),
    ///     ("idempotency-redis-key-prefix", "orders:"),
    /// ])?;
    /// let options = RedisOptions::from_config(&config)?;
    /// let built = RedisOptions::server("redis://10.0.0.1:6379").key_prefix("orders:").unwrap();
    /// assert_eq!(options, built);
    ///
    /// // Another store's key, or a misspelt one, is refused.
    /// let config = IdempotencyConfig::from_properties([
    ///     ("idempotency-store-type", "redis"),
    ///     ("idempotency-redis-url", "redis://10.0.0.1:6379"),
    ///     ("idempotency-database-pool-size", "4"),
    /// ])?;
    /// let error = RedisOptions::from_config(&config).unwrap_err().to_string();
    /// assert!(error.contains("`idempotency-database-pool-size`"), "{error}");
    /// assert!(error.contains("idempotency-redis-replica-acks"), "{error}");
    /// # Ok::<(), idempotency_core::config::ConfigError>(())
    /// ```
    pub fn from_config(config: &IdempotencyConfig) -> Result<Self, ConfigError> {
        let given = config.store_properties_for(properties::STORE_TYPE, &properties::KEYS)?;
        let url = given
            .get(properties::REDIS_URL)
            .ok_or(ConfigError::Missing {
                key: properties::REDIS_URL,
                when: "idempotency-store-type=redis",
            })?;
        if url.is_empty() {
            return Err(ConfigError::invalid_value(
                properties::REDIS_URL,
                url,
                "a redis:// URL",
            ));
        }
        let settings: Vec<(&str, &str)> = Parameter::ALL
            .into_iter()
            .filter_map(|parameter| {
                let key = parameter.property();
                given.get(key).map(|value| (key, value))
            })
            .collect();
        parse(url, &settings).map_err(|problem| problem.into_config_error(url))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_is_a_property_of_the_same_name() {
        let names: Vec<&str> = Parameter::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names, URL_PARAMETERS);
        let keys: Vec<&str> = Parameter::ALL.iter().map(|p| p.property()).collect();
        let mut listed = properties::KEYS[1..].to_vec();
        let mut ours = keys.clone();
        listed.sort_unstable();
        ours.sort_unstable();
        assert_eq!(
            ours, listed,
            "the properties' keys and the URL parameters differ"
        );
        for parameter in Parameter::ALL {
            assert_eq!(
                parameter.property().strip_prefix("idempotency-redis-"),
                Some(parameter.name())
            );
        }
    }

    #[test]
    fn durations_take_units_or_iso_8601() {
        assert_eq!(duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(duration("PT0.25S"), Some(Duration::from_millis(250)));
        for bad in ["", "250", "ms", "2 s", "1h", "-1s", "1.5s"] {
            assert_eq!(duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn percent_escapes_are_decoded() {
        assert_eq!(
            percent_decode("orders%3Aidem%20"),
            Some("orders:idem ".into())
        );
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None);
    }
}
