//! Commits: `updateTable` on one table and `commitTransaction` on several, both a
//! compare-and-swap on each table's metadata location, and the create transaction that
//! follows a `stage-create`.
//!
//! A commit is prepared first (requirements checked, updates applied, the new metadata
//! file written) and swapped in after; the swaps of one transaction share one database
//! transaction, so a multi-table commit lands whole or not at all.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;

use iceberg::spec::{
    FormatVersion, SortOrder, TableMetadata, TableMetadataBuilder, UnboundPartitionSpec,
};
use iceberg::{MetadataLocation, TableIdent, TableRequirement, TableUpdate};

use super::connection::Catalog;
use super::database::{CATALOG_NAME, CatalogDatabase, TABLE_TYPE_FILTER};
use super::errors::{invalid_update, requirement_message};
use super::log::LOG_TARGET;
use super::uncommitted::Uncommitted;
use super::writes::CatalogTx;
use crate::error::{ApiError, ApiResult};
use crate::rest::CommitTableRequest;

/// A commit whose new metadata file is written but not yet swapped in.
struct PreparedCommit {
    ident: TableIdent,
    /// The metadata location the commit was computed on; `None` for a create transaction.
    base: Option<String>,
    location: String,
    metadata: TableMetadata,
}

impl<DB: CatalogDatabase> Catalog<DB> {
    /// Commits requirements and updates to one table (updateTable): its new metadata
    /// location and metadata.
    pub(crate) async fn commit_table(
        &self,
        ident: &TableIdent,
        request: CommitTableRequest,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, (String, TableMetadata)>> {
        let prepared = self
            .prepare_commit(ident.clone(), request.requirements, request.updates)
            .await?;
        let swapped = self.swap_in(vec![prepared], tx).await?;
        Ok(swapped.map(|mut commits| {
            let commit = commits.pop().expect("one commit");
            (commit.location, commit.metadata)
        }))
    }

    /// Commits changes to several tables atomically (commitTransaction): all or none.
    pub(crate) async fn commit_transaction(
        &self,
        changes: Vec<(TableIdent, CommitTableRequest)>,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, ()>> {
        let mut seen = HashSet::new();
        let mut prepared = Vec::with_capacity(changes.len());
        for (ident, change) in changes {
            if !seen.insert(ident.clone()) {
                self.discard(&prepared).await;
                return Err(ApiError::bad_request(format!(
                    "Table {ident} appears more than once in the transaction"
                )));
            }
            match self
                .prepare_commit(ident, change.requirements, change.updates)
                .await
            {
                Ok(commit) => prepared.push(commit),
                Err(e) => {
                    self.discard(&prepared).await;
                    return Err(e);
                }
            }
        }
        Ok(self.swap_in(prepared, tx).await?.map(drop))
    }

    /// Checks the requirements against the current metadata, applies the updates and
    /// writes the new metadata file. Nothing is visible to readers yet.
    async fn prepare_commit(
        &self,
        ident: TableIdent,
        requirements: Vec<TableRequirement>,
        updates: Vec<TableUpdate>,
    ) -> ApiResult<PreparedCommit> {
        let base = self.db.metadata_location(&ident, TABLE_TYPE_FILTER).await?;
        let (metadata, location) = match &base {
            Some(base) => {
                let current = TableMetadata::read_from(&self.file_io, base).await?;
                for requirement in &requirements {
                    requirement
                        .check(Some(&current))
                        .map_err(|e| ApiError::commit_failed(requirement_message(&e)))?;
                }
                let mut builder = current.into_builder(Some(base.clone()));
                for update in updates {
                    builder = update.apply(builder).map_err(|e| invalid_update(&e))?;
                }
                let metadata = builder.build().map_err(|e| invalid_update(&e))?.metadata;
                let location = match MetadataLocation::from_str(base) {
                    Ok(base) => base.with_next_version().with_new_metadata(&metadata),
                    // A registered table whose file is not named `<version>-<uuid>...`.
                    Err(_) => MetadataLocation::new_with_metadata(metadata.location(), &metadata),
                };
                (metadata, location)
            }
            None => {
                if !requirements.contains(&TableRequirement::NotExist) {
                    return Err(ApiError::no_such_table(&ident));
                }
                self.require_namespace(ident.namespace()).await?;
                if self.db.name_taken(&ident).await? {
                    return Err(ApiError::commit_failed(format!(
                        "Requirement failed: {ident} already exists as a view"
                    )));
                }
                let default_location = self
                    .default_location(ident.namespace(), ident.name())
                    .await?;
                let metadata = metadata_from_create_transaction(updates, default_location)?;
                let location = MetadataLocation::new_with_metadata(metadata.location(), &metadata);
                (metadata, location)
            }
        };
        self.check_location(metadata.location())?;
        metadata.write_to(&self.file_io, &location).await?;
        Ok(PreparedCommit {
            ident,
            base,
            location: location.to_string(),
            metadata,
        })
    }

    /// Swaps the prepared metadata locations in, in one database transaction, each only
    /// if its table is still at the base it was computed on.
    async fn swap_in(
        &self,
        commits: Vec<PreparedCommit>,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, Vec<PreparedCommit>>> {
        let mut tx = match tx.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.discard(&commits).await;
                return Err(e.into());
            }
        };
        for commit in &commits {
            let namespace = commit.ident.namespace().join(".");
            let swapped = match &commit.base {
                Some(base) => {
                    self.db.execute_in(
                        &mut tx,
                        "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                         WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                         AND metadata_location = ?",
                        &[&commit.location, base, CATALOG_NAME, &namespace, commit.ident.name(), base],
                    )
                    .await
                }
                None => {
                    self.db.execute_in(
                        &mut tx,
                        "INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, \
                         metadata_location, iceberg_type) VALUES (?, ?, ?, ?, 'TABLE')",
                        &[CATALOG_NAME, &namespace, commit.ident.name(), &commit.location],
                    )
                    .await
                }
            };
            let failure = match swapped {
                Ok(1) => continue,
                Ok(_) => ApiError::commit_failed(format!(
                    "Commit failed: table {} was changed by another commit; retry on its new metadata",
                    commit.ident
                )),
                Err(e) if commit.base.is_none() => {
                    tracing::debug!(target: LOG_TARGET, error = %e, "create transaction lost a race");
                    ApiError::commit_failed(format!(
                        "Requirement failed: table {} was created concurrently",
                        commit.ident
                    ))
                }
                Err(e) => e.into(),
            };
            drop(tx);
            self.discard(&commits).await;
            return Err(failure);
        }
        let written = commits.iter().map(|c| c.location.clone()).collect();
        let mut swapped = Uncommitted::new(self, tx, commits);
        swapped.written = written;
        Ok(swapped)
    }

    /// Deletes the metadata files of commits that were not swapped in.
    async fn discard(&self, commits: &[PreparedCommit]) {
        for commit in commits {
            if let Err(e) = self.file_io.delete(&commit.location).await {
                tracing::warn!(target: LOG_TARGET, location = %commit.location, error = %e, "could not delete an unused metadata file");
            }
        }
    }
}

/// Builds the first metadata of a table from the updates of a create transaction (a
/// commit with `assert-create` after `stage-create`): the initial schema, spec, sort
/// order, location, properties, format version and UUID start the metadata, and the
/// updates after them (a first snapshot, more properties) are applied on top.
fn metadata_from_create_transaction(
    updates: Vec<TableUpdate>,
    default_location: String,
) -> ApiResult<TableMetadata> {
    let mut schema = None;
    let mut spec = None;
    let mut sort_order = None;
    let mut location = None;
    let mut format_version = FormatVersion::V2;
    let mut uuid = None;
    let mut properties = HashMap::new();
    let mut rest = Vec::new();
    for update in updates {
        match update {
            TableUpdate::AddSchema { schema: s } if schema.is_none() => schema = Some(s),
            TableUpdate::AddSpec { spec: s } if spec.is_none() => spec = Some(s),
            TableUpdate::AddSortOrder { sort_order: s } if sort_order.is_none() => {
                sort_order = Some(s)
            }
            TableUpdate::SetLocation { location: l } if location.is_none() => location = Some(l),
            TableUpdate::UpgradeFormatVersion { format_version: v } => format_version = v,
            TableUpdate::AssignUuid { uuid: u } => uuid = Some(u),
            TableUpdate::SetProperties { updates } if rest.is_empty() => properties.extend(updates),
            // Selecting what was just added is what `new` does already.
            TableUpdate::SetCurrentSchema { schema_id: -1 }
            | TableUpdate::SetDefaultSpec { spec_id: -1 }
            | TableUpdate::SetDefaultSortOrder { sort_order_id: -1 }
                if rest.is_empty() => {}
            other => rest.push(other),
        }
    }
    let schema = schema.ok_or_else(|| {
        ApiError::bad_request("A create transaction must add a schema (add-schema)")
    })?;
    let mut builder = TableMetadataBuilder::new(
        schema,
        spec.unwrap_or_else(|| UnboundPartitionSpec::builder().build()),
        sort_order.unwrap_or_else(SortOrder::unsorted_order),
        location.unwrap_or(default_location),
        format_version,
        properties,
    )
    .map_err(|e| invalid_update(&e))?;
    if let Some(uuid) = uuid {
        builder = builder.assign_uuid(uuid);
    }
    for update in rest {
        builder = update.apply(builder).map_err(|e| invalid_update(&e))?;
    }
    Ok(builder.build().map_err(|e| invalid_update(&e))?.metadata)
}
