//! Property-based fuzzing of the hostile-input surface: the key parsers, the Iceberg
//! route classification, and whole requests with arbitrary key headers through the
//! layer. Runs in CI with the default case count; for a longer run:
//!
//! ```sh
//! PROPTEST_CASES=100000 cargo test -p idempotency-core --test fuzz --release
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode};
use axum::routing::post;
use idempotency_core::{KeyFormat, OpaqueKey, UuidKey};
use idempotency_iceberg::operation;
use idempotency_store_memory::MemoryStore;
use proptest::prelude::*;
use tower::ServiceExt;

proptest! {
    #[test]
    fn opaque_keys_are_accepted_exactly_when_short_and_printable(value in proptest::collection::vec(any::<u8>(), 0..600)) {
        match OpaqueKey.parse(&value) {
            Ok(key) => {
                prop_assert!(!value.is_empty() && value.len() <= 255);
                prop_assert!(value.iter().all(|b| (0x20..0x7f).contains(b)));
                prop_assert_eq!(key.as_bytes(), &value[..]);
            }
            Err(error) => {
                prop_assert!(value.is_empty() || value.len() > 255 || value.iter().any(|b| !(0x20..0x7f).contains(b)));
                prop_assert!(!error.to_string().is_empty());
            }
        }
    }

    #[test]
    fn uuid_keys_accept_any_case_of_a_valid_uuid(bytes in any::<[u8; 16]>(), upper in any::<bool>()) {
        let mut bytes = bytes;
        bytes[8] = (bytes[8] & 0x3f) | 0x80; // RFC 9562 variant
        let uuid = uuid::Uuid::from_bytes(bytes).hyphenated().to_string();
        let sent = if upper { uuid.to_ascii_uppercase() } else { uuid.clone() };
        prop_assert_eq!(UuidKey::any_version().parse(sent.as_bytes()).unwrap(), uuid);
    }

    #[test]
    fn uuid_parser_never_accepts_what_is_not_a_lowercased_uuid(value in "[0-9a-fA-F-]{30,40}|\\PC{0,50}") {
        if let Ok(key) = UuidKey::any_version().parse(value.as_bytes()) {
            prop_assert_eq!(key.len(), 36);
            prop_assert!(uuid::Uuid::parse_str(&key).is_ok());
            prop_assert_eq!(key.to_ascii_lowercase(), key.clone());
            prop_assert_eq!(value.to_ascii_lowercase(), key);
        }
    }

    #[test]
    fn route_classification_never_panics_and_ignores_reads(path in "(/[a-z0-9%{}._-]{0,12}){0,9}", method in prop::sample::select(vec!["GET", "HEAD", "POST", "DELETE", "PUT"])) {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let found = operation(&method, &path);
        if method == Method::GET || method == Method::HEAD || method == Method::PUT {
            prop_assert_eq!(found, None);
        }
        if found.is_some() {
            prop_assert!(path.split('/').any(|s| s == "v1"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever bytes arrive as the key header, the handler runs only for a valid key,
    /// and an invalid one (an empty or blank one included) gets 400.
    #[test]
    fn arbitrary_key_headers_never_reach_the_handler_unless_valid(raw in proptest::collection::vec(any::<u8>(), 0..400)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let Ok(value) = HeaderValue::from_bytes(&raw) else { return Ok(()) };
            let calls = Arc::new(AtomicUsize::new(0));
            let counted = calls.clone();
            let app = Router::new()
                .route("/v1/namespaces", post(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async { "{}" }
                }))
                .layer(idempotency_iceberg::layer(MemoryStore::new()));
            let request = Request::post("/v1/namespaces")
                .header("idempotency-key", value)
                .body(Body::from("{}"))
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let trimmed = raw.trim_ascii();
            let valid = UuidKey::any_version().parse(trimmed).is_ok();
            if valid {
                prop_assert_eq!(response.status(), StatusCode::OK);
                prop_assert_eq!(calls.load(Ordering::SeqCst), 1);
            } else {
                prop_assert_eq!(response.status(), StatusCode::BAD_REQUEST);
                prop_assert_eq!(calls.load(Ordering::SeqCst), 0);
            }
            Ok(())
        })?;
    }
}
