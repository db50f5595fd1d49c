//! Admin endpoints: inspect an idempotency record, and evict one, on an operator's order.
//!
//! ```text
//! GET    /admin/idempotency/records/{key}                   the default scope (this catalog's)
//! GET    /admin/idempotency/scopes/{scope}/records/{key}    a named scope
//! DELETE (either path)                                      evict; ?force=true for one in flight
//! ```
//!
//! A record is found by (scope, key). This catalog sets no scope, so its records are in
//! the default scope, which is empty: the first path. A service that scopes its keys
//! (per tenant, per principal) names the scope in the second path, percent-encoded like
//! any path segment, so a scope may hold any characters (`tenant%2Fa` is `tenant/a`).
//! The key is normalized as the layer normalizes it (a UUID, lower-cased), so a key
//! copied from a client's log in capitals finds its record.
//!
//! **Off unless the catalog is started with `--admin-token`** (or
//! `ICEBERG_CATALOG_ADMIN_TOKEN`); then every request must carry
//! `Authorization: Bearer <token>`, or gets 401. The token is compared as SHA-256
//! digests in constant time, so neither its content nor its length leaks through timing.
//!
//! What an answer shows: the binding (method, normalized path, SHA-256 of the body),
//! the state (`in-flight` with its lease, or `completed` with the stored status), and
//! the times by the store's clock. **Never the stored response's headers or body**: they
//! belong to whoever sent the request and may hold what only they should see (a token in
//! a create response, another tenant's data), while an admin answer is read by operators
//! and pasted into tickets.
//!
//! Evicting a completed record frees its key: the next request with it runs again. That
//! is the way out when a wrong answer was stored for the whole lifetime. Evicting an
//! in-flight record is refused (409, saying why) unless `?force=true`: its owner may still
//! be running the request, and a retry after the eviction would run it a second time.
//! Every eviction is logged, with the record's hash as the layer's logs show it, never
//! the key.

use std::sync::Arc;
use std::time::SystemTime;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idempotency_core::{
    EvictInFlight, Eviction, InspectedRecord, InspectedState, KeyFormat, RecordAdmin, RecordId,
    UuidKey,
};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The shortest admin token accepted: shorter ones can be guessed.
const MIN_TOKEN_LEN: usize = 16;

/// What the endpoints need: the token's digest (none: the endpoints are off) and the
/// layer's store (none: the catalog runs without the layer).
#[derive(Clone)]
struct Admin {
    token_sha256: Option<[u8; 32]>,
    store: Option<Arc<dyn RecordAdmin>>,
}

/// The admin routes, to be merged in front of the catalog (outside the idempotency
/// layer: an eviction is not itself a keyed mutation). Refuses a token that is too short.
pub(crate) fn router(
    token: Option<&str>,
    store: Option<Arc<dyn RecordAdmin>>,
) -> Result<Router, String> {
    let token_sha256 = match token {
        Some(token) if token.chars().count() < MIN_TOKEN_LEN => {
            return Err(format!(
                "--admin-token must be at least {MIN_TOKEN_LEN} characters long; generate one, \
                 e.g. with `openssl rand -hex 32`"
            ));
        }
        Some(token) => Some(Sha256::digest(token.as_bytes()).into()),
        None => None,
    };
    let admin = Admin {
        token_sha256,
        store,
    };
    Ok(Router::new()
        .route(
            "/admin/idempotency/records/{key}",
            get(inspect_default).delete(evict_default),
        )
        .route(
            "/admin/idempotency/scopes/{scope}/records/{key}",
            get(inspect_scoped).delete(evict_scoped),
        )
        .with_state(admin))
}

#[derive(Debug, Deserialize)]
struct EvictParams {
    force: Option<String>,
}

async fn inspect_default(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Path(key): Path<String>,
) -> Response {
    inspect(&admin, &headers, String::new(), &key).await
}

async fn inspect_scoped(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Path((scope, key)): Path<(String, String)>,
) -> Response {
    inspect(&admin, &headers, scope, &key).await
}

async fn evict_default(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Query<EvictParams>,
) -> Response {
    evict(&admin, &headers, String::new(), &key, params).await
}

async fn evict_scoped(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Path((scope, key)): Path<(String, String)>,
    Query(params): Query<EvictParams>,
) -> Response {
    evict(&admin, &headers, scope, &key, params).await
}

async fn inspect(admin: &Admin, headers: &HeaderMap, scope: String, key: &str) -> Response {
    let (store, id) = match admit(admin, headers, scope, key) {
        Ok(admitted) => admitted,
        Err(refusal) => return refusal.into_response(),
    };
    match store.inspect(&id).await {
        Ok(Some(record)) => (StatusCode::OK, axum::Json(record_json(&id, &record))).into_response(),
        Ok(None) => not_found(),
        Err(error) => store_failed(&error),
    }
}

async fn evict(
    admin: &Admin,
    headers: &HeaderMap,
    scope: String,
    key: &str,
    params: EvictParams,
) -> Response {
    let (store, id) = match admit(admin, headers, scope, key) {
        Ok(admitted) => admitted,
        Err(refusal) => return refusal.into_response(),
    };
    let in_flight = match params.force.as_deref() {
        None | Some("false") => EvictInFlight::Refuse,
        Some("true") => EvictInFlight::Force,
        Some(other) => {
            return Refusal::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("force must be true or false, not {other:?}"),
            )
            .into_response();
        }
    };
    match store.evict(&id, in_flight).await {
        Ok(Eviction::Evicted(record)) => {
            tracing::warn!(
                target: "iceberg_catalog::admin",
                record = %id.log_hash(),
                state = state_name(&record),
                forced = in_flight == EvictInFlight::Force,
                "evicted an idempotency record on an operator's order; the next request with its key runs again"
            );
            let body = json!({"evicted": true, "record": record_json(&id, &record)});
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Ok(Eviction::InFlight(record)) => {
            let message = match record.state {
                InspectedState::InFlight {
                    lease_lapsed: true, ..
                } => "the record is in flight, but its owner stopped renewing its lease (it \
                      crashed or hung): the next retry with this key takes it over and runs the \
                      request. To free the key now anyway, send the DELETE again with \
                      ?force=true; if the owner is in fact still running, the mutation may then \
                      run twice"
                    .to_owned(),
                _ => format!(
                    "the record is in flight: a request with this key is running now (its lease \
                     runs until {}). Evicting it would let a retry run the mutation a second time \
                     while the first may still be running. Wait for it to finish and try again, \
                     or send the DELETE again with ?force=true if you are sure its owner is stuck",
                    lease_end(&record).unwrap_or_else(|| "its next renewal".to_owned())
                ),
            };
            let mut body = error_json(StatusCode::CONFLICT, "RecordInFlight", message);
            body["record"] = record_json(&id, &record);
            (StatusCode::CONFLICT, axum::Json(body)).into_response()
        }
        Ok(Eviction::NotFound) => not_found(),
        Err(error) => store_failed(&error),
    }
}

/// Lets a request in: the endpoints are on, its token matches, the layer runs, and the
/// key is one the layer would store. Otherwise the answer that says which is not so.
fn admit(
    admin: &Admin,
    headers: &HeaderMap,
    scope: String,
    key: &str,
) -> Result<(Arc<dyn RecordAdmin>, RecordId), Refusal> {
    let Some(expected) = &admin.token_sha256 else {
        return Err(Refusal::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the admin endpoints are off; start the catalog with --admin-token (or \
             ICEBERG_CATALOG_ADMIN_TOKEN) to turn them on"
                .to_owned(),
        ));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    let Some(presented) = presented else {
        return Err(Refusal::unauthorized(
            "send the admin token as 'Authorization: Bearer <token>'",
        ));
    };
    let digest: [u8; 32] = Sha256::digest(presented.trim().as_bytes()).into();
    if !bool::from(digest.ct_eq(expected)) {
        return Err(Refusal::unauthorized(
            "the admin token does not match the one this catalog was started with",
        ));
    }
    let Some(store) = &admin.store else {
        return Err(Refusal::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            "this catalog runs without the idempotency layer (--no-idempotency), so it keeps \
             no records"
                .to_owned(),
        ));
    };
    // The layer stores the key as the Iceberg profile normalizes it.
    let key = UuidKey::default()
        .parse(key.trim().as_bytes())
        .map_err(|error| {
            Refusal::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("not a key this catalog stores: {error}"),
            )
        })?;
    Ok((store.clone(), RecordId::new(scope, key)))
}

/// The record as the answers show it: never the stored headers or body.
fn record_json(id: &RecordId, record: &InspectedRecord) -> Value {
    let mut json = json!({
        "scope": id.scope,
        "key": id.key,
        "state": state_name(record),
        "binding": {
            "method": record.binding.method,
            "path": record.binding.path,
            "body_sha256": hex(&record.binding.body_sha256),
        },
        "created_at": rfc3339(record.created_at),
        "expires_at": rfc3339(record.expires_at),
        "inspected_at": rfc3339(record.inspected_at),
    });
    match record.state {
        InspectedState::InFlight {
            lease_lapsed,
            lease_expires_at,
        } => {
            json["lease_lapsed"] = json!(lease_lapsed);
            json["lease_expires_at"] = rfc3339(lease_expires_at);
        }
        InspectedState::Completed { status } => json["status"] = json!(status),
    }
    json
}

fn state_name(record: &InspectedRecord) -> &'static str {
    match record.state {
        InspectedState::InFlight { .. } => "in-flight",
        InspectedState::Completed { .. } => "completed",
    }
}

fn lease_end(record: &InspectedRecord) -> Option<String> {
    match record.state {
        InspectedState::InFlight {
            lease_expires_at: Some(at),
            ..
        } => rfc3339(Some(at)).as_str().map(str::to_owned),
        _ => None,
    }
}

fn rfc3339(time: Option<SystemTime>) -> Value {
    time.map_or(Value::Null, |time| {
        let time: chrono::DateTime<chrono::Utc> = time.into();
        json!(time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn error_json(status: StatusCode, kind: &str, message: String) -> Value {
    json!({"error": {"code": status.as_u16(), "type": kind, "message": message}})
}

/// An answer that refuses the request, with what was wrong and what to do.
struct Refusal {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, kind: &'static str, message: String) -> Self {
        Self {
            status,
            kind,
            message,
        }
    }

    fn unauthorized(message: &str) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "NotAuthorized",
            message.to_owned(),
        )
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = error_json(self.status, self.kind, self.message);
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idempotency-admin\""),
            );
        }
        response
    }
}

fn not_found() -> Response {
    Refusal::new(
        StatusCode::NOT_FOUND,
        "NoSuchRecord",
        "no live record holds this scope and key: it was never stored, or it was released, \
         evicted or has expired"
            .to_owned(),
    )
    .into_response()
}

fn store_failed(failure: &idempotency_core::StoreError) -> Response {
    Refusal::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "StoreUnavailable",
        format!("the idempotency store failed ({failure}); try again"),
    )
    .into_response()
}
