//! Benchmarks for the Idempotency-Key layer; see `BENCHMARKS.md`.
