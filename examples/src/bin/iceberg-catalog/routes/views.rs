//! The view routes: list, create, load, exists, replace, drop, rename, register.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use iceberg::TableIdent;

use crate::catalog::{CatalogDatabase, CatalogTx};

use super::request::{
    AppState, NamespacePath, ViewPath, identifier, no_content, parse, to_identifier,
};
use crate::error::{ApiError, ApiResult};
use crate::rest::{
    CommitViewRequest, CreateViewRequest, ListIdentifiersResponse, RegisterViewRequest,
    RenameRequest,
};

pub(super) async fn list_views<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Json<ListIdentifiersResponse>> {
    let views = state.catalog.list_views(&path.ident()?).await?;
    Ok(Json(ListIdentifiersResponse {
        identifiers: views.iter().map(to_identifier).collect(),
    }))
}

pub(super) async fn create_view<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CreateViewRequest = parse(&body)?;
    let created = state
        .catalog
        .create_view(&path.ident()?, request, tx)
        .await?;
    let answer = Json(&created.value).into_response();
    created.commit(answer).await
}

pub(super) async fn load_view<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<ViewPath>,
) -> ApiResult<Response> {
    let result = state.catalog.load_view(&path.ident()?).await?;
    Ok(Json(result).into_response())
}

pub(super) async fn view_exists<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<ViewPath>,
) -> ApiResult<Response> {
    let ident = path.ident()?;
    if state.catalog.view_exists(&ident).await? {
        Ok(no_content())
    } else {
        Err(ApiError::no_such_view(ident))
    }
}

pub(super) async fn replace_view<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<ViewPath>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: CommitViewRequest = parse(&body)?;
    let replaced = state
        .catalog
        .replace_view(&path.ident()?, request.requirements, request.updates, tx)
        .await?;
    let answer = Json(&replaced.value).into_response();
    replaced.commit(answer).await
}

pub(super) async fn drop_view<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<ViewPath>,
    tx: CatalogTx<DB>,
) -> ApiResult<Response> {
    let dropped = state.catalog.drop_view(&path.ident()?, tx).await?;
    dropped.commit(no_content()).await
}

pub(super) async fn rename_view<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RenameRequest = parse(&body)?;
    let renamed = state
        .catalog
        .rename_view(
            &identifier(&request.source)?,
            &identifier(&request.destination)?,
            tx,
        )
        .await?;
    renamed.commit(no_content()).await
}

pub(super) async fn register_view<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RegisterViewRequest = parse(&body)?;
    let ident = TableIdent::new(path.ident()?, request.name);
    let registered = state
        .catalog
        .register_view(&ident, request.metadata_location, tx)
        .await?;
    let answer = Json(&registered.value).into_response();
    registered.commit(answer).await
}
