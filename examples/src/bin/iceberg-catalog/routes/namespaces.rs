//! The namespace routes: list, create, load, exists, drop, update properties.

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use iceberg::NamespaceIdent;

use crate::catalog::{CatalogDatabase, CatalogTx};

use super::request::{
    AppState, NAMESPACE_SEPARATOR, NamespacePath, no_content, parse, parse_namespace,
};
use crate::error::{ApiError, ApiResult};
use crate::rest::{
    CreateNamespaceRequest, ListNamespacesResponse, NamespaceResponse,
    UpdateNamespacePropertiesRequest,
};

pub(super) async fn list_namespaces<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Query(query): Query<HashMap<String, String>>,
) -> ApiResult<Json<ListNamespacesResponse>> {
    let parent = match query.get("parent").map(String::as_str) {
        None | Some("") => None,
        Some(parent) => Some(parse_namespace(parent)?),
    };
    let namespaces = state.catalog.list_namespaces(parent.as_ref()).await?;
    Ok(Json(ListNamespacesResponse { namespaces }))
}

pub(super) async fn create_namespace<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CreateNamespaceRequest = parse(&body)?;
    let namespace = NamespaceIdent::from_vec(request.namespace.clone())
        .map_err(|e| ApiError::bad_request(e.message().to_owned()))?;
    let created = state
        .catalog
        .create_namespace(&namespace, request.properties, tx)
        .await?;
    let answer = Json(NamespaceResponse {
        namespace: request.namespace,
        properties: created.value.clone(),
    })
    .into_response();
    created.commit(answer).await
}

pub(super) async fn load_namespace<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Json<NamespaceResponse>> {
    let namespace = path.ident()?;
    let properties = state.catalog.load_namespace(&namespace).await?;
    Ok(Json(NamespaceResponse {
        namespace: namespace.inner(),
        properties,
    }))
}

pub(super) async fn namespace_exists<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
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

pub(super) async fn drop_namespace<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
    tx: CatalogTx<DB>,
) -> ApiResult<Response> {
    let dropped = state.catalog.drop_namespace(&path.ident()?, tx).await?;
    dropped.commit(no_content()).await
}

pub(super) async fn update_properties<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: UpdateNamespacePropertiesRequest = parse(&body)?;
    let updated = state
        .catalog
        .update_namespace_properties(&path.ident()?, request.removals, request.updates, tx)
        .await?;
    let answer = Json(&updated.value).into_response();
    updated.commit(answer).await
}
