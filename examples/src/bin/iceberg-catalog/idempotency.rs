//! The Idempotency-Key layer in front of the catalog, and the store it keeps its records
//! in.
//!
//! TODO(iceberg-profile): until `idempotency_core::iceberg` lands on main, this module
//! configures the generic layer the way the Iceberg profile will (UUID keys, Iceberg
//! `ErrorModel` errors, 503 while a duplicate is in flight) and parses/formats the
//! lifetime itself; the config handler advertises `idempotency-key-lifetime`. After the
//! merge: `IdempotencyLayer::iceberg(store)`, `iceberg::parse_lifetime`/`format_lifetime`,
//! and the layer adds the config field.
//!
//! TODO(sql-store): until `idempotency-store-sql` lands, records are kept in memory, so
//! replicas do not share them and a restart forgets them.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode, header};
use idempotency_core::error::Rejection;
use idempotency_core::{IdempotencyLayer, UuidKey};
use idempotency_store_memory::MemoryStore;

/// The layer for `database_url`'s catalog, keeping keys for `lifetime`.
pub(crate) async fn layer(
    _database_url: &str,
    lifetime: Duration,
) -> Result<IdempotencyLayer, Box<dyn std::error::Error + Send + Sync>> {
    let store = MemoryStore::new();
    Ok(IdempotencyLayer::new(store)
        .with_lifetime(lifetime)
        .with_key_format(UuidKey::any_version())
        .with_in_flight_status(StatusCode::SERVICE_UNAVAILABLE)
        .with_routes(|_method: &Method, path: &str| {
            path.starts_with("/v1/") && !path.ends_with("/metrics")
        })
        .with_error_renderer(render_error_model))
}

/// The layer's own refusals as Iceberg `ErrorModel` JSON.
fn render_error_model(rejection: &Rejection) -> Response<Bytes> {
    let kind = match rejection.status.as_u16() {
        400 => "BadRequestException",
        409 => "CommitFailedException",
        413 => "BadRequestException",
        422 => "UnprocessableEntityException",
        503 => "ServiceUnavailableException",
        _ => "ServiceFailureException",
    };
    let body = serde_json::json!({
        "error": {
            "message": rejection.message,
            "type": kind,
            "code": rejection.status.as_u16(),
        }
    });
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = rejection.status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Parses the ISO-8601 durations `java.time.Duration.parse` accepts that a lifetime needs:
/// `PT30M`, `PT1H30M`, `P1D`, `PT90S`.
pub(crate) fn parse_lifetime(text: &str) -> Result<Duration, String> {
    let error = || format!("invalid ISO-8601 duration {text:?} (expected e.g. PT30M, PT1H, P1D)");
    let upper = text.trim().to_ascii_uppercase();
    let rest = upper.strip_prefix('P').ok_or_else(error)?;
    let (days, time) = match rest.split_once('T') {
        Some((days, time)) if !time.is_empty() => (days, time),
        Some(_) => return Err(error()),
        None => (rest, ""),
    };
    let mut seconds = 0u64;
    if !days.is_empty() {
        let n: u64 = days
            .strip_suffix('D')
            .ok_or_else(error)?
            .parse()
            .map_err(|_| error())?;
        seconds += n * 86_400;
    }
    let mut number = String::new();
    for c in time.chars() {
        match c {
            '0'..='9' => number.push(c),
            'H' | 'M' | 'S' => {
                let n: u64 = number.parse().map_err(|_| error())?;
                number.clear();
                seconds += n * match c {
                    'H' => 3600,
                    'M' => 60,
                    _ => 1,
                };
            }
            _ => return Err(error()),
        }
    }
    if !number.is_empty() || (days.is_empty() && time.is_empty()) {
        return Err(error());
    }
    Ok(Duration::from_secs(seconds))
}

/// Formats a lifetime as `java.time.Duration.parse` reads it back: `PT30M`, `PT1H30M`.
pub(crate) fn format_lifetime(lifetime: Duration) -> String {
    let total = lifetime.as_secs();
    if total == 0 {
        return "PT0S".to_owned();
    }
    let (hours, minutes, seconds) = (total / 3600, total % 3600 / 60, total % 60);
    let mut out = String::from("PT");
    if hours > 0 {
        out.push_str(&format!("{hours}H"));
    }
    if minutes > 0 {
        out.push_str(&format!("{minutes}M"));
    }
    if seconds > 0 {
        out.push_str(&format!("{seconds}S"));
    }
    out
}
