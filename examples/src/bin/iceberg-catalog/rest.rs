//! The request and response bodies of the Iceberg REST catalog API.
//!
//! Only the envelopes are written here; everything inside them that is Iceberg's table
//! model (schemas, partition specs, sort orders, table metadata, table updates and
//! requirements, view metadata) is the `iceberg` crate's own serde, so what goes over the
//! wire is exactly the spec's JSON.

use std::collections::HashMap;

use iceberg::spec::{
    Schema, SortOrder, TableMetadata, UnboundPartitionSpec, ViewMetadata, ViewVersion,
};
use iceberg::{TableRequirement, TableUpdate, ViewUpdate};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// `GET /v1/config`.
#[derive(Debug, Serialize)]
pub(crate) struct CatalogConfig {
    pub(crate) defaults: HashMap<String, String>,
    pub(crate) overrides: HashMap<String, String>,
    pub(crate) endpoints: Vec<String>,
}

/// A table or view identifier: `{"namespace": ["a", "b"], "name": "t"}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct TableIdentifier {
    pub(crate) namespace: Vec<String>,
    pub(crate) name: String,
}

/// `POST /v1/namespaces`.
#[derive(Debug, Deserialize)]
pub(crate) struct CreateNamespaceRequest {
    pub(crate) namespace: Vec<String>,
    #[serde(default)]
    pub(crate) properties: HashMap<String, String>,
}

/// The answer of createNamespace and loadNamespaceMetadata.
#[derive(Debug, Serialize)]
pub(crate) struct NamespaceResponse {
    pub(crate) namespace: Vec<String>,
    pub(crate) properties: HashMap<String, String>,
}

/// `GET /v1/namespaces`.
#[derive(Debug, Serialize)]
pub(crate) struct ListNamespacesResponse {
    pub(crate) namespaces: Vec<Vec<String>>,
}

/// `POST /v1/namespaces/{namespace}/properties`.
#[derive(Debug, Deserialize)]
pub(crate) struct UpdateNamespacePropertiesRequest {
    #[serde(default)]
    pub(crate) removals: Vec<String>,
    #[serde(default)]
    pub(crate) updates: HashMap<String, String>,
}

/// The answer of updateProperties.
#[derive(Debug, Serialize)]
pub(crate) struct UpdateNamespacePropertiesResponse {
    pub(crate) updated: Vec<String>,
    pub(crate) removed: Vec<String>,
    pub(crate) missing: Vec<String>,
}

/// `GET /v1/namespaces/{namespace}/tables` and `.../views`.
#[derive(Debug, Serialize)]
pub(crate) struct ListIdentifiersResponse {
    pub(crate) identifiers: Vec<TableIdentifier>,
}

/// `POST /v1/namespaces/{namespace}/tables`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct CreateTableRequest {
    pub(crate) name: String,
    pub(crate) location: Option<String>,
    pub(crate) schema: Schema,
    pub(crate) partition_spec: Option<UnboundPartitionSpec>,
    pub(crate) write_order: Option<SortOrder>,
    #[serde(default)]
    pub(crate) stage_create: bool,
    #[serde(default)]
    pub(crate) properties: HashMap<String, String>,
}

/// `POST /v1/namespaces/{namespace}/register`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct RegisterTableRequest {
    pub(crate) name: String,
    pub(crate) metadata_location: String,
    #[serde(default)]
    pub(crate) overwrite: bool,
}

/// The answer of createTable, loadTable and registerTable. `metadata-location` is null
/// for a staged create.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct LoadTableResult {
    pub(crate) metadata_location: Option<String>,
    pub(crate) metadata: TableMetadata,
    pub(crate) config: HashMap<String, String>,
}

/// `POST /v1/namespaces/{namespace}/tables/{table}`, and one entry of a transaction.
#[derive(Debug, Deserialize)]
pub(crate) struct CommitTableRequest {
    pub(crate) identifier: Option<TableIdentifier>,
    #[serde(default)]
    pub(crate) requirements: Vec<TableRequirement>,
    pub(crate) updates: Vec<TableUpdate>,
}

/// The answer of updateTable.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct CommitTableResponse {
    pub(crate) metadata_location: String,
    pub(crate) metadata: TableMetadata,
}

/// `POST /v1/transactions/commit`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct CommitTransactionRequest {
    pub(crate) table_changes: Vec<CommitTableRequest>,
}

/// `POST /v1/tables/rename` and `POST /v1/views/rename`.
#[derive(Debug, Deserialize)]
pub(crate) struct RenameRequest {
    pub(crate) source: TableIdentifier,
    pub(crate) destination: TableIdentifier,
}

/// `POST /v1/namespaces/{namespace}/views`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct CreateViewRequest {
    pub(crate) name: String,
    pub(crate) location: Option<String>,
    pub(crate) schema: Schema,
    pub(crate) view_version: ViewVersion,
    #[serde(default)]
    pub(crate) properties: HashMap<String, String>,
}

/// `POST /v1/namespaces/{namespace}/views/{view}`.
#[derive(Debug, Deserialize)]
pub(crate) struct CommitViewRequest {
    #[serde(default)]
    pub(crate) requirements: Vec<ViewRequirement>,
    pub(crate) updates: Vec<ViewUpdate>,
}

/// The one requirement the spec defines for views.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub(crate) enum ViewRequirement {
    /// The view's UUID must be this one.
    AssertViewUuid {
        /// The expected UUID.
        uuid: uuid::Uuid,
    },
}

/// The answer of createView, loadView, replaceView and registerView.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct LoadViewResult {
    pub(crate) metadata_location: String,
    pub(crate) metadata: ViewMetadata,
    pub(crate) config: HashMap<String, String>,
}

/// The answer of registerTable and registerView: the metadata file's own JSON as it was
/// read, not re-serialized, so that the answer is exactly what the idempotency layer reads
/// back from the file for a replay.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct RegisteredResult {
    pub(crate) metadata_location: String,
    pub(crate) metadata: Box<RawValue>,
    pub(crate) config: HashMap<String, String>,
}

/// `POST /v1/namespaces/{namespace}/register-view`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct RegisterViewRequest {
    pub(crate) name: String,
    pub(crate) metadata_location: String,
}
