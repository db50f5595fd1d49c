//! `POST /v1/transactions/commit`: changes to several tables, committed together.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;

use super::request::{AppState, Reservation, identifier, no_content, parse};
use crate::error::{ApiError, ApiResult};
use crate::rest::CommitTransactionRequest;

pub(super) async fn commit_transaction(
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
    let committed = state
        .catalog
        .commit_transaction(changes, reservation.as_deref())
        .await?;
    committed.commit(reservation.as_deref(), no_content()).await
}
