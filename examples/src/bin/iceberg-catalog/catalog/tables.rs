//! Tables: list, exists, create (and `stage-create`), load, drop (with purge), rename,
//! register. Commits to existing tables are in [`super::transactions`].
//!
//! A table is a row of `iceberg_tables` with `iceberg_type = 'TABLE'` pointing at its
//! current metadata file.

use std::collections::HashMap;

use iceberg::spec::{TableMetadata, TableMetadataBuilder};
use iceberg::{
    Catalog as _, ErrorKind, MetadataLocation, NamespaceIdent, TableCreation, TableIdent,
};

use super::connection::Catalog;
use super::database::{CATALOG_NAME, CatalogDatabase, TABLE_TYPE_FILTER};
use super::errors::table_exists_error;
use super::log::LOG_TARGET;
use super::names::{check_name, display_namespace};
use super::uncommitted::Uncommitted;
use super::writes::CatalogTx;
use crate::error::{ApiError, ApiResult};
use crate::rest::{CreateTableRequest, LoadTableResult, RegisteredResult};

impl<DB: CatalogDatabase> Catalog<DB> {
    /// The tables in a namespace, sorted.
    pub(crate) async fn list_tables(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<Vec<TableIdent>> {
        match self.sql_catalog.list_tables(namespace).await {
            Ok(mut tables) => {
                tables.sort_by(|a, b| a.name().cmp(b.name()));
                Ok(tables)
            }
            Err(e) if e.kind() == ErrorKind::NamespaceNotFound => {
                Err(ApiError::no_such_namespace(display_namespace(namespace)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether a table exists.
    pub(crate) async fn table_exists(&self, table: &TableIdent) -> ApiResult<bool> {
        Ok(self.sql_catalog.table_exists(table).await?)
    }

    /// Creates a table: writes its first metadata file and inserts its row.
    pub(crate) async fn create_table(
        &self,
        namespace: &NamespaceIdent,
        request: CreateTableRequest,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, LoadTableResult>> {
        let (ident, creation) = self.table_creation(namespace, request).await?;
        let location = creation.location.clone().unwrap_or_default();
        let metadata = TableMetadataBuilder::from_table_creation(creation)?
            .build()?
            .metadata;
        let metadata_location = MetadataLocation::new_with_metadata(location, &metadata);
        metadata.write_to(&self.file_io, &metadata_location).await?;
        let metadata_location = metadata_location.to_string();
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
                 metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'TABLE')",
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
            // Lost a race with another replica: the primary key let only one in.
            return Err(if self.db.name_taken(&ident).await? {
                table_exists_error(&ident)
            } else {
                e.into()
            });
        }
        let mut created = Uncommitted::new(
            self,
            tx,
            LoadTableResult {
                metadata_location: Some(metadata_location),
                metadata,
                config: HashMap::new(),
            },
        );
        created.written = written;
        Ok(created)
    }

    /// `stage-create`: computes a table's first metadata and writes nothing; the
    /// client's create transaction (a commit with `assert-create`) creates it.
    pub(crate) async fn stage_create_table(
        &self,
        namespace: &NamespaceIdent,
        request: CreateTableRequest,
    ) -> ApiResult<LoadTableResult> {
        let (_, creation) = self.table_creation(namespace, request).await?;
        let metadata = TableMetadataBuilder::from_table_creation(creation)?
            .build()?
            .metadata;
        Ok(LoadTableResult {
            metadata_location: None,
            metadata,
            config: HashMap::new(),
        })
    }

    /// Checks a create request (name, namespace, location inside the warehouse) and
    /// turns it into a `TableCreation` with its location set.
    async fn table_creation(
        &self,
        namespace: &NamespaceIdent,
        request: CreateTableRequest,
    ) -> ApiResult<(TableIdent, TableCreation)> {
        check_name(&request.name)?;
        self.require_namespace(namespace).await?;
        let ident = TableIdent::new(namespace.clone(), request.name.clone());
        if self.db.name_taken(&ident).await? {
            return Err(table_exists_error(&ident));
        }
        let location = match request.location {
            Some(location) => location.trim_end_matches('/').to_owned(),
            None => self.default_location(namespace, &request.name).await?,
        };
        self.check_location(&location)?;
        let creation = TableCreation::builder()
            .name(request.name)
            .location(location)
            .schema(request.schema)
            .partition_spec_opt(request.partition_spec)
            .sort_order_opt(request.write_order)
            .properties(request.properties)
            .build();
        Ok((ident, creation))
    }

    /// A table's current metadata and its location.
    pub(crate) async fn load_table(&self, ident: &TableIdent) -> ApiResult<LoadTableResult> {
        let Some(location) = self.db.metadata_location(ident, TABLE_TYPE_FILTER).await? else {
            return Err(ApiError::no_such_table(ident));
        };
        let metadata = TableMetadata::read_from(&self.file_io, &location).await?;
        Ok(LoadTableResult {
            metadata_location: Some(location),
            metadata,
            config: HashMap::new(),
        })
    }

    /// Drops a table from the catalog; with `purge` its files are deleted once the drop
    /// committed.
    pub(crate) async fn drop_table(
        &self,
        ident: &TableIdent,
        purge: bool,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, ()>> {
        let table = if purge {
            match self.sql_catalog.load_table(ident).await {
                Ok(table) => Some(table),
                Err(e) if e.kind() == ErrorKind::TableNotFound => {
                    return Err(ApiError::no_such_table(ident));
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            None
        };
        let mut tx = tx.begin().await?;
        let deleted = self
            .db
            .execute_in(
                &mut tx,
                &format!(
                    "DELETE FROM iceberg_tables WHERE catalog_name = ? AND table_namespace = ? \
                     AND table_name = ? AND {TABLE_TYPE_FILTER}"
                ),
                &[CATALOG_NAME, &ident.namespace().join("."), ident.name()],
            )
            .await?;
        if deleted == 0 {
            return Err(ApiError::no_such_table(ident));
        }
        let mut dropped = Uncommitted::new(self, tx, ());
        dropped.purge = table;
        Ok(dropped)
    }

    /// Renames a table, possibly into another namespace. Its files stay where they are.
    pub(crate) async fn rename_table(
        &self,
        from: &TableIdent,
        to: &TableIdent,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, ()>> {
        check_name(to.name())?;
        if !self.table_exists(from).await? {
            return Err(ApiError::no_such_table(from));
        }
        if from == to {
            // Nothing changes; the answer is still recorded with the key.
            return Ok(Uncommitted::new(self, tx.begin().await?, ()));
        }
        self.require_namespace(to.namespace()).await?;
        if self.db.name_taken(to).await? {
            return Err(table_exists_error(to));
        }
        let mut tx = tx.begin().await?;
        let renamed = self
            .db
            .execute_in(
                &mut tx,
                &format!(
                    "UPDATE iceberg_tables SET table_namespace = ?, table_name = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND {TABLE_TYPE_FILTER}"
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
            Ok(_) => Err(ApiError::no_such_table(from)),
            Err(e) => {
                drop(tx);
                // Lost a race with another replica: the primary key let only one in.
                if self.db.name_taken(to).await? {
                    Err(table_exists_error(to))
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// Registers an existing metadata file as a table; with `overwrite` replaces the
    /// metadata location of a table that exists.
    pub(crate) async fn register_table(
        &self,
        ident: &TableIdent,
        metadata_location: String,
        overwrite: bool,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, RegisteredResult>> {
        check_name(ident.name())?;
        self.require_namespace(ident.namespace()).await?;
        self.check_location(&metadata_location)?;
        let unreadable = |e: &dyn std::fmt::Display| {
            ApiError::bad_request(format!(
                "Cannot read table metadata at {metadata_location}: {e}"
            ))
        };
        // Answered as read: the file's own JSON, which is what a replay reads back.
        let metadata = self
            .read_metadata_json(&metadata_location)
            .await
            .map_err(|e| unreadable(&e))?;
        serde_json::from_str::<TableMetadata>(metadata.get()).map_err(|e| unreadable(&e))?;
        let current = self.db.metadata_location(ident, TABLE_TYPE_FILTER).await?;
        let mut tx = tx.begin().await?;
        let written = match current {
            Some(current) if overwrite => {
                self.db.execute_in(
                    &mut tx,
                    "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                     WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                     AND metadata_location = ?",
                    &[
                        &metadata_location,
                        &current,
                        CATALOG_NAME,
                        &ident.namespace().join("."),
                        ident.name(),
                        &current,
                    ],
                )
                .await
            }
            Some(_) => return Err(table_exists_error(ident)),
            None => {
                self.db.execute_in(
                    &mut tx,
                    "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                     metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'TABLE')",
                    &[
                        CATALOG_NAME,
                        &ident.namespace().join("."),
                        ident.name(),
                        &metadata_location,
                    ],
                )
                .await
            }
        };
        match written {
            Ok(1) => {}
            Ok(_) => {
                return Err(ApiError::commit_failed(format!(
                    "Table {ident} changed concurrently"
                )));
            }
            Err(e) => {
                drop(tx);
                if self.db.name_taken(ident).await? {
                    tracing::debug!(target: LOG_TARGET, error = %e, "register lost a race");
                    return Err(table_exists_error(ident));
                }
                return Err(e.into());
            }
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
