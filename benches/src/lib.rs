//! Benchmarks for the Idempotency-Key layer; see `BENCHMARKS.md` at the repository root.
//!
//! Every figure is a ratio against a baseline measured in the same run, interleaved with it,
//! because the machines these run on are shared and noisy.

pub mod app;
pub mod client;
pub mod drive;
pub mod grpc;
pub mod harness;
pub mod http_load;
pub mod inprocess;
#[cfg(feature = "redis")]
pub mod redis_acks;
#[cfg(feature = "redis")]
pub mod redis_store;
pub mod report;
pub mod scale;
#[cfg(feature = "sql")]
pub mod sql;
