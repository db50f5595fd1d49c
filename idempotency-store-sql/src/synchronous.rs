//! The check a PostgreSQL store makes when it connects, if the operator says that it
//! relies on synchronous replication ([`SynchronousReplication`]): that the server it
//! connected to waits for a standby before it reports a commit done.

use std::borrow::Cow;

use idempotency_core::StoreError;
use sqlx::postgres::PgPool;

use crate::common::backend;
use crate::pool_settings::SynchronousReplication;

/// The PostgreSQL URL parameter that sets [`PoolSettings::synchronous_replication`]
/// (`postgres://…?synchronous-replication=require`); the store takes it out of the URL
/// before the driver reads the rest.
///
/// [`PoolSettings::synchronous_replication`]: crate::PoolSettings::synchronous_replication
pub(crate) const URL_PARAMETER: &str = "synchronous-replication";

/// The server a store connected to does not replicate its commits synchronously, and the
/// store was told to require it: a failover to a standby could lose the latest
/// reservations and answers, and their mutations would run again.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "PostgreSQL does not replicate this store's commits synchronously: \
     synchronous_standby_names = '{synchronous_standby_names}' and synchronous_commit = \
     '{synchronous_commit}' on the server the store connected to, so a failover to a standby \
     can lose the latest reservations and answers (their mutations then run again). On the \
     primary set synchronous_standby_names to your standby (e.g. 'FIRST 1 (standby1)', or \
     '*') and synchronous_commit to on, remote_apply or remote_write, then reload \
     (SELECT pg_reload_conf()); or, if the replication is asynchronous on purpose, set \
     synchronous-replication to warn or off"
)]
pub struct NotSynchronous {
    /// `synchronous_standby_names` as the server reported it.
    pub synchronous_standby_names: String,
    /// `synchronous_commit` as the server reported it, for the store's connections.
    pub synchronous_commit: String,
}

/// A `synchronous-replication` URL parameter the store cannot use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSynchronousReplication {
    /// Not `require`, `warn` or `off`.
    #[error(
        "invalid value {value:?} for the PostgreSQL URL parameter `synchronous-replication`: \
         expected `require`, `warn` or `off`"
    )]
    Value {
        /// The value as given.
        value: String,
    },
    /// Given twice in the URL, or in the URL and in the settings with another value.
    #[error("`synchronous-replication` is given twice, as {first} and as {second}; give it once")]
    Repeated {
        /// The first value.
        first: String,
        /// The other value.
        second: String,
    },
}

/// `url` without its `synchronous-replication` parameter, and that parameter's value.
pub(crate) fn split_url(
    url: &str,
) -> Result<(Cow<'_, str>, Option<SynchronousReplication>), InvalidSynchronousReplication> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((Cow::Borrowed(url), None));
    };
    let mut found: Option<SynchronousReplication> = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some((URL_PARAMETER, value)) => {
                let parsed = value
                    .parse()
                    .map_err(|_| InvalidSynchronousReplication::Value {
                        value: value.to_owned(),
                    })?;
                if let Some(first) = found {
                    return Err(InvalidSynchronousReplication::Repeated {
                        first: first.to_string(),
                        second: value.to_owned(),
                    });
                }
                found = Some(parsed);
            }
            _ if pair == URL_PARAMETER => {
                return Err(InvalidSynchronousReplication::Value {
                    value: String::new(),
                });
            }
            _ => kept.push(pair),
        }
    }
    if found.is_none() {
        return Ok((Cow::Borrowed(url), None));
    }
    let url = if kept.iter().all(|pair| pair.is_empty()) {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((Cow::Owned(url), found))
}

/// The mode a URL's parameter and the settings say together: the one given, or an
/// error when both give one and they differ.
pub(crate) fn combine(
    from_url: Option<SynchronousReplication>,
    settings: SynchronousReplication,
) -> Result<SynchronousReplication, InvalidSynchronousReplication> {
    match from_url {
        None => Ok(settings),
        Some(mode) if settings == SynchronousReplication::Off || settings == mode => Ok(mode),
        Some(mode) => Err(InvalidSynchronousReplication::Repeated {
            first: format!("{mode} (in the URL)"),
            second: format!("{settings} (in PoolSettings)"),
        }),
    }
}

/// Reads `synchronous_standby_names` and `synchronous_commit` on a connection of `pool`
/// and, as `expect` says, refuses ([`NotSynchronous`]) or warns when they cannot give
/// synchronous replication.
pub(crate) async fn check(pool: &PgPool, expect: SynchronousReplication) -> Result<(), StoreError> {
    if expect == SynchronousReplication::Off {
        return Ok(());
    }
    let (names, commit): (String, String) = sqlx::query_as(
        "SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit')",
    )
    .fetch_one(pool)
    .await
    .map_err(backend)?;
    // `local` and `off` report a commit done before any standby has it.
    let waits_for_a_standby = matches!(commit.as_str(), "on" | "remote_apply" | "remote_write");
    if !names.trim().is_empty() && waits_for_a_standby {
        return Ok(());
    }
    let missing = NotSynchronous {
        synchronous_standby_names: names,
        synchronous_commit: commit,
    };
    match expect {
        SynchronousReplication::Require => Err(StoreError::backend(missing)),
        _ => {
            tracing::warn!(
                synchronous_standby_names = %missing.synchronous_standby_names,
                synchronous_commit = %missing.synchronous_commit,
                "{missing}"
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parameter_is_taken_out_of_the_url() {
        let (url, mode) =
            split_url("postgres://db/x?sslmode=disable&synchronous-replication=require").unwrap();
        assert_eq!(url, "postgres://db/x?sslmode=disable");
        assert_eq!(mode, Some(SynchronousReplication::Require));
        let (url, mode) = split_url("postgres://db/x?synchronous-replication=warn").unwrap();
        assert_eq!(url, "postgres://db/x");
        assert_eq!(mode, Some(SynchronousReplication::Warn));
        let (url, mode) = split_url("postgres://db/x?sslmode=disable").unwrap();
        assert_eq!(url, "postgres://db/x?sslmode=disable");
        assert_eq!(mode, None);
        let error = split_url("postgres://db/x?synchronous-replication=yes")
            .unwrap_err()
            .to_string();
        assert!(error.contains("\"yes\""), "{error}");
        assert!(error.contains("`require`, `warn` or `off`"), "{error}");
        assert!(
            split_url("postgres://db/x?synchronous-replication=warn&synchronous-replication=off")
                .is_err()
        );
    }

    #[test]
    fn url_and_settings_must_agree() {
        use SynchronousReplication::*;
        assert_eq!(combine(None, Warn), Ok(Warn));
        assert_eq!(combine(Some(Require), Off), Ok(Require));
        assert_eq!(combine(Some(Require), Require), Ok(Require));
        assert!(combine(Some(Require), Warn).is_err());
    }
}
