//! Errors as the Iceberg REST spec shapes them: an `ErrorModel` inside an
//! `IcebergErrorResponse`, `{"error": {"message", "type", "code"}}`.
//!
//! The `type` is the name of the exception a Java client raises for it
//! (`NoSuchTableException`, `AlreadyExistsException`, `CommitFailedException`, ...): the
//! Java client picks the exception by status *and* type, PyIceberg by status alone, so both
//! have to be right.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use iceberg::ErrorKind;
use idempotency_core::OutcomeUnknown;

/// An error answer of the catalog.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
    /// Whether the change may have committed: the answer is then marked
    /// [`OutcomeUnknown`], and the idempotency layer keeps the key reserved.
    outcome_unknown: bool,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            outcome_unknown: false,
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BadRequestException", message)
    }

    pub(crate) fn no_such_namespace(namespace: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NoSuchNamespaceException",
            format!("Namespace does not exist: {namespace}"),
        )
    }

    pub(crate) fn no_such_table(table: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NoSuchTableException",
            format!("Table does not exist: {table}"),
        )
    }

    pub(crate) fn no_such_view(view: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NoSuchViewException",
            format!("View does not exist: {view}"),
        )
    }

    pub(crate) fn already_exists(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "AlreadyExistsException", message)
    }

    pub(crate) fn namespace_not_empty(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "NamespaceNotEmptyException", message)
    }

    pub(crate) fn commit_failed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "CommitFailedException", message)
    }

    /// The commit may or may not have happened (the answer to the database's `COMMIT` was
    /// lost, and asking it afterwards did not tell): a 500, which the Java client raises
    /// as `CommitStateUnknownException` (it then leaves the files alone).
    pub(crate) fn commit_state_unknown(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "CommitStateUnknownException",
            message,
        )
    }

    /// This answer marked [`OutcomeUnknown`]: the idempotency layer keeps the key reserved
    /// until it expires instead of releasing it, so that no retry runs the change again.
    pub(crate) fn marked_outcome_unknown(self) -> Self {
        Self {
            outcome_unknown: true,
            ..self
        }
    }

    /// Nothing of the change was committed, and a retry may run it again.
    pub(crate) fn not_committed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableException",
            message,
        )
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "ServiceFailureException",
            message,
        )
    }

    /// Maps an `iceberg` error by its kind. Callers that know better (a not-found of a
    /// view, a conflict that means "not empty") build the [`ApiError`] themselves.
    pub(crate) fn from_iceberg(error: &iceberg::Error) -> Self {
        let message = error.message().to_owned();
        match error.kind() {
            ErrorKind::NamespaceNotFound => {
                Self::new(StatusCode::NOT_FOUND, "NoSuchNamespaceException", message)
            }
            ErrorKind::TableNotFound => {
                Self::new(StatusCode::NOT_FOUND, "NoSuchTableException", message)
            }
            ErrorKind::NamespaceAlreadyExists | ErrorKind::TableAlreadyExists => {
                Self::already_exists(message)
            }
            ErrorKind::CatalogCommitConflicts => Self::commit_failed(message),
            ErrorKind::DataInvalid | ErrorKind::PreconditionFailed => {
                Self::bad_request(error.to_string())
            }
            ErrorKind::FeatureUnsupported => Self::new(
                StatusCode::NOT_ACCEPTABLE,
                "UnsupportedOperationException",
                message,
            ),
            _ => {
                tracing::error!(error = %error, "catalog operation failed");
                Self::internal(message)
            }
        }
    }
}

impl From<iceberg::Error> for ApiError {
    fn from(error: iceberg::Error) -> Self {
        Self::from_iceberg(&error)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        tracing::error!(error = %error, "database statement failed");
        Self::internal(format!("database error: {error}"))
    }
}

impl From<idempotency_core::StoreError> for ApiError {
    /// The idempotency store could not open the change's transaction: nothing ran, and a
    /// retry may succeed.
    fn from(error: idempotency_core::StoreError) -> Self {
        tracing::error!(error = %error, "could not open a transaction for the change");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableException",
            format!("The catalog's database is busy, retry later: {error}"),
        )
    }
}

impl From<idempotency_store_sql::FinalizeError> for ApiError {
    /// The change's transaction was rolled back: nothing of the request is committed.
    fn from(error: idempotency_store_sql::FinalizeError) -> Self {
        match error {
            // Another request holds the key now and makes the change itself; the client's
            // retry with the key gets that request's answer (the Java client resends a
            // 503 with the same key; a 409 would be a definite commit failure).
            idempotency_store_sql::FinalizeError::TakenOver => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableException",
                "This request's Idempotency-Key was taken over by a retry while the request \
                 ran (its lease lapsed), so nothing of it was committed; retry with the same \
                 key to get the retry's answer",
            ),
            other => {
                tracing::error!(error = %other, "recording the answer with the change failed");
                Self::internal(format!(
                    "Cannot record the answer with the change, so nothing was committed; retry: {other}"
                ))
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "code": self.status.as_u16(),
            }
        });
        let mut response = (self.status, Json(body)).into_response();
        if self.outcome_unknown {
            response.extensions_mut().insert(OutcomeUnknown);
        }
        response
    }
}

/// The result of a catalog operation.
pub(crate) type ApiResult<T> = Result<T, ApiError>;
