//! The Apache Iceberg REST catalog profile.
//!
//! [`IdempotencyLayer::iceberg`] sets the layer up the way the Iceberg REST spec and its
//! clients expect:
//!
//! - **Routes**: the spec's mutation operations that take the header ([`operation`]),
//!   with and without a `{prefix}` segment, plus `createView`. Other requests pass through.
//! - **Keys**: hyphenated UUIDs, any version, lower-cased ([`UuidKey`]); use
//!   `.with_key_format(UuidKey::v7_only())` to demand version 7.
//! - **Errors** as Iceberg `ErrorModel` JSON ([`IcebergErrorModel`]).
//! - **In flight**: 503 with `Retry-After` instead of 409, because the Java client resends
//!   a 503 with the same key but turns a 409 on a commit into a definite
//!   `CommitFailedException`, and may then delete files the running commit needs.
//! - **A response too large to store**: replayed as 500 `CommitStateUnknownException`,
//!   the truth from the client's side (it ran, its answer is gone); Java clients keep
//!   their files on that exception.
//! - **Advertising**: `GET /v1/config` answers get a top-level
//!   `"idempotency-key-lifetime": "PT30M"` (the layer's lifetime, in a form
//!   `java.time.Duration.parse` accepts). Catalogs that build their config response
//!   themselves can call [`advertise_lifetime`] instead. When idempotency is disabled,
//!   don't add the layer at all: the field is then absent and the header ignored.
//! - **Vended credentials** are never stored: before a table-loading answer (createTable,
//!   registerTable) is stored, secret `config` entries (`s3.secret-access-key`,
//!   `s3.session-token`, …) and `storage-credentials` are removed. A replay then loads the
//!   table through the inner service with the retry's own headers (so with its own
//!   authorization) and puts the fresh credentials into the replayed answer; the spec
//!   allows a replay to reflect newer catalog state. If that load fails, the replay goes
//!   out without credentials and the client must call `loadTable` or `loadCredentials`.
//!
//! Wrap the **whole router**, not each route, so that a replay can reach `loadTable`:
//! axum's `Router::layer` wraps every route on its own, and a createTable route cannot
//! load a table. Everything else works either way.
//!
//! ```
//! use idempotency_core::IdempotencyLayer;
//! use idempotency_store_memory::MemoryStore;
//! use tower_layer::Layer;
//!
//! let catalog: axum::Router = axum::Router::new(); // your Iceberg REST routes
//! let app: axum::Router = axum::Router::new()
//!     .fallback_service(IdempotencyLayer::iceberg(MemoryStore::new()).layer(catalog));
//! ```

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use serde_json::{Map, Value};

use crate::error::{ErrorRenderer, Rejection, RejectionKind, json_response};
use crate::key::UuidKey;
use crate::layer::IdempotencyLayer;
use crate::policy::RouteFilter;
use crate::store::IdempotencyStore;

/// The config response field that advertises idempotency support.
pub const LIFETIME_FIELD: &str = "idempotency-key-lifetime";

impl IdempotencyLayer {
    /// A layer configured for an Iceberg REST catalog; see the [module docs](crate::iceberg).
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use std::time::Duration;
    /// let layer = IdempotencyLayer::iceberg(MemoryStore::new()).with_lifetime(Duration::from_secs(3600));
    /// ```
    pub fn iceberg(store: impl IdempotencyStore) -> Self {
        Self::new(store).into_iceberg()
    }

    /// Applies the Iceberg profile to a layer built from a shared store.
    pub fn into_iceberg(self) -> Self {
        self.with_key_format(UuidKey::any_version())
            .with_routes(IcebergRoutes)
            .with_error_renderer(IcebergErrorModel)
            .with_in_flight_status(StatusCode::SERVICE_UNAVAILABLE)
            .with_not_stored_status(StatusCode::INTERNAL_SERVER_ERROR)
            .with_iceberg_behaviour()
    }
}

/// The Iceberg operation a mutation is, by its method and path, or `None` if it is not
/// one that takes an `Idempotency-Key`. Paths may carry a `{prefix}` after `/v1`, and
/// anything before `/v1` (a base path) is ignored.
///
/// ```
/// use http::Method;
/// use idempotency_core::iceberg::operation;
///
/// assert_eq!(operation(&Method::POST, "/v1/namespaces/db/tables"), Some("createTable"));
/// assert_eq!(operation(&Method::POST, "/v1/warehouse-1/namespaces/db/tables/t"), Some("updateTable"));
/// assert_eq!(operation(&Method::POST, "/v1/namespaces/db/tables/t/metrics"), None);
/// ```
pub fn operation(method: &Method, path: &str) -> Option<&'static str> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let v1 = segments.iter().position(|s| *s == "v1")?;
    let rest = &segments[v1 + 1..];
    // Without a prefix first; then with the first segment as the prefix.
    match_operation(method, rest).or_else(|| match_operation(method, rest.get(1..)?))
}

fn match_operation(method: &Method, rest: &[&str]) -> Option<&'static str> {
    let post = *method == Method::POST;
    let delete = *method == Method::DELETE;
    Some(match rest {
        ["namespaces"] if post => "createNamespace",
        ["namespaces", _] if delete => "dropNamespace",
        ["namespaces", _, "properties"] if post => "updateProperties",
        ["namespaces", _, "tables"] if post => "createTable",
        ["namespaces", _, "register"] if post => "registerTable",
        ["namespaces", _, "register-view"] if post => "registerView",
        ["namespaces", _, "views"] if post => "createView",
        ["namespaces", _, "tables", _] if post => "updateTable",
        ["namespaces", _, "tables", _] if delete => "dropTable",
        ["namespaces", _, "tables", _, "plan"] if post => "planTableScan",
        ["namespaces", _, "tables", _, "plan", _] if delete => "cancelPlanning",
        ["namespaces", _, "tables", _, "tasks"] if post => "fetchScanTasks",
        ["namespaces", _, "tables", _, "unregister"] if post => "unregisterTable",
        ["namespaces", _, "views", _] if post => "replaceView",
        ["namespaces", _, "views", _] if delete => "dropView",
        ["tables", "rename"] if post => "renameTable",
        ["views", "rename"] if post => "renameView",
        ["transactions", "commit"] if post => "commitTransaction",
        _ => return None,
    })
}

/// The [`RouteFilter`] of the Iceberg profile: the operations [`operation`] knows.
#[derive(Clone, Copy, Debug, Default)]
pub struct IcebergRoutes;

impl RouteFilter for IcebergRoutes {
    fn takes_part(&self, method: &Method, path: &str) -> bool {
        operation(method, path).is_some()
    }
}

/// Renders the layer's answers as Iceberg `ErrorModel` JSON:
/// `{"error": {"message": …, "type": …, "code": …}}`.
#[derive(Clone, Copy, Debug, Default)]
pub struct IcebergErrorModel;

impl ErrorRenderer for IcebergErrorModel {
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        let error_type = match rejection.kind {
            RejectionKind::MissingKey
            | RejectionKind::InvalidKey
            | RejectionKind::DuplicateKeyHeader
            | RejectionKind::UnreadableBody => "BadRequestException",
            RejectionKind::KeyReused => "IdempotencyKeyReusedException",
            RejectionKind::BodyTooLarge => "RequestTooLargeException",
            RejectionKind::InFlight => "IdempotencyKeyInFlightException",
            RejectionKind::StoreUnavailable | RejectionKind::StoreFull => {
                "ServiceUnavailableException"
            }
            // The request may have run: for a commit, its state is unknown to the client.
            RejectionKind::ResponseNotStored | RejectionKind::ResponseFailed => {
                "CommitStateUnknownException"
            }
        };
        let body = serde_json::json!({
            "error": {
                "message": rejection.message,
                "type": error_type,
                "code": rejection.status.as_u16(),
            }
        });
        json_response(rejection.status, "application/json", &body)
    }
}

/// Formats a lifetime as an ISO-8601 duration that `java.time.Duration.parse` accepts:
/// hours, minutes and seconds only (`PT30M`, `PT1H`, `PT36H`, `PT1.5S`), never days,
/// weeks, months or years.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::iceberg::format_lifetime;
///
/// assert_eq!(format_lifetime(Duration::from_secs(30 * 60)), "PT30M");
/// assert_eq!(format_lifetime(Duration::from_secs(90_061)), "PT25H1M1S");
/// assert_eq!(format_lifetime(Duration::from_millis(1500)), "PT1.5S");
/// ```
pub fn format_lifetime(lifetime: Duration) -> String {
    let total = lifetime.as_secs();
    let (hours, minutes, seconds) = (total / 3600, total % 3600 / 60, total % 60);
    let nanos = lifetime.subsec_nanos();
    let mut out = String::from("PT");
    if hours > 0 {
        let _ = write!(out, "{hours}H");
    }
    if minutes > 0 {
        let _ = write!(out, "{minutes}M");
    }
    if seconds > 0 || nanos > 0 || total == 0 {
        let _ = write!(out, "{seconds}");
        if nanos > 0 {
            let fraction = format!("{nanos:09}");
            let _ = write!(out, ".{}", fraction.trim_end_matches('0'));
        }
        out.push('S');
    }
    out
}

/// Why a lifetime string is not a duration this crate accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{value:?} is not an ISO-8601 duration of days, hours, minutes and seconds ({reason}); write it like PT30M, PT1H or P1DT12H"
)]
pub struct LifetimeError {
    value: String,
    reason: &'static str,
}

impl LifetimeError {
    /// What is wrong with the value, in a few words.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

/// Parses an ISO-8601 duration in the form `java.time.Duration.parse` accepts:
/// `PnDTnHnMn.nS`, each part optional but at least one present, case-insensitive.
/// Weeks, months and years are refused (their length is not fixed), and so are
/// negative durations.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::iceberg::parse_lifetime;
///
/// assert_eq!(parse_lifetime("PT30M").unwrap(), Duration::from_secs(1800));
/// assert_eq!(parse_lifetime("p1dt0.5s").unwrap(), Duration::from_millis(86_400_500));
/// assert!(parse_lifetime("P1W").is_err());
/// ```
pub fn parse_lifetime(value: &str) -> Result<Duration, LifetimeError> {
    let error = |reason| LifetimeError {
        value: value.to_owned(),
        reason,
    };
    let upper = value.trim().to_ascii_uppercase();
    if upper.starts_with('-') {
        return Err(error("a negative duration cannot be a lifetime"));
    }
    let body = upper
        .strip_prefix('P')
        .ok_or_else(|| error("it must start with P"))?;
    let (date, time) = match body.split_once('T') {
        Some((_, "")) => return Err(error("nothing follows T")),
        Some((date, time)) => (date, Some(time)),
        None => (body, None),
    };
    let mut total = Duration::ZERO;
    let mut parts = 0;
    let mut take = |text: &str, units: &[(char, u64)]| -> Result<(), LifetimeError> {
        let mut rest = text;
        let mut last_unit = None;
        while !rest.is_empty() {
            let end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(|| error("a number has no unit"))?;
            let (number, tail) = rest.split_at(end);
            let unit = tail.chars().next().expect("find stopped at a char");
            let position = units
                .iter()
                .position(|(u, _)| *u == unit)
                .ok_or_else(|| {
                    error("only D, H, M and S units are allowed: weeks, months and years have no fixed length")
                })?;
            if last_unit.is_some_and(|last| position <= last) {
                return Err(error("units must come in the order D, H, M, S, once each"));
            }
            last_unit = Some(position);
            let seconds_per_unit = units[position].1;
            let amount = if unit == 'S' {
                number
                    .parse::<f64>()
                    .ok()
                    .filter(|n| n.is_finite())
                    .map(Duration::from_secs_f64)
            } else {
                number
                    .parse::<u64>()
                    .ok()
                    .and_then(|n| n.checked_mul(seconds_per_unit))
                    .map(Duration::from_secs)
            }
            .ok_or_else(|| error("a number is malformed or too large"))?;
            total = total
                .checked_add(amount)
                .ok_or_else(|| error("the duration is too large"))?;
            parts += 1;
            rest = &tail[1..];
        }
        Ok(())
    };
    take(date, &[('D', 86_400)])?;
    if let Some(time) = time {
        take(time, &[('H', 3600), ('M', 60), ('S', 1)])?;
    }
    if parts == 0 {
        return Err(error("it has no parts"));
    }
    Ok(total)
}

/// Adds the top-level `idempotency-key-lifetime` field to a `GET /v1/config` response
/// body, for catalogs that build it themselves. It goes beside `defaults` and
/// `overrides`, not inside them: clients only look for it at the top level.
///
/// ```
/// use std::time::Duration;
/// use idempotency_core::iceberg::advertise_lifetime;
///
/// let mut config = serde_json::json!({"defaults": {}, "overrides": {}});
/// advertise_lifetime(&mut config, Duration::from_secs(1800));
/// assert_eq!(config["idempotency-key-lifetime"], "PT30M");
/// ```
pub fn advertise_lifetime(config: &mut Value, lifetime: Duration) {
    if let Value::Object(fields) = config {
        fields.insert(
            LIFETIME_FIELD.to_owned(),
            Value::String(format_lifetime(lifetime)),
        );
    }
}

/// Whether `path` is the catalog's config endpoint.
pub(crate) fn is_config_path(path: &str) -> bool {
    path.trim_end_matches('/').ends_with("/v1/config")
}

/// The config response body with the lifetime added, or `None` to leave it as it was.
pub(crate) fn add_lifetime_to_body(body: &[u8], lifetime: Duration) -> Option<Bytes> {
    let mut config: Value = serde_json::from_slice(body).ok()?;
    if !config.is_object() {
        return None;
    }
    advertise_lifetime(&mut config, lifetime);
    serde_json::to_vec(&config).ok().map(Bytes::from)
}

/// Operations whose answer is a `LoadTableResult`, which may carry vended credentials.
fn loads_a_table(method: &Method, path: &str) -> bool {
    matches!(
        operation(method, path),
        Some("createTable" | "registerTable")
    )
}

fn is_secret_config_key(key: &str) -> bool {
    const SECRET_MARKERS: [&str; 8] = [
        "secret",
        "token",
        "password",
        "access-key",
        "sas-",
        "shared-key",
        "credential",
        "private-key",
    ];
    let key = key.to_ascii_lowercase();
    SECRET_MARKERS.iter().any(|marker| key.contains(marker))
}

/// The answer of a table-loading operation with its vended credentials removed, or
/// `None` when there was nothing to remove (or it is not such an answer).
pub(crate) fn strip_credentials(method: &Method, path: &str, body: &[u8]) -> Option<Bytes> {
    if !loads_a_table(method, path) {
        return None;
    }
    let mut result: Value = serde_json::from_slice(body).ok()?;
    let fields = result.as_object_mut()?;
    // Only a real secret is worth re-serializing for: otherwise the stored bytes stay
    // exactly the ones the client got.
    let has_credentials = fields
        .get("storage-credentials")
        .is_some_and(|c| c.as_array().is_none_or(|c| !c.is_empty()));
    let mut removed = has_credentials && fields.remove("storage-credentials").is_some();
    if let Some(Value::Object(config)) = fields.get_mut("config") {
        let before = config.len();
        config.retain(|key, _| !is_secret_config_key(key));
        removed |= config.len() != before;
    }
    if !removed {
        return None;
    }
    serde_json::to_vec(&result).ok().map(Bytes::from)
}

/// The path of the `loadTable` call that refreshes the credentials of a replayed
/// table-loading answer: the table the original request created or registered.
pub(crate) fn credentials_reload_path(method: &Method, path: &str, body: &[u8]) -> Option<String> {
    if !loads_a_table(method, path) {
        return None;
    }
    let request: Value = serde_json::from_slice(body).ok()?;
    let name = request.get("name")?.as_str()?;
    let encoded: String = name
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect();
    let base = path.strip_suffix("/register").unwrap_or(path);
    let tables = if base.ends_with("/tables") {
        base.to_owned()
    } else {
        format!("{base}/tables")
    };
    Some(format!("{tables}/{encoded}"))
}

/// The replayed answer with the fresh credentials of a `loadTable` answer put back.
pub(crate) fn merge_fresh_credentials(stored: &[u8], fresh: &[u8]) -> Option<Bytes> {
    let mut replay: Value = serde_json::from_slice(stored).ok()?;
    let fresh: Value = serde_json::from_slice(fresh).ok()?;
    let replay_fields = replay.as_object_mut()?;
    if let Some(credentials) = fresh.get("storage-credentials") {
        replay_fields.insert("storage-credentials".to_owned(), credentials.clone());
    }
    if let Some(Value::Object(fresh_config)) = fresh.get("config") {
        let config = replay_fields
            .entry("config")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(config) = config {
            for (key, value) in fresh_config {
                if is_secret_config_key(key) {
                    config.insert(key.clone(), value.clone());
                }
            }
        }
    }
    serde_json::to_vec(&replay).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spec_operation_is_recognised_with_and_without_a_prefix() {
        let cases = [
            ("POST", "namespaces", "createNamespace"),
            ("DELETE", "namespaces/db", "dropNamespace"),
            ("POST", "namespaces/db/properties", "updateProperties"),
            ("POST", "namespaces/db/tables", "createTable"),
            ("POST", "namespaces/db/register", "registerTable"),
            ("POST", "namespaces/db/tables/t", "updateTable"),
            ("DELETE", "namespaces/db/tables/t", "dropTable"),
            ("POST", "tables/rename", "renameTable"),
            ("POST", "transactions/commit", "commitTransaction"),
            ("POST", "namespaces/db/views", "createView"),
            ("POST", "namespaces/db/views/v", "replaceView"),
            ("DELETE", "namespaces/db/views/v", "dropView"),
            ("POST", "views/rename", "renameView"),
            ("POST", "namespaces/db/register-view", "registerView"),
            ("POST", "namespaces/db/tables/t/plan", "planTableScan"),
            ("DELETE", "namespaces/db/tables/t/plan/p1", "cancelPlanning"),
            ("POST", "namespaces/db/tables/t/tasks", "fetchScanTasks"),
            (
                "POST",
                "namespaces/db/tables/t/unregister",
                "unregisterTable",
            ),
        ];
        assert_eq!(cases.len(), 18);
        for (method, rest, expected) in cases {
            let method = Method::from_bytes(method.as_bytes()).unwrap();
            for path in [
                format!("/v1/{rest}"),
                format!("/v1/my-prefix/{rest}"),
                format!("/catalog/v1/{rest}"),
            ] {
                assert_eq!(operation(&method, &path), Some(expected), "{method} {path}");
            }
        }
    }

    #[test]
    fn reads_and_other_posts_are_not_operations() {
        for (method, path) in [
            (Method::GET, "/v1/namespaces/db/tables/t"),
            (Method::HEAD, "/v1/namespaces/db"),
            (Method::POST, "/v1/namespaces/db/tables/t/metrics"),
            (Method::POST, "/v1/namespaces/db/tables/t/sign"),
            (Method::POST, "/v1/oauth/tokens"),
            (Method::GET, "/v1/config"),
            (Method::POST, "/v2/namespaces"),
        ] {
            assert_eq!(operation(&method, path), None, "{method} {path}");
        }
    }

    #[test]
    fn lifetimes_round_trip() {
        for (text, seconds) in [
            ("PT30M", 1800.0),
            ("PT1H", 3600.0),
            ("PT24H", 86_400.0),
            ("PT1H30M5S", 5405.0),
            ("PT0.25S", 0.25),
            ("PT0S", 0.0),
        ] {
            let parsed = parse_lifetime(text).unwrap();
            assert_eq!(parsed.as_secs_f64(), seconds, "{text}");
            assert_eq!(format_lifetime(parsed), text);
        }
        assert_eq!(parse_lifetime("P2D").unwrap(), Duration::from_secs(172_800));
        assert_eq!(format_lifetime(Duration::from_secs(172_800)), "PT48H");
    }

    #[test]
    fn bad_lifetimes_say_what_is_wrong() {
        for (text, reason) in [
            ("30M", "start with P"),
            ("P1W", "only D, H, M and S"),
            ("P1M", "only D, H, M and S"),
            ("PT", "nothing follows T"),
            ("P", "no parts"),
            ("PT5", "no unit"),
            ("PT1M1H", "order"),
            ("-PT1M", "negative"),
            ("PT99999999999999999999H", "too large"),
        ] {
            let error = parse_lifetime(text).unwrap_err().to_string();
            assert!(error.contains(reason), "{text}: {error}");
            assert!(error.contains("PT30M"), "{error}");
        }
    }

    #[test]
    fn credentials_are_stripped_from_table_loading_answers_only() {
        let answer = serde_json::json!({
            "metadata-location": "file:///w/db/t/metadata/1.json",
            "metadata": {"format-version": 2},
            "config": {"s3.access-key-id": "AKIA", "s3.secret-access-key": "SECRET",
                       "s3.session-token": "TOKEN", "s3.region": "eu-west-1"},
            "storage-credentials": [{"prefix": "s3://b", "config": {"s3.secret-access-key": "SECRET"}}]
        })
        .to_string();
        let stripped =
            strip_credentials(&Method::POST, "/v1/namespaces/db/tables", answer.as_bytes())
                .unwrap();
        let text = String::from_utf8(stripped.to_vec()).unwrap();
        for secret in ["SECRET", "TOKEN", "AKIA", "storage-credentials"] {
            assert!(!text.contains(secret), "{secret} left in {text}");
        }
        assert!(text.contains("eu-west-1"), "non-secret config must stay");
        assert!(
            strip_credentials(
                &Method::POST,
                "/v1/namespaces/db/tables/t",
                answer.as_bytes()
            )
            .is_none(),
            "commit answers are not table-loading answers"
        );
        let merged = merge_fresh_credentials(&stripped, answer.as_bytes()).unwrap();
        let merged: Value = serde_json::from_slice(&merged).unwrap();
        assert_eq!(merged["config"]["s3.secret-access-key"], "SECRET");
        assert_eq!(merged["storage-credentials"][0]["prefix"], "s3://b");
    }

    #[test]
    fn the_reload_path_names_the_created_table() {
        let body = br#"{"name":"my table","schema":{}}"#;
        assert_eq!(
            credentials_reload_path(&Method::POST, "/v1/p/namespaces/db/tables", body).as_deref(),
            Some("/v1/p/namespaces/db/tables/my%20table")
        );
        assert_eq!(
            credentials_reload_path(&Method::POST, "/v1/namespaces/db/register", body).as_deref(),
            Some("/v1/namespaces/db/tables/my%20table")
        );
    }
}
