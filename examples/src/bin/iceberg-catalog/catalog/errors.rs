//! The catalog's refusals that several resources share: a name already taken, and a
//! requirement or update the metadata builder rejected.

use iceberg::{ErrorKind, NamespaceIdent, TableIdent};

use super::names::display_namespace;
use crate::error::ApiError;

pub(super) fn namespace_exists_error(namespace: &NamespaceIdent) -> ApiError {
    ApiError::already_exists(format!(
        "Namespace already exists: {}",
        display_namespace(namespace)
    ))
}

pub(super) fn table_exists_error(ident: &TableIdent) -> ApiError {
    ApiError::already_exists(format!("Table or view already exists: {ident}"))
}

pub(super) fn view_exists_error(ident: &TableIdent) -> ApiError {
    ApiError::already_exists(format!("View or table already exists: {ident}"))
}

pub(super) fn requirement_message(error: &iceberg::Error) -> String {
    error.to_string().replace('\n', " ")
}

/// An update the metadata builder refused: the request is wrong, not the server.
pub(super) fn invalid_update(error: &iceberg::Error) -> ApiError {
    match error.kind() {
        ErrorKind::CatalogCommitConflicts => ApiError::commit_failed(requirement_message(error)),
        _ => ApiError::bad_request(requirement_message(error)),
    }
}
