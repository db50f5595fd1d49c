//! The application every benchmark runs: one trivial axum handler, bare or behind a layer.

use axum::Router;
use axum::routing::post;
use http::{HeaderName, StatusCode, header};

/// The path every benchmark request goes to.
pub const PATH: &str = "/orders";

/// The request body every benchmark request carries.
pub const REQUEST_BODY: &str = r#"{"item":"book","quantity":1}"#;

/// The response body of the handler (the same bytes as the peer's server).
pub const RESPONSE_BODY: &str = r#"{"id":"ord_1","status":"created"}"#;

/// The handler: answers `201 Created` with a small JSON body and does nothing else, so
/// that everything measured around it is the cost of what wraps it.
pub async fn create_order() -> (StatusCode, [(HeaderName, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        RESPONSE_BODY,
    )
}

/// The bare application: no idempotency layer.
pub fn bare() -> Router {
    Router::new().route(PATH, post(create_order))
}

/// The application behind `layer`.
pub fn layered(layer: idempotency_core::IdempotencyLayer) -> Router {
    bare().layer(layer)
}
