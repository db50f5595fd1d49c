//! The HTTP surface: the Iceberg REST catalog routes, each served with and without a
//! `{prefix}` segment, and handlers that turn path, query and body into a catalog call.
//!
//! Request bodies are parsed here rather than by axum's `Json` extractor, so that a body
//! that is not the spec's JSON (an unknown table update, say) gets the spec's 400
//! `BadRequestException` instead of axum's 422.
//!
//! A handler of a change gets it back from the catalog uncommitted, builds its answer,
//! and commits the change together with that answer, which goes into the request's
//! idempotency record in the same transaction (see [`crate::catalog`]).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use axum::{Extension, Json, Router};
use iceberg::{NamespaceIdent, TableIdent};
use idempotency_core::ReservationHandle;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::catalog::Catalog;
use crate::error::{ApiError, ApiResult};
use crate::rest::{
    CatalogConfig, CommitTableRequest, CommitTableResponse, CommitTransactionRequest,
    CommitViewRequest, CreateNamespaceRequest, CreateTableRequest, CreateViewRequest,
    ListIdentifiersResponse, ListNamespacesResponse, NamespaceResponse, RegisterTableRequest,
    RegisterViewRequest, RenameRequest, TableIdentifier, UpdateNamespacePropertiesRequest,
};

/// The reservation of a request with an `Idempotency-Key`, which the layer put on it;
/// `None` without a key.
type Reservation = Option<Extension<ReservationHandle>>;

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) catalog: Catalog,
}

/// The unit separator that joins namespace levels in a path segment (the spec's default
/// `namespace-separator`).
const NAMESPACE_SEPARATOR: char = '\u{1f}';

/// The routes this catalog serves, as the config response's `endpoints` lists them.
const ENDPOINTS: &[&str] = &[
    "GET /v1/{prefix}/namespaces",
    "POST /v1/{prefix}/namespaces",
    "GET /v1/{prefix}/namespaces/{namespace}",
    "HEAD /v1/{prefix}/namespaces/{namespace}",
    "DELETE /v1/{prefix}/namespaces/{namespace}",
    "POST /v1/{prefix}/namespaces/{namespace}/properties",
    "GET /v1/{prefix}/namespaces/{namespace}/tables",
    "POST /v1/{prefix}/namespaces/{namespace}/tables",
    "GET /v1/{prefix}/namespaces/{namespace}/tables/{table}",
    "HEAD /v1/{prefix}/namespaces/{namespace}/tables/{table}",
    "POST /v1/{prefix}/namespaces/{namespace}/tables/{table}",
    "DELETE /v1/{prefix}/namespaces/{namespace}/tables/{table}",
    "POST /v1/{prefix}/namespaces/{namespace}/register",
    "POST /v1/{prefix}/namespaces/{namespace}/tables/{table}/metrics",
    "POST /v1/{prefix}/tables/rename",
    "POST /v1/{prefix}/transactions/commit",
    "GET /v1/{prefix}/namespaces/{namespace}/views",
    "POST /v1/{prefix}/namespaces/{namespace}/views",
    "GET /v1/{prefix}/namespaces/{namespace}/views/{view}",
    "HEAD /v1/{prefix}/namespaces/{namespace}/views/{view}",
    "POST /v1/{prefix}/namespaces/{namespace}/views/{view}",
    "DELETE /v1/{prefix}/namespaces/{namespace}/views/{view}",
    "POST /v1/{prefix}/views/rename",
    "POST /v1/{prefix}/namespaces/{namespace}/register-view",
];

/// The whole API. Every catalog route is served at `/v1/...` (what the config response
/// implies, since it sets no `prefix`) and at `/v1/{prefix}/...` for clients configured
/// with one; the prefix is accepted and ignored.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    let mut router = Router::new().route("/v1/config", get(config));
    for base in ["/v1", "/v1/{prefix}"] {
        for (path, handler) in catalog_routes() {
            router = router.route(&format!("{base}{path}"), handler);
        }
    }
    router.with_state(state)
}

fn catalog_routes() -> Vec<(&'static str, MethodRouter<Arc<AppState>>)> {
    vec![
        ("/namespaces", get(list_namespaces).post(create_namespace)),
        (
            "/namespaces/{namespace}",
            get(load_namespace)
                .head(namespace_exists)
                .delete(drop_namespace),
        ),
        (
            "/namespaces/{namespace}/properties",
            post(update_properties),
        ),
        (
            "/namespaces/{namespace}/tables",
            get(list_tables).post(create_table),
        ),
        (
            "/namespaces/{namespace}/tables/{table}",
            get(load_table)
                .head(table_exists)
                .post(commit_table)
                .delete(drop_table),
        ),
        (
            "/namespaces/{namespace}/tables/{table}/metrics",
            post(report_metrics),
        ),
        ("/namespaces/{namespace}/register", post(register_table)),
        ("/tables/rename", post(rename_table)),
        ("/transactions/commit", post(commit_transaction)),
        (
            "/namespaces/{namespace}/views",
            get(list_views).post(create_view),
        ),
        (
            "/namespaces/{namespace}/views/{view}",
            get(load_view)
                .head(view_exists)
                .post(replace_view)
                .delete(drop_view),
        ),
        ("/views/rename", post(rename_view)),
        ("/namespaces/{namespace}/register-view", post(register_view)),
    ]
}

#[derive(Deserialize)]
struct NamespacePath {
    namespace: String,
}

#[derive(Deserialize)]
struct TablePath {
    namespace: String,
    table: String,
}

#[derive(Deserialize)]
struct ViewPath {
    namespace: String,
    view: String,
}

impl NamespacePath {
    fn ident(&self) -> ApiResult<NamespaceIdent> {
        parse_namespace(&self.namespace)
    }
}

impl TablePath {
    fn ident(&self) -> ApiResult<TableIdent> {
        Ok(TableIdent::new(
            parse_namespace(&self.namespace)?,
            self.table.clone(),
        ))
    }
}

impl ViewPath {
    fn ident(&self) -> ApiResult<TableIdent> {
        Ok(TableIdent::new(
            parse_namespace(&self.namespace)?,
            self.view.clone(),
        ))
    }
}

/// A namespace path segment (already percent-decoded): levels joined by `0x1F`.
fn parse_namespace(segment: &str) -> ApiResult<NamespaceIdent> {
    let levels: Vec<String> = segment
        .split(NAMESPACE_SEPARATOR)
        .map(str::to_owned)
        .collect();
    if levels.iter().any(String::is_empty) {
        return Err(ApiError::bad_request(format!(
            "Invalid namespace {segment:?}: empty level"
        )));
    }
    NamespaceIdent::from_vec(levels).map_err(|e| ApiError::bad_request(e.message().to_owned()))
}

fn identifier(ident: &TableIdentifier) -> ApiResult<TableIdent> {
    let namespace = NamespaceIdent::from_vec(ident.namespace.clone())
        .map_err(|e| ApiError::bad_request(e.message().to_owned()))?;
    Ok(TableIdent::new(namespace, ident.name.clone()))
}

fn to_identifier(ident: &TableIdent) -> TableIdentifier {
    TableIdentifier {
        namespace: ident.namespace().clone().inner(),
        name: ident.name().to_owned(),
    }
}

/// Parses a JSON request body; anything that is not the spec's JSON is a 400.
fn parse<T: DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Malformed request body: {e}")))
}

fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

// --------------------------------------------------------------------------------------
// Config
// --------------------------------------------------------------------------------------

/// No `prefix` and no overrides. The idempotency layer, when enabled, adds the top-level
/// `idempotency-key-lifetime` to this answer on its way out.
async fn config() -> Json<CatalogConfig> {
    Json(CatalogConfig {
        defaults: HashMap::new(),
        overrides: HashMap::new(),
        endpoints: ENDPOINTS.iter().map(|e| (*e).to_owned()).collect(),
    })
}

// --------------------------------------------------------------------------------------
// Namespaces
// --------------------------------------------------------------------------------------

async fn list_namespaces(
    State(state): State<Arc<AppState>>,
    Query(query): Query<HashMap<String, String>>,
) -> ApiResult<Json<ListNamespacesResponse>> {
    let parent = match query.get("parent").map(String::as_str) {
        None | Some("") => None,
        Some(parent) => Some(parse_namespace(parent)?),
    };
    let namespaces = state.catalog.list_namespaces(parent.as_ref()).await?;
    Ok(Json(ListNamespacesResponse { namespaces }))
}

async fn create_namespace(
    State(state): State<Arc<AppState>>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CreateNamespaceRequest = parse(&body)?;
    let namespace = NamespaceIdent::from_vec(request.namespace.clone())
        .map_err(|e| ApiError::bad_request(e.message().to_owned()))?;
    let created = state
        .catalog
        .create_namespace(&namespace, request.properties)
        .await?;
    let answer = Json(NamespaceResponse {
        namespace: request.namespace,
        properties: created.value.clone(),
    })
    .into_response();
    created.commit(reservation.as_deref(), answer).await
}

async fn load_namespace(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Json<NamespaceResponse>> {
    let namespace = path.ident()?;
    let properties = state.catalog.load_namespace(&namespace).await?;
    Ok(Json(NamespaceResponse {
        namespace: namespace.inner(),
        properties,
    }))
}

async fn namespace_exists(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Response> {
    let namespace = path.ident()?;
    if state.catalog.namespace_exists(&namespace).await? {
        Ok(no_content())
    } else {
        Err(ApiError::no_such_namespace(
            path.namespace.replace(NAMESPACE_SEPARATOR, "."),
        ))
    }
}

async fn drop_namespace(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
    reservation: Reservation,
) -> ApiResult<Response> {
    let dropped = state.catalog.drop_namespace(&path.ident()?).await?;
    dropped.commit(reservation.as_deref(), no_content()).await
}

async fn update_properties(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: UpdateNamespacePropertiesRequest = parse(&body)?;
    let updated = state
        .catalog
        .update_namespace_properties(&path.ident()?, request.removals, request.updates)
        .await?;
    let answer = Json(&updated.value).into_response();
    updated.commit(reservation.as_deref(), answer).await
}

// --------------------------------------------------------------------------------------
// Tables
// --------------------------------------------------------------------------------------

async fn list_tables(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Json<ListIdentifiersResponse>> {
    let tables = state.catalog.list_tables(&path.ident()?).await?;
    Ok(Json(ListIdentifiersResponse {
        identifiers: tables.iter().map(to_identifier).collect(),
    }))
}

async fn create_table(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CreateTableRequest = parse(&body)?;
    let namespace = path.ident()?;
    if request.stage_create {
        let staged = state
            .catalog
            .stage_create_table(&namespace, request)
            .await?;
        return Ok(Json(staged).into_response());
    }
    let created = state.catalog.create_table(&namespace, request).await?;
    let answer = Json(&created.value).into_response();
    created.commit(reservation.as_deref(), answer).await
}

async fn load_table(
    State(state): State<Arc<AppState>>,
    Path(path): Path<TablePath>,
) -> ApiResult<Response> {
    let result = state.catalog.load_table(&path.ident()?).await?;
    Ok(Json(result).into_response())
}

async fn table_exists(
    State(state): State<Arc<AppState>>,
    Path(path): Path<TablePath>,
) -> ApiResult<Response> {
    let ident = path.ident()?;
    if state.catalog.table_exists(&ident).await? {
        Ok(no_content())
    } else {
        Err(ApiError::no_such_table(ident))
    }
}

async fn commit_table(
    State(state): State<Arc<AppState>>,
    Path(path): Path<TablePath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let ident = path.ident()?;
    let request: CommitTableRequest = parse(&body)?;
    if let Some(named) = &request.identifier
        && identifier(named)? != ident
    {
        return Err(ApiError::bad_request(format!(
            "The body names table {}, the path {ident}",
            identifier(named)?
        )));
    }
    let committed = state.catalog.commit_table(&ident, request).await?;
    let (metadata_location, metadata) = &committed.value;
    let answer = Json(CommitTableResponse {
        metadata_location: metadata_location.clone(),
        metadata: metadata.clone(),
    })
    .into_response();
    committed.commit(reservation.as_deref(), answer).await
}

async fn drop_table(
    State(state): State<Arc<AppState>>,
    Path(path): Path<TablePath>,
    Query(query): Query<HashMap<String, String>>,
    reservation: Reservation,
) -> ApiResult<Response> {
    let purge = query
        .get("purgeRequested")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let dropped = state.catalog.drop_table(&path.ident()?, purge).await?;
    dropped.commit(reservation.as_deref(), no_content()).await
}

/// Scan and commit reports are accepted and dropped: this catalog keeps no metrics.
async fn report_metrics(Path(path): Path<TablePath>) -> ApiResult<Response> {
    path.ident()?;
    Ok(no_content())
}

async fn register_table(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RegisterTableRequest = parse(&body)?;
    let ident = TableIdent::new(path.ident()?, request.name);
    let registered = state
        .catalog
        .register_table(&ident, request.metadata_location, request.overwrite)
        .await?;
    let answer = Json(&registered.value).into_response();
    registered.commit(reservation.as_deref(), answer).await
}

async fn rename_table(
    State(state): State<Arc<AppState>>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RenameRequest = parse(&body)?;
    let renamed = state
        .catalog
        .rename_table(
            &identifier(&request.source)?,
            &identifier(&request.destination)?,
        )
        .await?;
    renamed.commit(reservation.as_deref(), no_content()).await
}

async fn commit_transaction(
    State(state): State<Arc<AppState>>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CommitTransactionRequest = parse(&body)?;
    let mut changes = Vec::with_capacity(request.table_changes.len());
    for change in request.table_changes {
        let Some(named) = &change.identifier else {
            return Err(ApiError::bad_request(
                "Every table change of a transaction must name its table (identifier)",
            ));
        };
        changes.push((identifier(named)?, change));
    }
    let committed = state.catalog.commit_transaction(changes).await?;
    committed.commit(reservation.as_deref(), no_content()).await
}

// --------------------------------------------------------------------------------------
// Views
// --------------------------------------------------------------------------------------

async fn list_views(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Json<ListIdentifiersResponse>> {
    let views = state.catalog.list_views(&path.ident()?).await?;
    Ok(Json(ListIdentifiersResponse {
        identifiers: views.iter().map(to_identifier).collect(),
    }))
}

async fn create_view(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CreateViewRequest = parse(&body)?;
    let created = state.catalog.create_view(&path.ident()?, request).await?;
    let answer = Json(&created.value).into_response();
    created.commit(reservation.as_deref(), answer).await
}

async fn load_view(
    State(state): State<Arc<AppState>>,
    Path(path): Path<ViewPath>,
) -> ApiResult<Response> {
    let result = state.catalog.load_view(&path.ident()?).await?;
    Ok(Json(result).into_response())
}

async fn view_exists(
    State(state): State<Arc<AppState>>,
    Path(path): Path<ViewPath>,
) -> ApiResult<Response> {
    let ident = path.ident()?;
    if state.catalog.view_exists(&ident).await? {
        Ok(no_content())
    } else {
        Err(ApiError::no_such_view(ident))
    }
}

async fn replace_view(
    State(state): State<Arc<AppState>>,
    Path(path): Path<ViewPath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CommitViewRequest = parse(&body)?;
    let replaced = state
        .catalog
        .replace_view(&path.ident()?, request.requirements, request.updates)
        .await?;
    let answer = Json(&replaced.value).into_response();
    replaced.commit(reservation.as_deref(), answer).await
}

async fn drop_view(
    State(state): State<Arc<AppState>>,
    Path(path): Path<ViewPath>,
    reservation: Reservation,
) -> ApiResult<Response> {
    let dropped = state.catalog.drop_view(&path.ident()?).await?;
    dropped.commit(reservation.as_deref(), no_content()).await
}

async fn rename_view(
    State(state): State<Arc<AppState>>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RenameRequest = parse(&body)?;
    let renamed = state
        .catalog
        .rename_view(
            &identifier(&request.source)?,
            &identifier(&request.destination)?,
        )
        .await?;
    renamed.commit(reservation.as_deref(), no_content()).await
}

async fn register_view(
    State(state): State<Arc<AppState>>,
    Path(path): Path<NamespacePath>,
    reservation: Reservation,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RegisterViewRequest = parse(&body)?;
    let ident = TableIdent::new(path.ident()?, request.name);
    let registered = state
        .catalog
        .register_view(&ident, request.metadata_location)
        .await?;
    let answer = Json(&registered.value).into_response();
    registered.commit(reservation.as_deref(), answer).await
}
