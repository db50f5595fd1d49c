//! The statements of [`PostgresStore`](super::PostgresStore), built once per table, and the ones
//! the one-commit path shares.

use crate::common::{REPLACE_WITH_EXCLUDED, hex, row_bytes};
use crate::table::TableName;
use sha2::{Digest, Sha256};

/// "Now" by the database clock, in epoch milliseconds.
pub(super) const NOW_MS: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

#[derive(Debug)]
pub(super) struct Statements {
    /// The channel finalize and release notify, derived from the table name.
    pub(super) channel: String,
    /// What a scope holds, read under the scope's lock when a quota is set.
    pub(super) scope_usage: String,
    pub(super) migrate: String,
    pub(super) reserve: String,
    pub(super) replace_expired: String,
    pub(super) load: String,
    pub(super) renew: String,
    pub(super) finalize: String,
    /// `finalize` without its announcement, bound the same way ($7 is read and unused).
    pub(super) finalize_quietly: String,
    pub(super) release: String,
    pub(super) take_over: String,
    pub(super) purge: String,
    pub(super) inspect: String,
    pub(super) evict: String,
}

impl Statements {
    pub(super) fn new(table: &TableName) -> Self {
        let t = format!("\"{table}\"");
        let index = table.expiry_index_name();
        let owned = format!(
            "scope = $1 AND idempotency_key = $2 AND fencing_token = $3 \
             AND response_status IS NULL AND expires_at_ms > {NOW_MS}"
        );
        let channel = format!("idempotency_{}", hex(&Sha256::digest(table.as_str())[..8]));
        // The fenced write of the answer, then `announce` (a text expression) for each row
        // written.
        let finalize = |announce: &str| {
            format!(
                "WITH done AS (
                     UPDATE {t}
                     SET response_status = $4, response_headers = $5, response_body = $6,
                         response_trailers = $8
                     WHERE {owned}
                     RETURNING 1)
                 SELECT 1 AS held FROM done WHERE {announce} IS NOT NULL"
            )
        };
        Self {
            migrate: format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    scope               TEXT    NOT NULL,
                    idempotency_key     TEXT    NOT NULL,
                    method              TEXT    NOT NULL,
                    path                TEXT    NOT NULL,
                    body_sha256         BYTEA   NOT NULL,
                    fencing_token       BIGINT  NOT NULL,
                    created_at_ms       BIGINT  NOT NULL,
                    expires_at_ms       BIGINT  NOT NULL,
                    lease_expires_at_ms BIGINT  NOT NULL,
                    response_status     INTEGER NULL,
                    response_headers    BYTEA   NULL,
                    response_body       BYTEA   NULL,
                    response_trailers   BYTEA   NULL,
                    PRIMARY KEY (scope, idempotency_key)
                );
                CREATE INDEX IF NOT EXISTS \"{index}\" ON {t} (expires_at_ms);
                ALTER TABLE {t} ADD COLUMN IF NOT EXISTS response_trailers BYTEA NULL;"
            ),
            // DO NOTHING, not DO UPDATE: a conflicting live row is then neither locked nor
            // written, so a replay is a read. An expired row comes back flagged and is
            // replaced by `replace_expired`. A key without a row is inserted only if its
            // advisory lock ($9) is free: a one-commit owner holds it while its record is
            // not written yet (see `begin_locking_statement`); the answer is then one row
            // flagged `busy`.
            reserve: format!(
                "WITH clock AS MATERIALIZED (SELECT {NOW_MS} AS now_ms),
                free AS MATERIALIZED (
                    SELECT CASE WHEN EXISTS (SELECT 1 FROM {t}
                                             WHERE scope = $1 AND idempotency_key = $2)
                                THEN TRUE ELSE pg_try_advisory_xact_lock($9::bigint) END AS free
                ),
                ins AS (
                    INSERT INTO {t}
                        (scope, idempotency_key, method, path, body_sha256, fencing_token,
                         created_at_ms, expires_at_ms, lease_expires_at_ms,
                         response_status, response_headers, response_body)
                    SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bigint,
                           now_ms, now_ms + $8::bigint, now_ms + $7::bigint, NULL, NULL, NULL
                    FROM clock, free
                    WHERE free.free
                    ON CONFLICT (scope, idempotency_key) DO NOTHING
                    RETURNING fencing_token
                )
                SELECT FALSE AS busy, TRUE AS reserved, FALSE AS expired, NULL::text AS method,
                       NULL::text AS path, NULL::bytea AS body_sha256, fencing_token,
                       NULL::bigint AS lease_expires_at_ms, NULL::bigint AS now_ms,
                       NULL::integer AS response_status, NULL::bytea AS response_headers,
                       NULL::bytea AS response_body, NULL::bytea AS response_trailers
                FROM ins
                UNION ALL
                SELECT FALSE, FALSE, e.expires_at_ms <= clock.now_ms, e.method, e.path,
                       e.body_sha256, e.fencing_token, e.lease_expires_at_ms, clock.now_ms,
                       e.response_status, e.response_headers, e.response_body,
                       e.response_trailers
                FROM {t} AS e, clock
                WHERE e.scope = $1 AND e.idempotency_key = $2
                  AND NOT EXISTS (SELECT 1 FROM ins)
                UNION ALL
                SELECT TRUE, FALSE, FALSE, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                       NULL, NULL
                FROM free WHERE NOT free.free"
            ),
            replace_expired: format!(
                "WITH clock AS MATERIALIZED (SELECT {NOW_MS} AS now_ms)
                 UPDATE {t} AS r SET
                     method = $3, path = $4, body_sha256 = $5, fencing_token = $6,
                     created_at_ms = clock.now_ms,
                     expires_at_ms = clock.now_ms + $8::bigint,
                     lease_expires_at_ms = clock.now_ms + $7::bigint,
                     response_status = NULL, response_headers = NULL, response_body = NULL,
                     response_trailers = NULL
                 FROM clock
                 WHERE r.scope = $1 AND r.idempotency_key = $2
                   AND r.expires_at_ms <= clock.now_ms"
            ),
            load: format!(
                "SELECT r.method, r.path, r.body_sha256, r.fencing_token, r.lease_expires_at_ms,
                        clock.now_ms, r.response_status, r.response_headers, r.response_body,
                        r.response_trailers
                 FROM {t} AS r, (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE r.scope = $1 AND r.idempotency_key = $2
                   AND r.expires_at_ms > clock.now_ms"
            ),
            // The expiry moves with the lease, so a record in flight under a live lease
            // never expires; one clock reading serves both.
            renew: format!(
                "UPDATE {t} SET lease_expires_at_ms = clock.now_ms + $4::bigint,
                     expires_at_ms = GREATEST(expires_at_ms, clock.now_ms + $4::bigint)
                 FROM (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE {owned}"
            ),
            // Finalize and release announce the settled record to waiters (on every
            // node) in the same statement; the notice is sent when it commits (inside a
            // handler's transaction too). Finalize returns an integer, not pg_notify's
            // void, which sqlx's `Any` driver cannot read.
            finalize: finalize(&format!("pg_notify('{channel}', $7)")),
            finalize_quietly: finalize("$7::text"),
            release: format!(
                "WITH done AS (DELETE FROM {t} WHERE {owned} RETURNING 1)
                 SELECT pg_notify('{channel}', $4) FROM done"
            ),
            take_over: format!(
                "UPDATE {t}
                 SET fencing_token = $4, lease_expires_at_ms = clock.now_ms + $5::bigint,
                     expires_at_ms = GREATEST(expires_at_ms, clock.now_ms + $5::bigint)
                 FROM (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE {owned} AND lease_expires_at_ms <= clock.now_ms"
            ),
            channel,
            scope_usage: scope_usage_statement(table),
            purge: format!(
                "DELETE FROM {t} AS d
                 USING (SELECT scope, idempotency_key FROM {t}
                        WHERE expires_at_ms <= {NOW_MS}
                        LIMIT $1
                        FOR UPDATE SKIP LOCKED) AS x
                 WHERE d.scope = x.scope AND d.idempotency_key = x.idempotency_key"
            ),
            inspect: format!(
                "SELECT r.method, r.path, r.body_sha256, r.fencing_token, r.created_at_ms,
                        r.expires_at_ms, r.lease_expires_at_ms, clock.now_ms, r.response_status
                 FROM {t} AS r, (SELECT {NOW_MS} AS now_ms) AS clock
                 WHERE r.scope = $1 AND r.idempotency_key = $2
                   AND r.expires_at_ms > clock.now_ms"
            ),
            evict: format!(
                "DELETE FROM {t}
                 WHERE scope = $1 AND idempotency_key = $2 AND fencing_token = $3
                   AND (response_status IS NULL) = $4::boolean AND expires_at_ms > {NOW_MS}"
            ),
        }
    }
}

/// The finalize statement for records in `table`, announced to the waiters of every
/// replica: for the answers written in a handler's transaction under a leased reservation.
pub(crate) fn finalize_statement(table: &TableName) -> String {
    Statements::new(table).finalize
}

/// The finalize statement without its announcement, for the one-commit path, whose
/// duplicates wait on the record's advisory lock rather than listen: a transaction that
/// notifies takes PostgreSQL's global notification lock at its commit, which serializes
/// the commits of every such transaction. Bound as [`finalize_statement`] is.
pub(crate) fn finalize_quietly_statement(table: &TableName) -> String {
    Statements::new(table).finalize_quietly
}

/// The one-commit path's `BEGIN`, which tries the key's advisory lock (`lock_key`) in the
/// same round trip and notes, for the transaction, the lock it took: the key's
/// (`lock_key` as text) or none (`''`). The lock key is a number the store computed, never
/// client text.
pub(crate) fn begin_locking_statement(lock_key: i64) -> String {
    format!(
        "BEGIN; SELECT set_config('{KEY_LOCKED}', \
         CASE WHEN pg_try_advisory_xact_lock({lock_key}) THEN '{lock_key}' ELSE '' END, TRUE)"
    )
}

/// The transaction-local setting in which [`begin_locking_statement`] notes the lock it
/// took.
const KEY_LOCKED: &str = "idempotency.key_locked";

/// The one-commit path's look at a key once its transaction began with
/// [`begin_locking_statement`]: whether a record holds the key (`committed`), and whether
/// this transaction holds the key's lock (`locked`). A statement sees the table as it was
/// when the statement began, so only a statement after the lock was taken sees a record
/// that the lock's previous holder committed as it let the lock go. Parameters: scope,
/// key, lock key.
pub(crate) fn look_under_lock_statement(table: &TableName) -> String {
    format!(
        "SELECT EXISTS (SELECT 1 FROM \"{table}\"
                        WHERE scope = $1::text AND idempotency_key = $2::text) AS committed,
                COALESCE(current_setting('{KEY_LOCKED}', TRUE), '') = $3::bigint::text AS locked"
    )
}

/// The one-commit path's record, inserted finished in the handler's transaction under the
/// key's advisory lock (see [`begin_locking_statement`]); an expired record is replaced,
/// and a live one (committed by another store since the lock was taken) is left alone:
/// no row inserted. Bound as the SQLite statement of the same name is.
pub(crate) fn insert_completed_statement(table: &TableName) -> String {
    format!(
        "INSERT INTO \"{table}\" AS r
             (scope, idempotency_key, method, path, body_sha256, fencing_token,
              created_at_ms, expires_at_ms, lease_expires_at_ms,
              response_status, response_headers, response_body, response_trailers)
         SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bigint,
                n, n + $7::bigint, n + $8::bigint,
                $9::integer, $10::bytea, $11::bytea, $12::bytea
         FROM (SELECT {NOW_MS} AS n) AS clock
         ON CONFLICT (scope, idempotency_key) DO UPDATE SET {REPLACE_WITH_EXCLUDED}
         WHERE r.expires_at_ms <= excluded.created_at_ms"
    )
}

/// The one-commit path's in-flight record, for a handler that commits the reservation's
/// transaction without its answer (the layer writes the answer afterwards): inserted
/// just before that `COMMIT`, so that the key stays held. It inserts only if no record
/// holds the key and the key's advisory lock is free or already this transaction's
/// (`committed`: a record holds the key; `inserted`: this one went in). Parameters:
/// scope, key, method, path, body_sha256, token, lifetime, lease, the record's lock.
pub(crate) fn insert_in_flight_statement(table: &TableName) -> String {
    format!(
        "WITH existing AS MATERIALIZED (
             SELECT 1 FROM \"{table}\" WHERE scope = $1::text AND idempotency_key = $2::text
         ),
         ins AS (
             INSERT INTO \"{table}\"
                 (scope, idempotency_key, method, path, body_sha256, fencing_token,
                  created_at_ms, expires_at_ms, lease_expires_at_ms)
             SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, $6::bigint,
                    n, n + $7::bigint, n + $8::bigint
             FROM (SELECT {NOW_MS} AS n) AS clock
             WHERE CASE WHEN EXISTS (SELECT 1 FROM existing) THEN FALSE
                        ELSE pg_try_advisory_xact_lock($9::bigint) END
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM existing) AS committed,
                (SELECT count(*) FROM ins) AS inserted"
    )
}

/// What a scope holds, for its quota (`ScopeUsage`): whether the reserving key is live,
/// the scope's live records, their bytes, and when the next of them expires.
pub(crate) fn scope_usage_statement(table: &TableName) -> String {
    let t = format!("\"{table}\"");
    format!(
        "SELECT EXISTS (SELECT 1 FROM {t} AS k
                        WHERE k.scope = $1 AND k.idempotency_key = $2
                          AND k.expires_at_ms > clock.now_ms) AS key_live,
                count(r.scope) AS records,
                COALESCE(sum({bytes}), 0)::bigint AS bytes,
                min(r.expires_at_ms) - clock.now_ms AS next_expiry_in_ms
         FROM (SELECT {NOW_MS} AS now_ms) AS clock
         LEFT JOIN {t} AS r ON r.scope = $1 AND r.expires_at_ms > clock.now_ms
         GROUP BY clock.now_ms",
        bytes = row_bytes("octet_length", "r"),
    )
}
