//! SQL stores for `idempotency-core` (PostgreSQL, MySQL/MariaDB, SQLite). Work in progress.
