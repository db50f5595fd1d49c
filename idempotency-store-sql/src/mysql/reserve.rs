//! How a [`MySqlStore`] reserves a key: one statement on MariaDB (`RETURNING`), an upsert
//! and a read on MySQL 8, and under a scope quota, in a transaction that counts the scope.

use std::time::Duration;

use idempotency_core::{Binding, RecordId, Reservation, ScopeQuota, StoreError};
use sqlx::mysql::MySqlConnection;
use sqlx::{Connection, Row};

use crate::common::{MAX_ATTEMPTS, RawRecord, ScopeUsage, backend, new_token, too_many_races};

use super::statements::{MARK_EXISTING, MARK_INSERTED};
use super::{MySqlStore, record_by_position};

/// The server behind the pool, as far as reserve is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flavor {
    /// MySQL 8: no `RETURNING`, so a key held by a live row takes a second statement.
    MySql,
    /// MariaDB (10.5+): `INSERT … ON DUPLICATE KEY UPDATE … RETURNING` hands back the row
    /// as it stands after the statement, so every reserve is one statement.
    MariaDb,
}

impl MySqlStore {
    /// Which server the pool talks to: asked once, then remembered. (A pool cannot mix
    /// servers, and a failed query leaves it unknown, to be asked again next time.)
    pub(super) async fn flavor(&self) -> Result<Flavor, StoreError> {
        self.flavor
            .get_or_try_init(|| async {
                let version: String = sqlx::query_scalar("SELECT VERSION()")
                    .fetch_one(&self.pool)
                    .await
                    .map_err(backend)?;
                Ok(if version.contains("MariaDB") {
                    Flavor::MariaDb
                } else {
                    Flavor::MySql
                })
            })
            .await
            .copied()
    }

    /// MariaDB: one statement whatever the key holds. It inserts, replaces an expired row,
    /// or leaves a live row as it is, and returns the row as it stands afterwards. Tokens
    /// are 64 random bits, so the row carries our token exactly when we reserved (a live
    /// row holding the very token we just drew is a 1-in-2^64 chance).
    pub(super) async fn reserve_returning(
        &self,
        connection: &mut MySqlConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let token = new_token();
        // `self.flavor()` was asked first: this is MariaDB's statement.
        let row = self
            .reserve_query(id, binding, token, lease, lifetime)
            .fetch_one(connection)
            .await
            .map_err(backend)?;
        let raw = record_by_position(&row).map_err(backend)?;
        if raw.fencing_token == token.0 {
            Ok(Reservation::Reserved(token))
        } else {
            Ok(Reservation::Exists(raw.into_record()?))
        }
    }

    /// MySQL 8: the upsert reports through the OK packet whether it reserved; when a live
    /// row holds the key, a second statement reads it. That row may go away in between
    /// (released or purged), and then the upsert runs again.
    pub(super) async fn reserve_then_load(
        &self,
        connection: &mut MySqlConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            let token = new_token();
            // `self.flavor()` was asked first: this is MySQL 8's statement.
            let done = self
                .reserve_query(id, binding, token, lease, lifetime)
                .execute(&mut *connection)
                .await
                .map_err(backend)?;
            match (done.rows_affected(), done.last_insert_id()) {
                // Inserted (1), or an expired row replaced (2 changed rows).
                (1, MARK_INSERTED) | (2, _) => return Ok(Reservation::Reserved(token)),
                // A live row holds the key and was left unchanged (found rows: 1).
                (0 | 1, MARK_EXISTING) => {
                    let raw: Option<RawRecord> = sqlx::query_as(&self.sql.load)
                        .bind(&id.scope)
                        .bind(&id.key)
                        .fetch_optional(&mut *connection)
                        .await
                        .map_err(backend)?;
                    if let Some(record) = raw.map(RawRecord::into_record).transpose()? {
                        return Ok(Reservation::Exists(record));
                    }
                }
                (rows, mark) => {
                    return Err(StoreError::backend(format!(
                        "unexpected outcome of the MySQL reserve statement \
                         ({rows} rows affected, LAST_INSERT_ID {mark})"
                    )));
                }
            }
        }
        Err(too_many_races("reserve"))
    }

    /// Reserves on one connection (a transaction's, when a quota is checked).
    pub(super) async fn reserve_on(
        &self,
        connection: &mut MySqlConnection,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        match self.flavor().await? {
            Flavor::MariaDb => {
                self.reserve_returning(connection, id, binding, lease, lifetime)
                    .await
            }
            Flavor::MySql => {
                self.reserve_then_load(connection, id, binding, lease, lifetime)
                    .await
            }
        }
    }

    /// Reserves after checking the scope's quota, in one transaction that holds the
    /// scope's index range from its first read to its commit. A replay is never refused.
    pub(super) async fn reserve_within_quota(
        &self,
        quota: &ScopeQuota,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let mut connection = self.pool.acquire().await.map_err(backend)?;
        // The locking read locks the range (and the gap after it) only under REPEATABLE
        // READ; this applies to the next transaction of this connection alone.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *connection)
            .await
            .map_err(backend)?;
        let mut tx = connection.begin().await.map_err(backend)?;
        let usage = sqlx::query(&self.sql.scope_usage)
            .bind(&id.scope)
            .bind(&id.key)
            .bind(&id.scope)
            .fetch_one(&mut *tx)
            .await
            .map_err(backend)?;
        let usage = ScopeUsage {
            key_live: usage.try_get::<i64, _>("key_live").map_err(backend)? > 0,
            records: usage.try_get("records").map_err(backend)?,
            bytes: usage.try_get("bytes").map_err(backend)?,
            next_expiry_in_ms: usage.try_get("next_expiry_in_ms").map_err(backend)?,
        };
        if let Some(refusal) = usage.refusal(quota) {
            return Err(refusal);
        }
        let reservation = self
            .reserve_on(&mut tx, id, binding, lease, lifetime)
            .await?;
        tx.commit().await.map_err(backend)?;
        Ok(reservation)
    }
}
