//! Namespaces: create, load, list, update properties, drop.
//!
//! A namespace is its rows in `iceberg_namespace_properties`, plus a marker row
//! ([`EXISTS_PROPERTY`]) so that it exists without properties. Another client of the same
//! tables may leave a namespace that exists only through its tables; listing counts those.

use std::collections::{BTreeSet, HashMap, HashSet};

use iceberg::{Catalog as _, ErrorKind, NamespaceIdent};

use super::connection::Catalog;
use super::database::{CATALOG_NAME, CatalogDatabase};
use super::errors::namespace_exists_error;
use super::names::{check_namespace, display_namespace};
use super::uncommitted::Uncommitted;
use super::writes::CatalogTx;
use crate::error::{ApiError, ApiResult};
use crate::rest::UpdateNamespacePropertiesResponse;

/// The property `SqlCatalog` stores on every namespace so that it exists without others.
const EXISTS_PROPERTY: &str = "exists";

impl<DB: CatalogDatabase> Catalog<DB> {
    /// Creates a namespace with its properties; 409 if it exists.
    pub(crate) async fn create_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, HashMap<String, String>>> {
        check_namespace(namespace)?;
        check_property_keys(properties.keys())?;
        if self.namespace_exists(namespace).await? {
            return Err(namespace_exists_error(namespace));
        }
        let joined = namespace.join(".");
        let mut tx = tx.begin().await?;
        // The marker row makes the namespace exist whatever its properties.
        let rows = properties
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .chain([(EXISTS_PROPERTY, "true")]);
        for (key, value) in rows {
            let inserted = self
                .db
                .execute_in(
                    &mut tx,
                    "INSERT INTO iceberg_namespace_properties \
                     (catalog_name, namespace, property_key, property_value) VALUES (?, ?, ?, ?)",
                    &[CATALOG_NAME, &joined, key, value],
                )
                .await;
            if let Err(e) = inserted {
                drop(tx);
                // Two replicas both saw it missing; the primary key let one in.
                return Err(if self.namespace_exists(namespace).await? {
                    namespace_exists_error(namespace)
                } else {
                    e.into()
                });
            }
        }
        Ok(Uncommitted::new(self, tx, properties))
    }

    /// Whether a namespace exists.
    pub(crate) async fn namespace_exists(&self, namespace: &NamespaceIdent) -> ApiResult<bool> {
        Ok(self.sql_catalog.namespace_exists(namespace).await?)
    }

    /// 404 unless the namespace exists: what every change inside one checks first.
    pub(super) async fn require_namespace(&self, namespace: &NamespaceIdent) -> ApiResult<()> {
        if self.namespace_exists(namespace).await? {
            Ok(())
        } else {
            Err(ApiError::no_such_namespace(display_namespace(namespace)))
        }
    }

    /// The properties of a namespace.
    pub(crate) async fn load_namespace(
        &self,
        namespace: &NamespaceIdent,
    ) -> ApiResult<HashMap<String, String>> {
        match self.sql_catalog.get_namespace(namespace).await {
            Ok(found) => Ok(visible(found.properties().clone())),
            Err(e) if e.kind() == ErrorKind::NamespaceNotFound => {
                Err(ApiError::no_such_namespace(display_namespace(namespace)))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The namespaces one level below `parent`, or the top-level ones.
    pub(crate) async fn list_namespaces(
        &self,
        parent: Option<&NamespaceIdent>,
    ) -> ApiResult<Vec<Vec<String>>> {
        if let Some(parent) = parent {
            self.require_namespace(parent).await?;
        }
        let joined_names = self
            .db
            .fetch_texts(
                "SELECT namespace FROM iceberg_namespace_properties WHERE catalog_name = ? \
                 UNION SELECT table_namespace FROM iceberg_tables WHERE catalog_name = ?",
                &[CATALOG_NAME, CATALOG_NAME],
            )
            .await?;
        let parent: &[String] = parent.map_or(&[], |p| p.as_ref());
        let mut children = BTreeSet::new();
        for joined in joined_names {
            let levels: Vec<String> = joined.split('.').map(str::to_owned).collect();
            if levels.len() > parent.len() && levels[..parent.len()] == *parent {
                children.insert(levels[..=parent.len()].to_vec());
            }
        }
        Ok(children.into_iter().collect())
    }

    /// Sets and removes namespace properties in one transaction.
    pub(crate) async fn update_namespace_properties(
        &self,
        namespace: &NamespaceIdent,
        removals: Vec<String>,
        updates: HashMap<String, String>,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, UpdateNamespacePropertiesResponse>> {
        if let Some(both) = removals.iter().find(|k| updates.contains_key(*k)) {
            return Err(ApiError::new(
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                "UnprocessableEntityException",
                format!("Property {both:?} is both removed and updated"),
            ));
        }
        check_property_keys(removals.iter().chain(updates.keys()))?;
        self.require_namespace(namespace).await?;
        let joined = namespace.join(".");
        let mut tx = tx.begin().await?;
        let existing: HashSet<String> = self
            .db
            .texts_in(
                &mut tx,
                "SELECT property_key FROM iceberg_namespace_properties \
                 WHERE catalog_name = ? AND namespace = ?",
                &[CATALOG_NAME, &joined],
            )
            .await?
            .into_iter()
            .collect();
        if existing.is_empty() {
            // The namespace exists only through its tables (created by another client
            // of these tables); give it the marker row so it keeps existing.
            self.db
                .execute_in(
                    &mut tx,
                    "INSERT INTO iceberg_namespace_properties \
                 (catalog_name, namespace, property_key, property_value) VALUES (?, ?, ?, ?)",
                    &[CATALOG_NAME, &joined, EXISTS_PROPERTY, "true"],
                )
                .await?;
        }
        let mut response = UpdateNamespacePropertiesResponse {
            updated: Vec::new(),
            removed: Vec::new(),
            missing: Vec::new(),
        };
        for key in removals {
            let deleted = self
                .db
                .execute_in(
                    &mut tx,
                    "DELETE FROM iceberg_namespace_properties \
                     WHERE catalog_name = ? AND namespace = ? AND property_key = ?",
                    &[CATALOG_NAME, &joined, &key],
                )
                .await?;
            if deleted > 0 {
                response.removed.push(key);
            } else {
                response.missing.push(key);
            }
        }
        for (key, value) in updates {
            let statement = if existing.contains(&key) {
                "UPDATE iceberg_namespace_properties SET property_value = ? \
                 WHERE catalog_name = ? AND namespace = ? AND property_key = ?"
            } else {
                "INSERT INTO iceberg_namespace_properties \
                 (property_value, catalog_name, namespace, property_key) VALUES (?, ?, ?, ?)"
            };
            self.db
                .execute_in(&mut tx, statement, &[&value, CATALOG_NAME, &joined, &key])
                .await?;
            response.updated.push(key);
        }
        response.updated.sort();
        response.removed.sort();
        response.missing.sort();
        Ok(Uncommitted::new(self, tx, response))
    }

    /// Drops an empty namespace: 404 if missing, 409 if it still has tables, views or
    /// namespaces below it.
    pub(crate) async fn drop_namespace(
        &self,
        namespace: &NamespaceIdent,
        tx: CatalogTx<DB>,
    ) -> ApiResult<Uncommitted<'_, DB, ()>> {
        self.require_namespace(namespace).await?;
        let joined = namespace.join(".");
        let objects = self
            .db
            .fetch_texts(
                "SELECT table_name FROM iceberg_tables \
                 WHERE catalog_name = ? AND table_namespace = ?",
                &[CATALOG_NAME, &joined],
            )
            .await?;
        if !objects.is_empty() {
            return Err(ApiError::namespace_not_empty(format!(
                "Namespace {} is not empty: it contains {} tables or views",
                display_namespace(namespace),
                objects.len()
            )));
        }
        if !self.list_namespaces(Some(namespace)).await?.is_empty() {
            return Err(ApiError::namespace_not_empty(format!(
                "Namespace {} is not empty: it contains namespaces",
                display_namespace(namespace)
            )));
        }
        let mut tx = tx.begin().await?;
        self.db
            .execute_in(
                &mut tx,
                "DELETE FROM iceberg_namespace_properties WHERE catalog_name = ? AND namespace = ?",
                &[CATALOG_NAME, &joined],
            )
            .await?;
        Ok(Uncommitted::new(self, tx, ()))
    }
}

/// The marker property is the catalog's own; clients neither see nor touch it.
fn check_property_keys<'a>(keys: impl IntoIterator<Item = &'a String>) -> ApiResult<()> {
    for key in keys {
        if key == EXISTS_PROPERTY {
            return Err(ApiError::bad_request(format!(
                "Namespace property {EXISTS_PROPERTY:?} is reserved by the catalog"
            )));
        }
    }
    Ok(())
}

fn visible(mut properties: HashMap<String, String>) -> HashMap<String, String> {
    properties.remove(EXISTS_PROPERTY);
    properties
}
