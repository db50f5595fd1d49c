//! The warehouse: where tables and views may live, where a new one goes, the clean-up
//! of metadata files no committed change points at, and reading a metadata file back as
//! the JSON an answer carries (for registrations, and for the idempotency layer's
//! replays).

use std::io::Read as _;

use bytes::Bytes;
use iceberg::NamespaceIdent;
use idempotency_core::BoxError;
use idempotency_iceberg::MetadataReader;
use serde_json::value::RawValue;

use super::connection::Catalog;
use super::database::CatalogDatabase;
use super::log::LOG_TARGET;
use crate::error::{ApiError, ApiResult};

/// A namespace property that places the tables created in it.
const LOCATION_PROPERTY: &str = "location";

impl<DB: CatalogDatabase> Catalog<DB> {
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

    /// Reads the metadata files the idempotency layer's replays need, through the
    /// catalog's own FileIO: the JSON this catalog's answers carried for the file at a
    /// location (what it wrote, or, for a registration, what it read).
    pub(crate) fn metadata_reader(&self) -> impl MetadataReader + use<DB> {
        let file_io = self.file_io.clone();
        move |location: String| {
            let file_io = file_io.clone();
            async move {
                let bytes = file_io.new_input(&location)?.read().await?;
                Ok::<_, BoxError>(metadata_json(bytes)?)
            }
        }
    }

    /// The metadata file at `location` as the JSON an answer carries, read whole and
    /// checked to be JSON.
    pub(super) async fn read_metadata_json(
        &self,
        location: &str,
    ) -> Result<Box<RawValue>, BoxError> {
        let bytes = self.file_io.new_input(location)?.read().await?;
        let json = String::from_utf8(metadata_json(bytes)?.to_vec())?;
        Ok(RawValue::from_string(json)?)
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

/// A metadata file's JSON: decompressed if it was written with gzip (Iceberg's
/// `write.metadata.compression-codec`), without the whitespace around it.
fn metadata_json(bytes: Bytes) -> std::io::Result<Bytes> {
    let json = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..]).read_to_end(&mut plain)?;
        Bytes::from(plain)
    } else {
        bytes
    };
    let start = json
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(json.len());
    let end = json
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |last| last + 1);
    Ok(json.slice(start..end))
}
