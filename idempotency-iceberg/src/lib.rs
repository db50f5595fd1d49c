//! The Apache Iceberg REST catalog profile for the
//! [`idempotency-core`](idempotency_core) Idempotency-Key middleware.
//!
//! [`layer`] sets the layer up the way the Iceberg REST spec and its clients expect, with
//! [`IcebergProfile`] and two statuses:
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
//!   `s3.session-token`, …) and `storage-credentials` are cut out of it, and nothing else
//!   changes. A replay then loads the table through the inner service with the retry's
//!   own headers (so with its own authorization) and puts the fresh credentials into the
//!   replayed answer; the spec allows a replay to reflect newer catalog state. If that
//!   load fails, the replay goes out without credentials and the client must call
//!   `loadTable` or `loadCredentials`.
//! - **Exact replays**: an answer that had nothing cut out is replayed as the very bytes
//!   of the first answer, and no load runs. An answer that had credentials cut out is
//!   replayed as those bytes plus fresh credentials.
//! - **Metadata by pointer**: with a [`MetadataReader`] (the catalog's own storage
//!   client, [`IcebergProfile::with_metadata_reader`]), an answer that carries table or
//!   view metadata is stored without it: its `metadata` value is taken out and its
//!   length and XXH3-128 digest kept, and a replay reads the immutable file the answer's
//!   `metadata-location` names, checks it and puts it back, so the retry gets the first
//!   answer's bytes. A record then costs the same few hundred bytes whatever the table's
//!   size. A retry whose file cannot be read (deleted, storage down) or does not match
//!   gets 503 with `Retry-After` (`CommitStateUnknownException`), never a guess; keep
//!   metadata files at least as long as keys. Without a reader, answers are stored whole,
//!   and the profile says so in the log at its first request.
//! - **Encodings**: the catalog is asked for unencoded answers (`Accept-Encoding:
//!   identity`) on keyed requests, `GET /v1/config` and the load that refreshes a replay.
//!   A config answer compressed anyway (gzip, deflate) is decoded to be amended and goes
//!   out unencoded; a keyed answer compressed anyway is not stored (retries are told it
//!   ran). So no secret is ever stored inside a compressed body, and no replay is in an
//!   encoding its retry did not accept. Put compression outside the layer.
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
//!     .fallback_service(idempotency_iceberg::layer(MemoryStore::new()).layer(catalog));
//! ```
//!
//! Everything here is built on idempotency-core's public decision traits and
//! [`Profile`]; a catalog with needs of its own can write its own profile the same way.
//!
//! # Feature flags
//!
//! None: the crate is the profile, [`layer`] and the helpers it uses.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod json;
mod metadata;

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Uri, header};
use serde_json::Value;

use idempotency_core::iso8601::format_duration;
use idempotency_core::{
    Advertise, ErrorRenderer, IDEMPOTENCY_KEY, IdempotencyLayer, IdempotencyStore, KeepAnswer,
    Profile, Rejection, RejectionKind, ReplayAnswer, RequestHead, Restoring, RouteFilter,
    StoreAnswers, StoredResponse, UuidKey,
};

pub use self::metadata::MetadataReader;

/// A layer configured for an Iceberg REST catalog: [`IcebergProfile`], 503 while a
/// duplicate is in flight, 500 for an answer too large to store. See the
/// [crate docs](crate). The one way to set the profile up: further options are the
/// layer's builder methods, e.g. the lifetime an [`IdempotencyConfig`] read.
///
/// [`IdempotencyConfig`]: idempotency_core::config::IdempotencyConfig
///
/// ```
/// # use idempotency_store_memory::MemoryStore;
/// use std::time::Duration;
/// let layer = idempotency_iceberg::layer(MemoryStore::new()).with_lifetime(Duration::from_secs(3600));
/// ```
pub fn layer(store: impl IdempotencyStore) -> IdempotencyLayer {
    IdempotencyLayer::new(store)
        .with_profile(IcebergProfile::default())
        .with_in_flight_status(StatusCode::SERVICE_UNAVAILABLE)
        .with_not_stored_status(StatusCode::INTERNAL_SERVER_ERROR)
}

/// The config response field that advertises idempotency support.
pub const LIFETIME_FIELD: &str = "idempotency-key-lifetime";

/// The note the profile stores with an answer it cut credentials out of, so that its
/// replay knows to load fresh ones. Never sent to a client.
const CREDENTIALS_REMOVED: &str = "x-idempotency-iceberg-credentials-removed";

/// The Iceberg REST profile: its routes, UUID keys, `ErrorModel` errors, the advertised
/// lifetime, and vended credentials kept out of the store. See the
/// [crate docs](crate).
///
/// Its routes are anchored at the catalog's base path: by default `/v1/…` at the root;
/// a catalog served under `/catalog` sets [`with_base_path`](Self::with_base_path).
///
/// Answers that carry table or view metadata are stored whole unless the catalog gives
/// the profile a [`MetadataReader`] ([`with_metadata_reader`](Self::with_metadata_reader)):
/// then they are stored as a pointer to their metadata file, at the same small cost
/// whatever the table's size.
#[derive(Clone, Default)]
pub struct IcebergProfile {
    base_path: String,
    metadata: Option<Arc<dyn MetadataReader>>,
    /// Whether the line that says how metadata answers are stored was logged.
    announced: Arc<OnceLock<()>>,
}

impl fmt::Debug for IcebergProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IcebergProfile")
            .field("base_path", &self.base_path)
            .field("metadata_reader", &self.metadata.is_some())
            .finish_non_exhaustive()
    }
}

impl IcebergProfile {
    /// The path the catalog's `/v1/…` routes are served under (default: none).
    ///
    /// ```
    /// use idempotency_core::{RequestHead, RouteFilter};
    /// use idempotency_iceberg::IcebergProfile;
    ///
    /// let profile = IcebergProfile::default().with_base_path("/catalog/");
    /// let takes_part = |path: &str| {
    ///     profile.takes_part(&RequestHead::of(&http::Request::post(path).body(()).unwrap()))
    /// };
    /// assert!(takes_part("/catalog/v1/namespaces"));
    /// assert!(!takes_part("/v1/namespaces"));
    /// assert!(!takes_part("/x/catalog/v1/namespaces"));
    /// ```
    pub fn with_base_path(mut self, base_path: &str) -> Self {
        self.base_path = base_path.trim_end_matches('/').to_owned();
        self
    }

    /// Stores the answers that carry table or view metadata (`updateTable`,
    /// `createTable`, `registerTable`, `createView`, `replaceView`, `registerView`) as a
    /// pointer to the metadata file they name instead of whole: a replay reads the file
    /// back through `reader` and sends the first answer's bytes. A record then holds a
    /// few hundred bytes whatever the table's size, where a whole answer holds every
    /// snapshot the table keeps.
    ///
    /// The file must stay readable for as long as keys are kept (the layer's lifetime).
    /// A retry whose file cannot be read, or no longer holds the bytes the first answer
    /// carried, is never answered with a guess: it gets a 503 with `Retry-After` that says
    /// the request already ran, which the Java client resends and then reports as a
    /// commit whose state is unknown.
    ///
    /// ```
    /// use idempotency_core::IdempotencyLayer;
    /// use idempotency_iceberg::IcebergProfile;
    /// use idempotency_store_memory::MemoryStore;
    ///
    /// // Your catalog's own storage client; here, local files.
    /// let read = |location: String| async move {
    ///     let path = location.strip_prefix("file://").unwrap_or(&location).to_owned();
    ///     tokio::task::spawn_blocking(move || std::fs::read(path)).await?
    /// };
    /// let layer = idempotency_iceberg::layer(MemoryStore::new())
    ///     .with_profile(IcebergProfile::default().with_metadata_reader(read));
    /// # drop(layer);
    /// ```
    pub fn with_metadata_reader(mut self, reader: impl MetadataReader) -> Self {
        self.metadata = Some(Arc::new(reader));
        self
    }

    /// Says once, at the first request the profile sees, how metadata answers are kept.
    fn announce(&self) {
        self.announced.get_or_init(|| {
            if self.metadata.is_some() {
                tracing::info!("idempotency: Iceberg answers that carry table or view metadata are stored as a pointer to their metadata file (a metadata reader is installed)");
            } else {
                tracing::info!("idempotency: Iceberg answers that carry table or view metadata are stored whole, and grow with their tables: no metadata reader is installed (IcebergProfile::with_metadata_reader)");
            }
        });
    }

    /// The part of `path` after the base path, if `path` is under it.
    fn under_base<'a>(&self, path: &'a str) -> Option<&'a str> {
        let rest = path.strip_prefix(self.base_path.as_str())?;
        (rest.is_empty() || rest.starts_with('/')).then_some(rest)
    }
}

impl Profile for IcebergProfile {
    fn apply<M>(self, layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
        const ANY_VERSION: UuidKey = UuidKey::any_version();
        layer
            .with_routes(self.clone())
            .with_key_format(ANY_VERSION)
            .with_classifier(StoreAnswers)
            .with_answer_keeper(self.clone())
            .with_answer_replayer(self.clone())
            .with_error_renderer(IcebergErrorModel)
            .with_advertiser(self)
    }
}

/// The spec's mutation operations that take the header, under the base path.
impl RouteFilter for IcebergProfile {
    fn takes_part(&self, request: &RequestHead<'_>) -> bool {
        self.under_base(request.uri.path())
            .is_some_and(|path| operation(request.method, path).is_some())
    }
}

/// Vended credentials cut out, and table or view metadata kept as a pointer to its file
/// when a reader is installed.
impl KeepAnswer for IcebergProfile {
    fn keep(&self, method: &Method, uri: &Uri, mut answer: StoredResponse) -> StoredResponse {
        let Some(path) = self.under_base(uri.path()) else {
            return answer;
        };
        if answer.status == 200
            && loads_a_table(method, path)
            && let Some(stripped) = strip_credentials(&answer.body)
        {
            answer.body = Bytes::from(stripped);
            answer
                .headers
                .push((CREDENTIALS_REMOVED.to_owned(), Bytes::from_static(b"true")));
        }
        // Last, so that the place it notes is the place in the body as stored.
        if answer.status == 200 && self.metadata.is_some() && answers_with_metadata(method, path) {
            metadata::take_out(&mut answer);
        }
        answer
    }

    fn restore(&self, stored: &StoredResponse) -> Option<Restoring<'_>> {
        if !metadata::was_taken_out(stored) {
            return None;
        }
        let reader = self.metadata.as_deref();
        Some(Box::pin(metadata::put_back(reader, stored.clone())))
    }
}

/// Fresh vended credentials, loaded again for a replay of an answer whose credentials
/// [`keep`](KeepAnswer::keep) cut out.
impl ReplayAnswer for IcebergProfile {
    fn refresh(&self, retry: &Request<Bytes>, stored: &StoredResponse) -> Option<Request<Bytes>> {
        if !had_credentials_removed(stored) {
            return None;
        }
        let under_base = self.under_base(retry.uri().path())?;
        if !loads_a_table(retry.method(), under_base) {
            return None;
        }
        let path = credentials_reload_path(retry.uri().path(), retry.body())?;
        let mut load = Request::new(Bytes::new());
        *load.uri_mut() = path.parse().ok()?;
        *load.extensions_mut() = retry.extensions().clone();
        for (name, value) in retry.headers() {
            if name != header::CONTENT_LENGTH
                && name != header::CONTENT_TYPE
                && name != IDEMPOTENCY_KEY
            {
                load.headers_mut().append(name, value.clone());
            }
        }
        Some(load)
    }

    fn replay(
        &self,
        mut stored: StoredResponse,
        refreshed: Option<Response<Bytes>>,
    ) -> StoredResponse {
        if !had_credentials_removed(&stored) {
            return stored;
        }
        stored
            .headers
            .retain(|(name, _)| name != CREDENTIALS_REMOVED);
        let merged =
            refreshed.and_then(|fresh| merge_fresh_credentials(&stored.body, fresh.body()));
        match merged {
            Some(body) => stored.body = Bytes::from(body),
            None => tracing::warn!(
                outcome = "replayed",
                "idempotency: could not load the table again for fresh credentials; replaying without them"
            ),
        }
        stored
    }
}

/// `idempotency-key-lifetime` at the top level of `GET /v1/config` answers.
impl Advertise for IcebergProfile {
    fn advertises(&self, method: &Method, path: &str) -> bool {
        self.announce();
        method == Method::GET
            && self
                .under_base(path)
                .is_some_and(|path| path.trim_end_matches('/') == "/v1/config")
    }

    fn advertise(&self, mut answer: Response<Bytes>, lifetime: Duration) -> Response<Bytes> {
        let lifetime = Value::String(format_duration(lifetime)).to_string();
        let amended = std::str::from_utf8(answer.body())
            .ok()
            .and_then(|config| json::set_member(config, LIFETIME_FIELD, &lifetime));
        if let Some(amended) = amended {
            *answer.body_mut() = Bytes::from(amended);
        }
        answer
    }
}

/// The Iceberg operation a mutation is, by its method and path, or `None` if it is not
/// one that takes an `Idempotency-Key`. The path starts with `/v1` (a base path is the
/// profile's to take off first); it may carry a `{prefix}` after `/v1`, and repeated or
/// trailing slashes do not matter.
///
/// ```
/// use http::Method;
/// use idempotency_iceberg::operation;
///
/// assert_eq!(operation(&Method::POST, "/v1/namespaces/db/tables"), Some("createTable"));
/// assert_eq!(operation(&Method::POST, "/v1/warehouse-1/namespaces/db/tables/t"), Some("updateTable"));
/// assert_eq!(operation(&Method::POST, "/v1/namespaces/db/tables/t/metrics"), None);
/// assert_eq!(operation(&Method::POST, "/x/v1/namespaces"), None);
/// ```
pub fn operation(method: &Method, path: &str) -> Option<&'static str> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = segments.strip_prefix(&["v1"])?;
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
            | RejectionKind::UnreadableBody
            | RejectionKind::BodyTimeout => "BadRequestException",
            RejectionKind::KeyReused => "IdempotencyKeyReusedException",
            RejectionKind::QuotaExceeded => "TooManyRequestsException",
            RejectionKind::BodyTooLarge => "RequestTooLargeException",
            RejectionKind::InFlight => "IdempotencyKeyInFlightException",
            RejectionKind::NoScope => "ServiceFailureException",
            RejectionKind::StoreUnavailable
            | RejectionKind::StoreFull
            | RejectionKind::OverBudget => "ServiceUnavailableException",
            // The request may have run: for a commit, its state is unknown to the client.
            RejectionKind::ResponseNotStored | RejectionKind::ResponseFailed => {
                "CommitStateUnknownException"
            }
            // A kind a later idempotency-core adds (`RejectionKind` is non-exhaustive):
            // by its status, the client's fault or the service's.
            _ if rejection.status.is_client_error() => "BadRequestException",
            _ => "ServiceFailureException",
        };
        let body = serde_json::json!({
            "error": {
                "message": rejection.message,
                "type": error_type,
                "code": rejection.status.as_u16(),
            }
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = rejection.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// Adds the top-level `idempotency-key-lifetime` field to a `GET /v1/config` response
/// body, for catalogs that build it themselves. It goes beside `defaults` and
/// `overrides`, not inside them: clients only look for it at the top level.
///
/// ```
/// use std::time::Duration;
/// use idempotency_iceberg::advertise_lifetime;
///
/// let mut config = serde_json::json!({"defaults": {}, "overrides": {}});
/// advertise_lifetime(&mut config, Duration::from_secs(1800));
/// assert_eq!(config["idempotency-key-lifetime"], "PT30M");
/// ```
pub fn advertise_lifetime(config: &mut Value, lifetime: Duration) {
    if let Value::Object(fields) = config {
        fields.insert(
            LIFETIME_FIELD.to_owned(),
            Value::String(format_duration(lifetime)),
        );
    }
}

/// Operations whose answer carries table or view metadata and the file it was read from
/// or written to.
fn answers_with_metadata(method: &Method, path: &str) -> bool {
    matches!(
        operation(method, path),
        Some(
            "createTable"
                | "registerTable"
                | "updateTable"
                | "createView"
                | "replaceView"
                | "registerView"
        )
    )
}

/// Operations whose answer is a `LoadTableResult`, which may carry vended credentials.
fn loads_a_table(method: &Method, path: &str) -> bool {
    matches!(
        operation(method, path),
        Some("createTable" | "registerTable")
    )
}

fn had_credentials_removed(stored: &StoredResponse) -> bool {
    stored
        .headers
        .iter()
        .any(|(name, _)| name == CREDENTIALS_REMOVED)
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

/// A table-loading answer with its vended credentials cut out (`storage-credentials`,
/// and the secret entries of `config`) and every other byte kept, or `None` when it
/// holds none.
fn strip_credentials(body: &[u8]) -> Option<String> {
    let answer = std::str::from_utf8(body).ok()?;
    let has_credentials = json::member(answer, "storage-credentials")
        .is_some_and(|credentials| credentials.trim() != "[]");
    let without_credentials = has_credentials
        .then(|| json::remove_members(answer, |key| key == "storage-credentials"))
        .flatten();
    let current = without_credentials.as_deref().unwrap_or(answer);
    let without_secrets = json::edit_member(current, "config", |config| {
        json::remove_members(config, is_secret_config_key)
    });
    without_secrets.or(without_credentials)
}

/// The path of the `loadTable` call that refreshes the credentials of a replayed
/// table-loading answer: the table the original request created or registered.
fn credentials_reload_path(path: &str, body: &[u8]) -> Option<String> {
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

/// The stored answer with the fresh credentials of a `loadTable` answer added back:
/// its `storage-credentials`, and the secret entries of its `config`. Nothing else of the
/// stored answer changes.
fn merge_fresh_credentials(stored: &[u8], fresh: &[u8]) -> Option<String> {
    let mut replay = std::str::from_utf8(stored).ok()?.to_owned();
    let fresh = std::str::from_utf8(fresh).ok()?;
    if let Some(credentials) = json::member(fresh, "storage-credentials") {
        replay = json::set_member(&replay, "storage-credentials", credentials)?;
    }
    let secrets: Vec<(String, &str)> = json::member(fresh, "config")
        .and_then(json::entries)
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| is_secret_config_key(key))
        .collect();
    if secrets.is_empty() {
        return Some(replay);
    }
    let with_config = match json::member(&replay, "config") {
        Some(_) => replay,
        None => json::set_member(&replay, "config", "{}")?,
    };
    json::edit_member(&with_config, "config", |config| {
        secrets
            .iter()
            .try_fold(config.to_owned(), |config, (key, value)| {
                json::set_member(&config, key, value)
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn takes(profile: &IcebergProfile, method: &Method, path: &str) -> bool {
        let request = Request::builder()
            .method(method.clone())
            .uri(path)
            .body(())
            .unwrap();
        profile.takes_part(&RequestHead::of(&request))
    }

    impl IcebergProfile {
        fn keep_for(&self, request: &Request<Bytes>, answer: StoredResponse) -> StoredResponse {
            self.keep(request.method(), request.uri(), answer)
        }
    }
    use serde_json::Value;

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
                format!("//v1/{rest}/"),
            ] {
                assert_eq!(operation(&method, &path), Some(expected), "{method} {path}");
            }
            let under_base = IcebergProfile::default().with_base_path("/catalog");
            assert!(takes(&under_base, &method, &format!("/catalog/v1/{rest}")));
            assert!(!takes(&under_base, &method, &format!("/v1/{rest}")));
            assert!(!takes(
                &IcebergProfile::default(),
                &method,
                &format!("/x/v1/{rest}")
            ));
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
    fn credentials_are_cut_out_byte_for_byte_and_put_back() {
        let answer = r#"{"metadata-location":"file:///w/db/t/metadata/1.json","metadata":{"format-version":2},"config":{"s3.access-key-id":"AKIA","s3.secret-access-key":"SECRET","s3.session-token":"TOKEN","s3.region":"eu-west-1"},"storage-credentials":[{"prefix":"s3://b","config":{"s3.secret-access-key":"SECRET"}}]}"#;
        let stripped = strip_credentials(answer.as_bytes()).unwrap();
        assert_eq!(
            stripped,
            r#"{"metadata-location":"file:///w/db/t/metadata/1.json","metadata":{"format-version":2},"config":{"s3.region":"eu-west-1"}}"#
        );
        let fresh = answer.replace("SECRET", "FRESH");
        let merged = merge_fresh_credentials(stripped.as_bytes(), fresh.as_bytes()).unwrap();
        let merged: Value = serde_json::from_str(&merged).unwrap();
        assert_eq!(merged["config"]["s3.secret-access-key"], "FRESH");
        assert_eq!(merged["config"]["s3.region"], "eu-west-1");
        assert_eq!(merged["storage-credentials"][0]["prefix"], "s3://b");
        assert_eq!(
            strip_credentials(serde_json::to_string(&merged).unwrap().as_bytes())
                .map(|s| serde_json::from_str::<Value>(&s).unwrap()),
            Some(serde_json::from_str::<Value>(&stripped).unwrap()),
            "a replay is the stored answer plus credentials"
        );
    }

    #[test]
    fn answers_without_credentials_are_not_touched() {
        for answer in [
            r#"{"metadata-location":"m","metadata":{},"config":{"s3.region":"r"}}"#,
            r#"{"metadata-location":"m","metadata":{},"storage-credentials":[]}"#,
            r#"{"metadata-location":"m","metadata":{}}"#,
            "not json",
        ] {
            assert_eq!(strip_credentials(answer.as_bytes()), None, "{answer}");
        }
    }

    #[test]
    fn the_reload_path_names_the_created_table() {
        let body = br#"{"name":"my table","schema":{}}"#;
        assert_eq!(
            credentials_reload_path("/v1/p/namespaces/db/tables", body).as_deref(),
            Some("/v1/p/namespaces/db/tables/my%20table")
        );
        assert_eq!(
            credentials_reload_path("/v1/namespaces/db/register", body).as_deref(),
            Some("/v1/namespaces/db/tables/my%20table")
        );
    }

    /// A reader over files held in memory, that counts its reads.
    fn files(files: &[(&str, &str)]) -> impl MetadataReader + Clone {
        let files: std::collections::HashMap<String, Bytes> = files
            .iter()
            .map(|(location, text)| ((*location).to_owned(), Bytes::from(text.to_string())))
            .collect();
        let files = Arc::new(files);
        move |location: String| {
            let files = files.clone();
            async move {
                files
                    .get(&location)
                    .cloned()
                    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
            }
        }
    }

    fn commit_request() -> Request<Bytes> {
        Request::post("/v1/namespaces/db/tables/t")
            .body(Bytes::from_static(b"{}"))
            .unwrap()
    }

    fn answer(body: &str) -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![(
                "content-type".to_owned(),
                Bytes::from_static(b"application/json"),
            )],
            body: Bytes::from(body.to_owned()),
            trailers: Vec::new(),
        }
    }

    fn replayed(profile: &IcebergProfile, stored: &StoredResponse) -> StoredResponse {
        let restoring = profile.restore(stored).expect("a pointer is restored");
        futures_util::FutureExt::now_or_never(restoring).expect("reads at once")
    }

    const METADATA: &str = r#"{"format-version":2, "snapshots":[{"snapshot-id":1},{"snapshot-id":2}],"properties":{"b":"2","a":"1"}}"#;

    #[test]
    fn metadata_is_stored_as_a_pointer_and_replayed_byte_for_byte() {
        let location = "file:///w/db/t/metadata/00002-x.metadata.json";
        let first = format!(r#"{{"metadata-location":"{location}", "metadata":{METADATA}}}"#);
        let profile =
            IcebergProfile::default().with_metadata_reader(files(&[(location, METADATA)]));
        let stored = profile.keep_for(&commit_request(), answer(&first));
        assert_eq!(
            stored.body,
            format!(r#"{{"metadata-location":"{location}", "metadata":null}}"#)
        );
        assert!(stored.body.len() < first.len() - METADATA.len() + 5);
        let replay = replayed(&profile, &stored);
        assert_eq!(replay.body, first, "the first answer, byte for byte");
        assert_eq!(replay.status, 200);
        assert_eq!(
            replay.headers,
            vec![(
                "content-type".to_owned(),
                Bytes::from_static(b"application/json")
            )],
            "the note is not sent"
        );
    }

    /// A reader that hands over a buffer nothing else holds (a file just read, whole or
    /// sliced out of a larger read) has the answer put together in that buffer.
    #[test]
    fn a_reader_s_own_buffer_is_replayed_byte_for_byte() {
        let location = "file:///w/db/t/metadata/00002-x.metadata.json";
        let first = format!(
            r#"{{"metadata-location":"{location}", "metadata":{METADATA}, "config":{{}}}}"#
        );
        let whole = IcebergProfile::default().with_metadata_reader(|_: String| async {
            Ok::<_, idempotency_core::BoxError>(METADATA.as_bytes().to_vec())
        });
        let sliced = IcebergProfile::default().with_metadata_reader(|_: String| async {
            let read = Bytes::from(format!("  {METADATA}\n"));
            Ok::<_, idempotency_core::BoxError>(read.slice(2..2 + METADATA.len()))
        });
        for profile in [whole, sliced] {
            let stored = profile.keep_for(&commit_request(), answer(&first));
            assert_eq!(
                replayed(&profile, &stored).body,
                first,
                "the first answer, byte for byte"
            );
        }
    }

    #[test]
    fn a_file_that_is_gone_or_changed_is_never_replayed() {
        let location = "file:///w/db/t/metadata/00002-x.metadata.json";
        let first = format!(r#"{{"metadata-location":"{location}","metadata":{METADATA}}}"#);
        let writer = IcebergProfile::default().with_metadata_reader(files(&[(location, METADATA)]));
        let stored = writer.keep_for(&commit_request(), answer(&first));
        let changed = METADATA.replace(r#""b":"2","a":"1""#, r#""a":"1","b":"2""#);
        let readers = [
            IcebergProfile::default().with_metadata_reader(files(&[])),
            IcebergProfile::default().with_metadata_reader(files(&[(location, &changed)])),
            IcebergProfile::default().with_metadata_reader(files(&[(location, "{}")])),
            // Stored with a reader, replayed by a profile that has none.
            IcebergProfile::default(),
        ];
        for profile in readers {
            let replay = replayed(&profile, &stored);
            assert_eq!(replay.status, 503, "{profile:?}");
            assert!(
                replay
                    .headers
                    .iter()
                    .any(|(name, value)| name == "retry-after" && value == "1")
            );
            let body: Value = serde_json::from_slice(&replay.body).unwrap();
            assert_eq!(body["error"]["type"], "CommitStateUnknownException");
            assert_eq!(body["error"]["code"], 503);
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("already ran"),
                "{body}"
            );
        }
    }

    #[test]
    fn only_metadata_answers_that_name_their_file_become_pointers() {
        let profile = IcebergProfile::default().with_metadata_reader(files(&[]));
        let whole = |method: Method, path: &str, status: u16, body: &str| {
            let request = Request::builder()
                .method(method)
                .uri(path)
                .body(Bytes::new())
                .unwrap();
            let mut answer = answer(body);
            answer.status = status;
            let stored = profile.keep_for(&request, answer.clone());
            stored == answer && profile.restore(&stored).is_none()
        };
        let with_file = r#"{"metadata-location":"m","metadata":{"k":1}}"#;
        // A staged create names no file; a namespace is not metadata; errors are kept.
        assert!(whole(
            Method::POST,
            "/v1/namespaces/db/tables",
            200,
            r#"{"metadata-location":null,"metadata":{"k":1}}"#
        ));
        assert!(whole(Method::POST, "/v1/namespaces", 200, with_file));
        assert!(whole(
            Method::POST,
            "/v1/namespaces/db/tables/t",
            409,
            with_file
        ));
        assert!(whole(
            Method::POST,
            "/v1/namespaces/db/tables/t",
            200,
            "not json"
        ));
        assert!(whole(
            Method::POST,
            "/v1/namespaces/db/tables/t",
            200,
            r#"{"metadata-location":"m"}"#
        ));
        for path in [
            "/v1/namespaces/db/tables",
            "/v1/p/namespaces/db/register",
            "/v1/namespaces/db/tables/t",
            "/v1/namespaces/db/views",
            "/v1/namespaces/db/views/v",
            "/v1/namespaces/db/register-view",
        ] {
            assert!(!whole(Method::POST, path, 200, with_file), "{path}");
        }
        // Without a reader, everything is stored whole.
        let request = commit_request();
        assert_eq!(
            IcebergProfile::default().keep_for(&request, answer(with_file)),
            answer(with_file)
        );
    }

    #[test]
    fn vended_credentials_and_metadata_are_both_kept_out_and_both_come_back() {
        let location = "file:///w/db/t/metadata/00000-x.metadata.json";
        let config = r#""config":{"s3.secret-access-key":"OLD","s3.region":"r"}"#;
        let pointer = format!(r#""metadata-location":"{location}","metadata":{METADATA}"#);
        // Credentials after the metadata, and before it (cutting them out moves it).
        for first in [
            format!("{{{pointer},{config}}}"),
            format!("{{{config},{pointer}}}"),
        ] {
            let profile =
                IcebergProfile::default().with_metadata_reader(files(&[(location, METADATA)]));
            let request = Request::post("/v1/namespaces/db/tables")
                .body(Bytes::from_static(br#"{"name":"t"}"#))
                .unwrap();
            let stored = profile.keep_for(&request, answer(&first));
            assert!(!String::from_utf8_lossy(&stored.body).contains("OLD"));
            assert!(!String::from_utf8_lossy(&stored.body).contains("snapshot-id"));
            let restored = replayed(&profile, &stored);
            assert_eq!(restored.status, 200, "{first}");
            let fresh = Response::new(Bytes::from(first.replace("OLD", "FRESH")));
            let replay = profile.replay(restored, Some(fresh));
            let replay = String::from_utf8(replay.body.to_vec()).unwrap();
            assert!(replay.contains(&pointer), "{replay}");
            assert_eq!(
                serde_json::from_str::<Value>(&replay).unwrap(),
                serde_json::from_str::<Value>(&first.replace("OLD", "FRESH")).unwrap()
            );
        }
    }
}

/// The README's snippets, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// The Iceberg guide's snippets (docs/iceberg.md), compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../docs/iceberg.md")]
struct IcebergGuideDoctests;
