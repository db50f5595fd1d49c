//! The warehouse: where tables and views may live, where a new one goes, and the
//! clean-up of metadata files no committed change points at.

use iceberg::NamespaceIdent;

use super::connection::Catalog;
use super::log::LOG_TARGET;
use crate::error::{ApiError, ApiResult};

/// A namespace property that places the tables created in it.
const LOCATION_PROPERTY: &str = "location";

impl Catalog {
    /// Table and view locations (and registered metadata files) must lie inside the
    /// warehouse: the server writes and reads files there on clients' behalf, and must not
    /// be steered anywhere else on the machine.
    pub(super) fn check_location(&self, location: &str) -> ApiResult<()> {
        let inside = location
            .strip_prefix(&self.warehouse)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        let climbs = location.split('/').any(|segment| segment == "..");
        if inside && !climbs {
            Ok(())
        } else {
            Err(ApiError::bad_request(format!(
                "Location {location} is outside the warehouse {}: this catalog keeps every \
                 table and view inside it",
                self.warehouse
            )))
        }
    }

    /// Where a new table or view in `namespace` goes when the request names no location:
    /// the namespace's `location` property, or `<warehouse>/<ns levels>`, then the name.
    pub(super) async fn default_location(
        &self,
        namespace: &NamespaceIdent,
        name: &str,
    ) -> ApiResult<String> {
        let properties = self.load_namespace(namespace).await?;
        let base = match properties.get(LOCATION_PROPERTY) {
            Some(location) => location.trim_end_matches('/').to_owned(),
            None => format!("{}/{}", self.warehouse, namespace.join("/")),
        };
        Ok(format!("{base}/{name}"))
    }

    /// Deletes metadata files that nothing points at (their change did not commit).
    pub(super) async fn delete_unused(&self, locations: &[String]) {
        for location in locations {
            if let Err(e) = self.file_io.delete(location).await {
                tracing::warn!(target: LOG_TARGET, %location, error = %e, "could not delete an unused metadata file");
            }
        }
    }
}
