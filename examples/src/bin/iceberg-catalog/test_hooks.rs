//! Hooks for the tests alone, compiled only with the examples' `test-hooks` feature
//! (`scripts/test` runs with `--all-features`): a production build has none of them.
//!
//! - `ICEBERG_CATALOG_CRASH_AFTER_COMMIT=1`: the process aborts right after it commits a
//!   change, before it answers (`examples/tests/iceberg_catalog.rs`, a replica killed
//!   after its commit).
//! - `ICEBERG_CATALOG_TEST_DELAYS=1`: a request that carries
//!   `x-iceberg-catalog-test-delay-ms: N` (at most a minute) is held N milliseconds inside
//!   the idempotency layer before the catalog handles it: a slow commit, for the Java
//!   client's fault tests (`examples/tests/java_client.rs`), whose proxy adds the header
//!   to a first attempt and not to its retry.

use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;

const CRASH_AFTER_COMMIT: &str = "ICEBERG_CATALOG_CRASH_AFTER_COMMIT";
const TEST_DELAYS: &str = "ICEBERG_CATALOG_TEST_DELAYS";
const TEST_DELAY_HEADER: &str = "x-iceberg-catalog-test-delay-ms";

fn set(variable: &str) -> bool {
    std::env::var(variable).is_ok_and(|v| v == "1")
}

/// Whether the process aborts after its first committed change.
fn crash_after_commit() -> bool {
    static SET: OnceLock<bool> = OnceLock::new();
    *SET.get_or_init(|| {
        let set = set(CRASH_AFTER_COMMIT);
        if set {
            tracing::warn!(
                "{CRASH_AFTER_COMMIT}=1: the process aborts after its first committed change"
            );
        }
        set
    })
}

/// Called right after a change committed, before its answer is sent.
pub(crate) fn after_commit() {
    if crash_after_commit() {
        tracing::error!("{CRASH_AFTER_COMMIT}=1: aborting after the commit, before answering");
        std::process::abort();
    }
}

/// `routes`, holding requests as [`TEST_DELAY_HEADER`] asks when [`TEST_DELAYS`] is set;
/// also reads the crash switch now, so that its warning is logged at start.
pub(crate) fn install<S: Clone + Send + Sync + 'static>(routes: Router<S>) -> Router<S> {
    crash_after_commit();
    if !set(TEST_DELAYS) {
        return routes;
    }
    tracing::warn!("{TEST_DELAYS}=1: requests with {TEST_DELAY_HEADER} are held that long");
    routes.layer(middleware::from_fn(test_delay))
}

/// Holds a request for the milliseconds its [`TEST_DELAY_HEADER`] asks for.
async fn test_delay(request: Request, next: Next) -> Response {
    let delay = request
        .headers()
        .get(TEST_DELAY_HEADER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if let Some(millis) = delay {
        tokio::time::sleep(Duration::from_millis(millis.min(60_000))).await;
    }
    next.run(request).await
}
