//! The catalog's state: which namespaces, tables and views exist, and where each table's
//! current metadata file is.
//!
//! The state lives in two SQL tables, `iceberg_namespace_properties` and
//! `iceberg_tables`, the schema that iceberg-rust's `SqlCatalog` (and the Java and Python
//! SQL catalogs) use, in the same database as the idempotency records. `SqlCatalog`
//! creates the tables and serves some reads (load / exists namespace, list / load / exists
//! table); everything else is written here over the same tables on a typed pool (the
//! catalog is generic over [`CatalogDatabase`]: PostgreSQL, MySQL/MariaDB or SQLite, as
//! the URL says), and **every change in a transaction of its own**, because `SqlCatalog` commits each of its
//! writes by itself and cannot join an outside transaction:
//!
//! | operation | how |
//! |---|---|
//! | create / drop namespace, update its properties | insert / delete property rows (a marker row `exists` keeps a namespace without properties) |
//! | create, register, drop, rename a table | insert / delete / update its row (`iceberg_type = 'TABLE'`) |
//! | commit a table, commit a transaction | a compare-and-swap on each table's metadata location |
//! | staged create (`stage-create`) | nothing is written; its create transaction is a commit |
//! | views | rows with `iceberg_type = 'VIEW'`, like the Java JDBC catalog |
//! | list namespaces under a parent | here: `SqlCatalog` lists descendants, not children |
//!
//! # Exactly once, in one commit: the record, the change and the answer
//!
//! Every mutating route takes a [`CatalogTx`] (`idempotency_store_sql::LazyTx`, an
//! axum extractor) and hands it to the domain method, which begins it when it is ready to
//! write: for a keyed change, the transaction its idempotency record was reserved in (a
//! new one without a key). The method writes the change in it and hands it back as
//! [`Uncommitted`]; the route builds the answer from it, and [`Uncommitted::commit`]
//! (`Tx::commit`) writes that answer into the record **in the same transaction** before
//! the one commit. Domain code takes a transaction and never sees a reservation; where
//! the records are is [`Writes`].
//! The record, the change and its answer then commit together or not at all: a replica
//! killed right after the commit is replayed on the retry (a second `updateTable` would
//! fail its requirements with `CommitFailedException`, and the Java client would then
//! delete files the committed snapshot needs); one killed before it leaves nothing, not
//! even the reservation, and the retry runs once. A keyed change costs one durable
//! commit, as the same change without a key does. (`--two-commit` reserves the record in
//! a commit of its own first, with a lease: `Reservations::Leased`, for comparison.)
//!
//! Metadata files are written before their transaction (they are not in the database):
//! if it rolls back, or the process dies before it commits, the file it wrote is left
//! with nothing pointing at it. That orphan is harmless, and the catalog deletes it when
//! it can (a refused or failed change); a purge (`purgeRequested`) deletes the table's
//! files only after the drop committed.
//!
//! # Files
//!
//! A table's location is `<warehouse>/<namespace levels>/<table>` unless the request or
//! the namespace's `location` property says otherwise; its metadata files are
//! `<location>/metadata/<version>-<uuid>.metadata.json`, written through iceberg-rust's
//! local-filesystem `FileIO`. Every location must lie inside the warehouse: the server
//! writes and reads files on its clients' behalf and refuses to be pointed elsewhere.
//!
//! # Replicas
//!
//! Two processes pointed at one PostgreSQL or MySQL database are two replicas of one
//! catalog. Nothing is cached in process; every commit is a compare-and-swap on the
//! metadata location (`UPDATE ... SET metadata_location = new WHERE metadata_location =
//! base`), so two replicas never both commit on one base: the second gets
//! `CommitFailedException` and its client retries on the new base. Creates rely on the
//! primary key: the second insert of a name fails and is answered `AlreadyExistsException`.
//!
//! # Where things are
//!
//! The handle and its plumbing:
//!
//! - [`connection`]: the [`Catalog`] handle and [`Catalog::open`].
//! - [`database`]: [`CatalogDatabase`], the SQL backend, its pool, placeholders and
//!   shared lookups.
//! - [`writes`]: [`Writes`], where a change's transaction comes from and how its answer
//!   is recorded in it, and [`CatalogTx`].
//! - [`uncommitted`]: [`Uncommitted`], a change and its answer
//!   committed together.
//! - [`warehouse`]: locations inside the warehouse, and deleting orphaned metadata files.
//! - [`names`], [`errors`]: name rules, and the refusals several resources share.
//! - [`log`]: the one log target of every file here.
//!
//! The resources, each an `impl Catalog` block:
//!
//! - [`namespaces`]: create, load, list, update properties, drop.
//! - [`tables`]: create, stage-create, load, drop, rename, register.
//! - [`transactions`]: commits to one table or several at once.
//! - [`views`]: create, load, replace, drop, rename, register.
//!
//! [`Uncommitted`]: uncommitted::Uncommitted
//! [`Uncommitted::commit`]: uncommitted::Uncommitted::commit

mod connection;
mod database;
mod errors;
mod log;
mod names;
mod namespaces;
mod tables;
mod transactions;
mod uncommitted;
mod views;
mod warehouse;
mod writes;

pub(crate) use connection::Catalog;
pub(crate) use database::{Backend, CatalogDatabase};
pub(crate) use writes::{CatalogTx, Writes};
