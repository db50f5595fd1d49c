//! [`Writes`]: where a change's transaction comes from and how its answer is recorded in
//! it — the library's `idempotency_store_sql::Writes`, with the records in the catalog's
//! database (`Writes::with_records`) or elsewhere (`Writes::records_elsewhere`: Redis, or
//! nowhere with `--no-idempotency`). Domain code takes the transaction ([`CatalogTx`]) and
//! never sees a reservation.

use idempotency_store_sql::LazyTx;
pub(crate) use idempotency_store_sql::Writes;

/// A change's transaction, still to begin: the extractor every mutating route takes.
pub(crate) type CatalogTx<DB> = LazyTx<Writes<DB>>;
