//! The table routes: list, create (and `stage-create`), load, exists, commit (updateTable),
//! drop, report metrics, register, rename.

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use iceberg::TableIdent;

use crate::catalog::{CatalogDatabase, CatalogTx};

use super::request::{
    AppState, NamespacePath, TablePath, identifier, no_content, parse, to_identifier,
};
use crate::error::{ApiError, ApiResult};
use crate::rest::{
    CommitTableRequest, CommitTableResponse, CreateTableRequest, ListIdentifiersResponse,
    RegisterTableRequest, RenameRequest,
};

pub(super) async fn list_tables<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
) -> ApiResult<Json<ListIdentifiersResponse>> {
    let tables = state.catalog.list_tables(&path.ident()?).await?;
    Ok(Json(ListIdentifiersResponse {
        identifiers: tables.iter().map(to_identifier).collect(),
    }))
}

pub(super) async fn create_table<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
    tx: CatalogTx<DB>,
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
    let created = state.catalog.create_table(&namespace, request, tx).await?;
    let answer = Json(&created.value).into_response();
    created.commit(answer).await
}

pub(super) async fn load_table<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<TablePath>,
) -> ApiResult<Response> {
    let result = state.catalog.load_table(&path.ident()?).await?;
    Ok(Json(result).into_response())
}

pub(super) async fn table_exists<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<TablePath>,
) -> ApiResult<Response> {
    let ident = path.ident()?;
    if state.catalog.table_exists(&ident).await? {
        Ok(no_content())
    } else {
        Err(ApiError::no_such_table(ident))
    }
}

pub(super) async fn commit_table<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<TablePath>,
    tx: CatalogTx<DB>,
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
    let committed = state.catalog.commit_table(&ident, request, tx).await?;
    let (metadata_location, metadata) = &committed.value;
    let answer = Json(CommitTableResponse {
        metadata_location: metadata_location.clone(),
        metadata: metadata.clone(),
    })
    .into_response();
    committed.commit(answer).await
}

pub(super) async fn drop_table<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<TablePath>,
    Query(query): Query<HashMap<String, String>>,
    tx: CatalogTx<DB>,
) -> ApiResult<Response> {
    let purge = query
        .get("purgeRequested")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let dropped = state.catalog.drop_table(&path.ident()?, purge, tx).await?;
    dropped.commit(no_content()).await
}

/// Scan and commit reports are accepted and dropped: this catalog keeps no metrics.
pub(super) async fn report_metrics(Path(path): Path<TablePath>) -> ApiResult<Response> {
    path.ident()?;
    Ok(no_content())
}

pub(super) async fn register_table<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    Path(path): Path<NamespacePath>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RegisterTableRequest = parse(&body)?;
    let ident = TableIdent::new(path.ident()?, request.name);
    let registered = state
        .catalog
        .register_table(&ident, request.metadata_location, request.overwrite, tx)
        .await?;
    let answer = Json(&registered.value).into_response();
    registered.commit(answer).await
}

pub(super) async fn rename_table<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    tx: CatalogTx<DB>,
    body: Bytes,
) -> ApiResult<Response> {
    let request: RenameRequest = parse(&body)?;
    let renamed = state
        .catalog
        .rename_table(
            &identifier(&request.source)?,
            &identifier(&request.destination)?,
            tx,
        )
        .await?;
    renamed.commit(no_content()).await
}
