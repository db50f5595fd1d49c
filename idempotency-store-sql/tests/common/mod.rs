//! Helpers shared by the backend test binaries: unique tables, the skip-or-fail rule for
//! unreachable servers, and a few records to work with. The store checks themselves,
//! multi-node ones included, are the public conformance suite's.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use idempotency_core::{Binding, IdempotencyStore, RecordId, StoredResponse};

pub const LONG: Duration = Duration::from_secs(60);

/// A table name no other test (or test process) uses.
pub fn unique_table() -> String {
    format!(
        "idem_test_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    )
}

/// Under `CI=true` an unreachable database fails the test; elsewhere it is skipped with a
/// notice. Returns `None` when the caller should return (skip).
pub fn unreachable<T>(
    backend: &str,
    url: &str,
    env: &str,
    error: impl std::fmt::Display,
) -> Option<T> {
    let message =
        format!("{backend} at {url} is unreachable ({error}); start it or point {env} at one");
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{message} (CI=true: a database that cannot be reached fails the run)");
    }
    eprintln!("SKIPPED: {message}");
    None
}

pub fn id() -> RecordId {
    RecordId::new(
        format!("scope-{}", uuid::Uuid::new_v4()),
        uuid::Uuid::new_v4().to_string(),
    )
}

pub fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: "/v1/namespaces/db/tables?x=1".to_owned(),
        body_sha256: [7; 32],
    }
}

pub fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            bytes::Bytes::from_static(b"application/json"),
        )],
        body: bytes::Bytes::from_static(body),
    }
}

/// A store as the conformance suite takes it.
pub fn shared(store: impl IdempotencyStore) -> Arc<dyn IdempotencyStore> {
    Arc::new(store)
}
