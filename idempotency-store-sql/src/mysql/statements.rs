//! The statements of [`MySqlStore`](super::MySqlStore), built once per table, and the ones
//! the one-commit path shares.

use crate::common::{hex, row_bytes};
use crate::record_database::NewRecord;
use crate::table::TableName;

/// `LAST_INSERT_ID` value that reserve's VALUES list sets: the row was inserted (or, with
/// two affected rows, an expired row was replaced).
/// (The markers are set inside `IF(LAST_INSERT_ID(n) = n, value, NULL)`: the optimizer
/// cannot fold that away, as it folds `LAST_INSERT_ID(n) IS NULL`, and were the marker
/// ever missing, the outcome check fails closed with an error instead of guessing.)
pub(super) const MARK_INSERTED: u64 = 1;

/// `LAST_INSERT_ID` value that reserve's ON DUPLICATE KEY UPDATE sets when the existing
/// row is live and was left as it is.
pub(super) const MARK_EXISTING: u64 = 2;

/// "Now" by the database clock, in epoch milliseconds. Computed from `UTC_TIMESTAMP`
/// with plain DATETIME arithmetic, so neither the session time zone nor a daylight-saving
/// fold can shift it; MySQL and MariaDB evaluate it once per statement.
pub(super) const NOW_MS: &str =
    "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

#[derive(Debug)]
pub(super) struct Statements {
    pub(super) migrate: String,
    /// What a scope holds, read with a locking read (the scope's index range stays
    /// locked until the transaction ends) when a quota is set.
    pub(super) scope_usage: String,
    /// MySQL 8's reserve: outcome read from the OK packet, row read by `load`.
    pub(super) reserve: String,
    /// MariaDB's reserve: the same upsert, returning the row.
    pub(super) reserve_returning: String,
    pub(super) load: String,
    pub(super) renew: String,
    pub(super) finalize: String,
    pub(super) release: String,
    pub(super) take_over: String,
    pub(super) purge: String,
    pub(super) inspect: String,
    pub(super) evict: String,
}

impl Statements {
    pub(super) fn new(table: &TableName) -> Self {
        let t = format!("`{table}`");
        let index = table.expiry_index_name();
        // Parameters: scope, key, token, in this order, after any SET parameters.
        let owned = format!(
            "scope = ? AND idempotency_key = ? AND fencing_token = ? \
             AND response_status IS NULL AND expires_at_ms > {NOW_MS}"
        );
        // ON DUPLICATE KEY UPDATE assigns left to right, and each assignment sees the
        // columns assigned before it. Every assignment tests the *old* expires_at_ms, so
        // expires_at_ms is assigned last.
        let expired = "expires_at_ms <= VALUES(created_at_ms)";
        let replace =
            |column: &str| format!("{column} = IF({expired}, VALUES({column}), {column})");
        // The two reserve statements differ only in how they report the outcome: MySQL 8's
        // sets LAST_INSERT_ID markers (in the new row's created_at_ms and in the kept
        // row's fencing_token), MariaDB's returns the row.
        // Parameters: scope, key, method, path, body_sha256, token, lifetime, lease.
        let upsert = |created_at_ms: &str, kept_token: &str, returning: &str| {
            format!(
                "INSERT INTO {t}
                    (scope, idempotency_key, method, path, body_sha256, fencing_token,
                     created_at_ms, expires_at_ms, lease_expires_at_ms,
                     response_status, response_headers, response_body)
                 VALUES (?, ?, ?, ?, ?, ?, {created_at_ms},
                         {NOW_MS} + ?, {NOW_MS} + ?, NULL, NULL, NULL)
                 ON DUPLICATE KEY UPDATE
                    {method},
                    {path},
                    {body_sha256},
                    fencing_token = IF({expired}, VALUES(fencing_token), {kept_token}),
                    {created_at_ms_column},
                    {lease_expires_at_ms},
                    response_status = IF({expired}, NULL, response_status),
                    response_headers = IF({expired}, NULL, response_headers),
                    response_body = IF({expired}, NULL, response_body),
                    response_trailers = IF({expired}, NULL, response_trailers),
                    {expires_at_ms}
                 {returning}",
                method = replace("method"),
                path = replace("path"),
                body_sha256 = replace("body_sha256"),
                created_at_ms_column = replace("created_at_ms"),
                lease_expires_at_ms = replace("lease_expires_at_ms"),
                expires_at_ms = replace("expires_at_ms"),
            )
        };
        // A record as `RawRecord` decodes it. sqlx reads utf8mb4_bin text columns as
        // binary (the server flags them BINARY), so the two text columns are cast to the
        // connection's charset.
        let record_columns = format!(
            "CAST(method AS CHAR CHARACTER SET utf8mb4) AS method,
             CAST(path AS CHAR CHARACTER SET utf8mb4) AS path, body_sha256, fencing_token,
             lease_expires_at_ms, {NOW_MS} AS now_ms, response_status, response_headers,
             response_body, response_trailers"
        );
        Self {
            // Locking the scope's rows (and the gaps between them) until the reservation
            // commits, so that the usage read is still true when it does.
            scope_usage: format!("{} FOR UPDATE", scope_usage_statement(table)),
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    scope               VARCHAR(255) NOT NULL,
                    idempotency_key     VARCHAR(255) NOT NULL,
                    method              VARCHAR(255) NOT NULL,
                    path                TEXT         NOT NULL,
                    body_sha256         BINARY(32)   NOT NULL,
                    fencing_token       BIGINT       NOT NULL,
                    created_at_ms       BIGINT       NOT NULL,
                    expires_at_ms       BIGINT       NOT NULL,
                    lease_expires_at_ms BIGINT       NOT NULL,
                    response_status     INT          NULL,
                    response_headers    MEDIUMBLOB   NULL,
                    response_body       LONGBLOB     NULL,
                    response_trailers   MEDIUMBLOB   NULL,
                    PRIMARY KEY (scope, idempotency_key),
                    KEY `{index}` (expires_at_ms)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
            ),
            reserve: upsert(
                &format!("IF(LAST_INSERT_ID({MARK_INSERTED}) = {MARK_INSERTED}, {NOW_MS}, NULL)"),
                &format!(
                    "IF(LAST_INSERT_ID({MARK_EXISTING}) = {MARK_EXISTING}, fencing_token, NULL)"
                ),
                "",
            ),
            // No markers: the returned row's fencing token tells the outcome. The
            // RETURNING list is the one `load` selects, so both decode alike.
            reserve_returning: upsert(
                NOW_MS,
                "fencing_token",
                &format!("RETURNING {record_columns}"),
            ),
            load: format!(
                "SELECT {record_columns}
                 FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND expires_at_ms > {NOW_MS}"
            ),
            // The expiry moves with the lease, so a record in flight under a live lease
            // never expires. The lease is bound twice rather than read back from the
            // first assignment, which MariaDB's SIMULTANEOUS_ASSIGNMENT mode would change.
            renew: format!(
                "UPDATE {t} SET lease_expires_at_ms = {NOW_MS} + ?,
                     expires_at_ms = GREATEST(expires_at_ms, {NOW_MS} + ?)
                 WHERE {owned}"
            ),
            finalize: format!(
                "UPDATE {t}
                 SET response_status = ?, response_headers = ?, response_body = ?,
                     response_trailers = ?
                 WHERE {owned}"
            ),
            release: format!("DELETE FROM {t} WHERE {owned}"),
            take_over: format!(
                "UPDATE {t}
                 SET fencing_token = ?, lease_expires_at_ms = {NOW_MS} + ?,
                     expires_at_ms = GREATEST(expires_at_ms, {NOW_MS} + ?)
                 WHERE {owned} AND lease_expires_at_ms <= {NOW_MS}"
            ),
            purge: format!("DELETE FROM {t} WHERE expires_at_ms <= {NOW_MS} LIMIT ?"),
            inspect: format!(
                "SELECT CAST(method AS CHAR CHARACTER SET utf8mb4) AS method,
                        CAST(path AS CHAR CHARACTER SET utf8mb4) AS path, body_sha256,
                        fencing_token, created_at_ms, expires_at_ms, lease_expires_at_ms,
                        {NOW_MS} AS now_ms, response_status
                 FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND expires_at_ms > {NOW_MS}"
            ),
            evict: format!(
                "DELETE FROM {t}
                 WHERE scope = ? AND idempotency_key = ? AND fencing_token = ?
                   AND (response_status IS NULL) = ? AND expires_at_ms > {NOW_MS}"
            ),
        }
    }
}

/// The one-commit path's wait for a duplicate's owner: a locking read of the key's row,
/// which waits for the uncommitted insert of that row to commit or roll back.
/// Parameters: scope, key.
pub(crate) fn owners_row_statement(table: &TableName) -> String {
    format!("SELECT 1 FROM `{table}` WHERE scope = ? AND idempotency_key = ? LOCK IN SHARE MODE")
}

/// The finalize statement for records in `table`, for the answers a `Tx` writes.
pub(crate) fn finalize_statement(table: &TableName) -> String {
    Statements::new(table).finalize
}

/// A plain insert of an in-flight record, for the [one-commit path](crate::OneCommitStore):
/// no conflict handling, so that a duplicate key fails (or, while the key's row is
/// uncommitted, waits for its transaction). Parameters: scope, key, method, path,
/// body_sha256, token, lifetime, lease.
pub(crate) fn insert_in_flight_statement(table: &TableName) -> String {
    format!(
        "INSERT INTO `{table}`
         (scope, idempotency_key, method, path, body_sha256, fencing_token,
          created_at_ms, expires_at_ms, lease_expires_at_ms)
         VALUES (?, ?, ?, ?, ?, ?, {NOW_MS}, {NOW_MS} + ?, {NOW_MS} + ?)"
    )
}

/// What a scope holds, for its quota (`ScopeUsage`): whether the reserving key is live,
/// the scope's live records, their bytes, and when the next of them expires. A plain
/// read: it does not wait for transactions that hold rows of the scope.
pub(crate) fn scope_usage_statement(table: &TableName) -> String {
    let t = format!("`{table}`");
    format!(
        "SELECT (SELECT COUNT(*) FROM {t} AS k
                 WHERE k.scope = ? AND k.idempotency_key = ?
                   AND k.expires_at_ms > {NOW_MS}) AS key_live,
                COUNT(*) AS records,
                CAST(COALESCE(SUM({bytes}), 0) AS SIGNED) AS bytes,
                MIN(r.expires_at_ms) - {NOW_MS} AS next_expiry_in_ms
         FROM {t} AS r
         WHERE r.scope = ? AND r.expires_at_ms > {NOW_MS}",
        bytes = row_bytes("OCTET_LENGTH", "r"),
    )
}

/// MariaDB's one-commit reservation, sent as the `BEGIN` of the handler's transaction,
/// in one round trip: an anonymous block (`BEGIN NOT ATOMIC`, MariaDB only) starts the
/// transaction and inserts `record` in flight in it, with its lock wait bounded to
/// `lock_wait_secs`, and leaves the transaction open. A key with a row fails it with
/// the insert's duplicate-key error (1062), a key whose row another transaction holds
/// with a lock wait timeout (1205), and a deadlock with 1213; the block's handler rolls
/// the transaction back first, so a failure leaves the session outside any transaction.
///
/// The values travel as literals, the text ones as hex (`X'…'`): nothing a client sent is
/// spliced into the text but `[0-9a-f]`.
pub(crate) fn reserve_begin_statement(
    table: &TableName,
    record: &NewRecord<'_>,
    lock_wait_secs: u64,
) -> String {
    let text = |value: &str| format!("CONVERT(X'{}' USING utf8mb4)", hex(value.as_bytes()));
    format!(
        "BEGIN NOT ATOMIC
             DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
             START TRANSACTION;
             SET STATEMENT innodb_lock_wait_timeout = {lock_wait_secs} FOR
             INSERT INTO `{table}`
             (scope, idempotency_key, method, path, body_sha256, fencing_token,
              created_at_ms, expires_at_ms, lease_expires_at_ms)
             VALUES ({scope}, {key}, {method}, {path}, X'{body_sha256}', {token},
                     {NOW_MS}, {NOW_MS} + {expires_in_ms}, {NOW_MS} + {lease_ms});
         END",
        scope = text(&record.id.scope),
        key = text(&record.id.key),
        method = text(&record.binding.method),
        path = text(&record.binding.path),
        body_sha256 = hex(&record.binding.body_sha256),
        token = record.token.0,
        expires_in_ms = record.expires_in_ms,
        lease_ms = record.lease_ms,
    )
}
