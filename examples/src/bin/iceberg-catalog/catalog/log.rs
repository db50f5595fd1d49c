//! The target of the catalog's log events.

/// One target for every file of the module, the one it had as a single file, so that log
/// lines and `RUST_LOG` filters read as they did before the module was split.
pub(super) const LOG_TARGET: &str = "iceberg_catalog::catalog";
