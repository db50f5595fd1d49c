//! What the handlers share: the state (and the change's transaction from it), the path segments that
//! name a namespace, table or view, and the request bodies.
//!
//! Request bodies are parsed here rather than by axum's `Json` extractor, so that a body
//! that is not the spec's JSON (an unknown table update, say) gets the spec's 400
//! `BadRequestException` instead of axum's 422.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use iceberg::{NamespaceIdent, TableIdent};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::catalog::{Catalog, CatalogDatabase, Writes};
use crate::error::{ApiError, ApiResult};
use crate::rest::TableIdentifier;

/// What every handler shares (a clone shares the catalog).
pub(crate) struct AppState<DB: CatalogDatabase> {
    pub(crate) catalog: Arc<Catalog<DB>>,
}

impl<DB: CatalogDatabase> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            catalog: self.catalog.clone(),
        }
    }
}

/// A change's transaction comes from the catalog's [`Writes`].
impl<DB: CatalogDatabase> FromRef<AppState<DB>> for Writes<DB> {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.catalog.writes.clone()
    }
}

/// The unit separator that joins namespace levels in a path segment (the spec's default
/// `namespace-separator`).
pub(super) const NAMESPACE_SEPARATOR: char = '\u{1f}';

#[derive(Deserialize)]
pub(super) struct NamespacePath {
    pub(super) namespace: String,
}

#[derive(Deserialize)]
pub(super) struct TablePath {
    pub(super) namespace: String,
    table: String,
}

#[derive(Deserialize)]
pub(super) struct ViewPath {
    pub(super) namespace: String,
    view: String,
}

impl NamespacePath {
    pub(super) fn ident(&self) -> ApiResult<NamespaceIdent> {
        parse_namespace(&self.namespace)
    }
}

impl TablePath {
    pub(super) fn ident(&self) -> ApiResult<TableIdent> {
        Ok(TableIdent::new(
            parse_namespace(&self.namespace)?,
            self.table.clone(),
        ))
    }
}

impl ViewPath {
    pub(super) fn ident(&self) -> ApiResult<TableIdent> {
        Ok(TableIdent::new(
            parse_namespace(&self.namespace)?,
            self.view.clone(),
        ))
    }
}

/// A namespace path segment (already percent-decoded): levels joined by `0x1F`.
pub(super) fn parse_namespace(segment: &str) -> ApiResult<NamespaceIdent> {
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

pub(super) fn identifier(ident: &TableIdentifier) -> ApiResult<TableIdent> {
    let namespace = NamespaceIdent::from_vec(ident.namespace.clone())
        .map_err(|e| ApiError::bad_request(e.message().to_owned()))?;
    Ok(TableIdent::new(namespace, ident.name.clone()))
}

pub(super) fn to_identifier(ident: &TableIdent) -> TableIdentifier {
    TableIdentifier {
        namespace: ident.namespace().clone().inner(),
        name: ident.name().to_owned(),
    }
}

/// Parses a JSON request body; anything that is not the spec's JSON is a 400.
pub(super) fn parse<T: DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Malformed request body: {e}")))
}

pub(super) fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}
