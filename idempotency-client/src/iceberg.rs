//! The key lifetime an Iceberg REST catalog advertises, so that retries stop before it.
//!
//! A catalog that takes keys says so in `GET /v1/config`, with
//! `"idempotency-key-lifetime": "PT30M"` at the top level of the answer. A catalog without
//! the field ignores keys: retrying a mutation there can run it twice.

use std::future::poll_fn;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower_service::Service;

use crate::body::ResendBody;
use crate::error::BoxError;

/// The largest config answer read.
const MAX_CONFIG_BYTES: usize = 1024 * 1024;

/// Reads `idempotency-key-lifetime` from a `GET /v1/config` answer's JSON body: `None` when
/// the catalog does not advertise one (it ignores keys).
///
/// ```
/// use std::time::Duration;
///
/// let config = br#"{"defaults": {}, "overrides": {}, "idempotency-key-lifetime": "PT30M"}"#;
/// let lifetime = idempotency_client::iceberg::key_lifetime(config).unwrap();
/// assert_eq!(lifetime, Some(Duration::from_secs(30 * 60)));
/// ```
pub fn key_lifetime(config: &[u8]) -> Result<Option<Duration>, BoxError> {
    let config: serde_json::Value = serde_json::from_slice(config)
        .map_err(|error| format!("the catalog's config answer is not JSON: {error}"))?;
    let Some(lifetime) = config.get("idempotency-key-lifetime") else {
        return Ok(None);
    };
    let text = lifetime.as_str().unwrap_or_default();
    parse_duration(text).map(Some).ok_or_else(|| {
        format!("the catalog's idempotency-key-lifetime {lifetime} is not an ISO-8601 duration such as PT30M").into()
    })
}

/// Asks the catalog at `config_uri` (its `…/v1/config`) for its key lifetime, through any
/// HTTP client service (a hyper-util client, or a client already wrapped by the layer:
/// a `GET` is never retried).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use hyper_util::{client::legacy::Client, rt::TokioExecutor};
/// use idempotency_client::{IdempotentRetryLayer, iceberg};
///
/// let mut client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
/// let config = "http://127.0.0.1:8181/v1/config".parse()?;
/// let lifetime = iceberg::fetch_key_lifetime(&mut client, config).await?
///     .ok_or("the catalog ignores idempotency keys")?;
/// let layer = IdempotentRetryLayer::new().with_key_lifetime(lifetime);
/// # Ok(()) }
/// ```
pub async fn fetch_key_lifetime<S, ReqBody, ResBody>(
    client: &mut S,
    config_uri: Uri,
) -> Result<Option<Duration>, BoxError>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ReqBody: ResendBody,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let request = Request::get(config_uri.clone())
        .header(http::header::ACCEPT, "application/json")
        .body(ReqBody::from_bytes(Bytes::new()))?;
    poll_fn(|cx| client.poll_ready(cx))
        .await
        .map_err(Into::into)?;
    let response = client.call(request).await.map_err(Into::into)?;
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_CONFIG_BYTES)
        .collect()
        .await?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("GET {config_uri} answered {status}").into());
    }
    key_lifetime(&body)
}

/// An ISO-8601 duration as `java.time.Duration` writes and parses it: `PnDTnHnMn.nS`, each
/// part optional but at least one present, no sign (a lifetime is positive).
fn parse_duration(text: &str) -> Option<Duration> {
    let rest = text.strip_prefix(['P', 'p'])?;
    let (days, time) = match rest.find(['T', 't']) {
        Some(at) => (&rest[..at], Some(&rest[at + 1..])),
        None => (rest, None),
    };
    let mut seconds = 0f64;
    let mut parts = 0;
    if !days.is_empty() {
        seconds += days.strip_suffix(['D', 'd'])?.parse::<u32>().ok()? as f64 * 86_400.0;
        parts += 1;
    }
    if let Some(mut time) = time {
        for (unit, scale) in [('H', 3600.0), ('M', 60.0), ('S', 1.0)] {
            let Some(at) = time.find([unit, unit.to_ascii_lowercase()]) else {
                continue;
            };
            let number = &time[..at];
            if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
                return None;
            }
            if unit != 'S' && number.contains('.') {
                return None;
            }
            seconds += number.parse::<f64>().ok()? * scale;
            time = &time[at + 1..];
            parts += 1;
        }
        if !time.is_empty() {
            return None;
        }
    }
    (parts > 0).then(|| Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_as_java_writes_them() {
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(parse_duration("PT30M"), secs(1800));
        assert_eq!(parse_duration("PT1H"), secs(3600));
        assert_eq!(parse_duration("PT1H30M5S"), secs(5405));
        assert_eq!(parse_duration("P1D"), secs(86_400));
        assert_eq!(parse_duration("P1DT2S"), secs(86_402));
        assert_eq!(parse_duration("PT0.5S"), Some(Duration::from_millis(500)));
        for bad in [
            "", "P", "PT", "30M", "PT-1S", "P1W", "PT1.5M", "PT5X", "PT5M3",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn config_answers() {
        assert_eq!(
            key_lifetime(br#"{"defaults":{},"overrides":{}}"#).unwrap(),
            None
        );
        assert_eq!(
            key_lifetime(br#"{"idempotency-key-lifetime":"PT2M"}"#).unwrap(),
            Some(Duration::from_secs(120))
        );
        let error = key_lifetime(br#"{"idempotency-key-lifetime":"soon"}"#).unwrap_err();
        assert!(error.to_string().contains("\"soon\""), "{error}");
        assert!(key_lifetime(b"<html>").is_err());
    }
}
