//! `POST /v1/transactions/commit`: changes to several tables, committed together.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;

use crate::catalog::{CatalogDatabase, CatalogTx};

use super::request::{AppState, identifier, no_content, parse};
use crate::error::{ApiError, ApiResult};
use crate::rest::CommitTransactionRequest;

pub(super) async fn commit_transaction<DB: CatalogDatabase>(
    State(state): State<AppState<DB>>,
    tx: CatalogTx<DB>,
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
    let committed = state.catalog.commit_transaction(changes, tx).await?;
    committed.commit(no_content()).await
}
