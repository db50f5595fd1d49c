//! Views: list, exists, create, load, replace, drop, rename, register.
//!
//! A view is a row of `iceberg_tables` with `iceberg_type = 'VIEW'` (as in the Java JDBC
//! catalog) pointing at its metadata file, which this module writes and reads as JSON.

use std::collections::HashMap;

use iceberg::spec::{ViewFormatVersion, ViewMetadata, ViewMetadataBuilder};
use iceberg::{NamespaceIdent, TableIdent, ViewUpdate};

use super::connection::Catalog;
use super::database::{CATALOG_NAME, CatalogDatabase, VIEW_TYPE_FILTER};
use super::errors::{invalid_update, view_exists_error};
use super::names::check_name;
use super::uncommitted::Uncommitted;
use super::writes::CatalogTx;
use crate::error::{ApiError, ApiResult};
use crate::rest::{CreateViewRequest, LoadViewResult, RegisteredResult, ViewRequirement};

impl<DB: CatalogDatabase> Catalog<DB> {
    /// The views in a namespace, sorted.
    pub(crate) async fn list_views(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<Vec<TableIdent>> {
        self.require_namespace(namespace).await?;
        let names = self
            .db
            .fetch_texts(
                &format!(
                    "SELECT table_name FROM iceberg_tables \
                     WHERE catalog_name = ? AND table_namespace = ? AND {VIEW_TYPE_FILTER}"
                ),
                &[CATALOG_NAME, &namespace.join(".")],
            )
            .await?;
        let mut views: Vec<TableIdent> = names
            .into_iter()
            .map(|name| TableIdent::new(namespace.clone(), name))
            .collect();
        views.sort_by(|a, b| a.name().cmp(b.name()));
        Ok(views)
    }

    /// Whether a view exists.
    pub(crate) async fn view_exists(&self, ident: &TableIdent) -> ApiResult<bool> {
        Ok(self
            .db
            .metadata_location(ident, VIEW_TYPE_FILTER)
            .await?
            .is_some())
    }

    /// Creates a view.
    pub(crate) async fn create_view(
        &self,
        namespace: &NamespaceIdent,
        request: CreateViewRequest,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, LoadViewResult>> {
        check_name(&request.name)?;
        self.require_namespace(namespace).await?;
        let ident = TableIdent::new(namespace.clone(), request.name.clone());
        if self.db.name_taken(&ident).await? {
            return Err(view_exists_error(&ident));
        }
        let location = match request.location {
            Some(location) => location.trim_end_matches('/').to_owned(),
            None => self.default_location(namespace, &request.name).await?,
        };
        self.check_location(&location)?;
        let metadata = ViewMetadataBuilder::new(
            location,
            request.schema,
            request.view_version,
            ViewFormatVersion::V1,
            request.properties,
        )
        .and_then(ViewMetadataBuilder::build)
        .map_err(|e| invalid_update(&e))?
        .metadata;
        let metadata_location = view_metadata_location(&metadata, 0);
        self.write_view_metadata(&metadata_location, &metadata)
            .await?;
        let written = vec![metadata_location.clone()];
        let mut tx = match tx.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.delete_unused(&written).await;
                return Err(e.into());
            }
        };
        let inserted = self
            .db
            .execute_in(
                &mut tx,
                "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                 metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'VIEW')",
                &[
                    CATALOG_NAME,
                    &namespace.join("."),
                    ident.name(),
                    &metadata_location,
                ],
            )
            .await;
        if let Err(e) = inserted {
            drop(tx);
            self.delete_unused(&written).await;
            return Err(if self.db.name_taken(&ident).await? {
                view_exists_error(&ident)
            } else {
                e.into()
            });
        }
        let mut created = Uncommitted::new(
            self,
            tx,
            LoadViewResult {
                metadata_location,
                metadata,
                config: HashMap::new(),
            },
        );
        created.written = written;
        Ok(created)
    }

    async fn write_view_metadata(&self, location: &str, metadata: &ViewMetadata) -> ApiResult<()> {
        let json = serde_json::to_vec(metadata)
            .map_err(|e| ApiError::internal(format!("cannot serialize view metadata: {e}")))?;
        self.file_io
            .new_output(location)?
            .write(json.into())
            .await?;
        Ok(())
    }

    /// A view's current metadata and its location.
    pub(crate) async fn load_view(&self, ident: &TableIdent) -> ApiResult<LoadViewResult> {
        let Some(location) = self.db.metadata_location(ident, VIEW_TYPE_FILTER).await? else {
            return Err(ApiError::no_such_view(ident));
        };
        let bytes = self.file_io.new_input(&location)?.read().await?;
        let metadata: ViewMetadata = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::internal(format!("cannot read view metadata at {location}: {e}"))
        })?;
        Ok(LoadViewResult {
            metadata_location: location,
            metadata,
            config: HashMap::new(),
        })
    }

    /// Applies updates to a view (replaceView), compare-and-swap on its metadata location.
    pub(crate) async fn replace_view(
        &self,
        ident: &TableIdent,
        requirements: Vec<ViewRequirement>,
        updates: Vec<ViewUpdate>,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, LoadViewResult>> {
        let current = self.load_view(ident).await?;
        for requirement in requirements {
            match requirement {
                ViewRequirement::AssertViewUuid { uuid } if uuid != current.metadata.uuid() => {
                    return Err(ApiError::commit_failed(format!(
                        "Requirement failed: view UUID does not match: expected {uuid}, found {}",
                        current.metadata.uuid()
                    )));
                }
                ViewRequirement::AssertViewUuid { .. } => {}
            }
        }
        let mut builder = current.metadata.into_builder();
        for update in updates {
            builder = apply_view_update(builder, update).map_err(|e| invalid_update(&e))?;
        }
        let metadata = builder.build().map_err(|e| invalid_update(&e))?.metadata;
        self.check_location(metadata.location())?;
        let version = view_metadata_version(&current.metadata_location).map_or(0, |v| v + 1);
        let location = view_metadata_location(&metadata, version);
        self.write_view_metadata(&location, &metadata).await?;
        let written = vec![location.clone()];
        let mut tx = match tx.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.delete_unused(&written).await;
                return Err(e.into());
            }
        };
        let swapped = self.db
            .execute_in(
                &mut tx,
                &format!(
                    "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND metadata_location = ? AND {VIEW_TYPE_FILTER}"
                ),
                &[
                    &location,
                    &current.metadata_location,
                    CATALOG_NAME,
                    &ident.namespace().join("."),
                    ident.name(),
                    &current.metadata_location,
                ],
            )
            .await;
        if swapped.as_ref().is_ok_and(|swapped| *swapped == 1) {
            let mut replaced = Uncommitted::new(
                self,
                tx,
                LoadViewResult {
                    metadata_location: location,
                    metadata,
                    config: HashMap::new(),
                },
            );
            replaced.written = written;
            return Ok(replaced);
        }
        drop(tx);
        self.delete_unused(&written).await;
        swapped?;
        Err(ApiError::commit_failed(format!(
            "Commit failed: view {ident} was changed by another commit"
        )))
    }

    /// Drops a view from the catalog.
    pub(crate) async fn drop_view(
        &self,
        ident: &TableIdent,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, ()>> {
        let mut tx = tx.begin().await?;
        let deleted = self
            .db
            .execute_in(
                &mut tx,
                &format!(
                    "DELETE FROM iceberg_tables WHERE catalog_name = ? AND table_namespace = ? \
                     AND table_name = ? AND {VIEW_TYPE_FILTER}"
                ),
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        if deleted == 0 {
            return Err(ApiError::no_such_view(ident));
        }
        Ok(Uncommitted::new(self, tx, ()))
    }

    /// Renames a view, possibly into another namespace.
    pub(crate) async fn rename_view(
        &self,
        from: &TableIdent,
        to: &TableIdent,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, ()>> {
        check_name(to.name())?;
        if !self.view_exists(from).await? {
            return Err(ApiError::no_such_view(from));
        }
        if from == to {
            // Nothing changes; the answer is still recorded with the key.
            return Ok(Uncommitted::new(self, tx.begin().await?, ()));
        }
        self.require_namespace(to.namespace()).await?;
        if self.db.name_taken(to).await? {
            return Err(view_exists_error(to));
        }
        let mut tx = tx.begin().await?;
        let renamed = self
            .db
            .execute_in(
                &mut tx,
                &format!(
                    "UPDATE iceberg_tables SET table_namespace = ?, table_name = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND {VIEW_TYPE_FILTER}"
                ),
                &[
                    &to.namespace().join("."),
                    to.name(),
                    CATALOG_NAME,
                    &from.namespace().join("."),
                    from.name(),
                ],
            )
            .await;
        match renamed {
            Ok(1) => Ok(Uncommitted::new(self, tx, ())),
            Ok(_) => Err(ApiError::no_such_view(from)),
            Err(e) => {
                drop(tx);
                if self.db.name_taken(to).await? {
                    Err(view_exists_error(to))
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// Registers an existing view metadata file as a view.
    pub(crate) async fn register_view(
        &self,
        ident: &TableIdent,
        metadata_location: String,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, RegisteredResult>> {
        check_name(ident.name())?;
        self.require_namespace(ident.namespace()).await?;
        self.check_location(&metadata_location)?;
        // Answered as read: the file's own JSON, which is what a replay reads back.
        let metadata = self
            .read_metadata_json(&metadata_location)
            .await
            .map_err(|e| ApiError::bad_request(format!("Cannot read {metadata_location}: {e}")))?;
        serde_json::from_str::<ViewMetadata>(metadata.get()).map_err(|e| {
            ApiError::bad_request(format!("{metadata_location} is not view metadata: {e}"))
        })?;
        if self.db.name_taken(ident).await? {
            return Err(view_exists_error(ident));
        }
        let mut tx = tx.begin().await?;
        let inserted = self
            .db
            .execute_in(
                &mut tx,
                "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                 metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'VIEW')",
                &[
                    CATALOG_NAME,
                    &ident.namespace().join("."),
                    ident.name(),
                    &metadata_location,
                ],
            )
            .await;
        if let Err(e) = inserted {
            drop(tx);
            return Err(if self.db.name_taken(ident).await? {
                view_exists_error(ident)
            } else {
                e.into()
            });
        }
        Ok(Uncommitted::new(
            self,
            tx,
            RegisteredResult {
                metadata_location,
                metadata,
                config: HashMap::new(),
            },
        ))
    }
}

fn apply_view_update(
    builder: ViewMetadataBuilder,
    update: ViewUpdate,
) -> iceberg::Result<ViewMetadataBuilder> {
    match update {
        ViewUpdate::AssignUuid { uuid } => Ok(builder.assign_uuid(uuid)),
        ViewUpdate::UpgradeFormatVersion { format_version } => {
            builder.upgrade_format_version(format_version)
        }
        ViewUpdate::AddSchema { schema, .. } => Ok(builder.add_schema(schema)),
        ViewUpdate::SetLocation { location } => Ok(builder.set_location(location)),
        ViewUpdate::SetProperties { updates } => builder.set_properties(updates),
        ViewUpdate::RemoveProperties { removals } => Ok(builder.remove_properties(&removals)),
        ViewUpdate::AddViewVersion { view_version } => builder.add_version(view_version),
        ViewUpdate::SetCurrentViewVersion { view_version_id } => {
            builder.set_current_version_id(view_version_id)
        }
    }
}

/// `<location>/metadata/<version>-<uuid>.metadata.json`, like tables.
fn view_metadata_location(metadata: &ViewMetadata, version: u32) -> String {
    format!(
        "{}/metadata/{version:05}-{}.metadata.json",
        metadata.location().trim_end_matches('/'),
        uuid::Uuid::new_v4()
    )
}

/// The version number in a `<version>-<uuid>.metadata.json` file name.
fn view_metadata_version(location: &str) -> Option<u32> {
    let file = location.rsplit('/').next()?;
    file.split('-').next()?.parse().ok()
}
