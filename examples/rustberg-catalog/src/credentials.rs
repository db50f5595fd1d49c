//! A credential provider for tests and demonstrations: every table creation and load
//! that asks for vended credentials gets a fresh fake S3 credential, so a test can tell
//! a stored secret from a fresh one, and a secret written anywhere it should not be is
//! easy to find. Nothing it vends opens any storage.

use std::sync::atomic::{AtomicU64, Ordering};

use rustberg::credentials::{
    StorageCredential, StorageCredentialProvider, StorageCredentialRequest,
    StorageCredentialVendingError,
};

/// Vends `AKIATEST…` / `test-secret-…` / `test-session-…` credentials for tables in one
/// warehouse, a new one on every call.
#[derive(Debug)]
pub(crate) struct TestCredentials {
    warehouse: String,
    minted: AtomicU64,
}

impl TestCredentials {
    /// A provider for the tables under `warehouse` (a `file://` URL).
    pub(crate) fn new(warehouse: &str) -> Self {
        Self {
            warehouse: warehouse.trim_end_matches('/').to_owned(),
            minted: AtomicU64::new(0),
        }
    }
}

#[async_trait::async_trait]
impl StorageCredentialProvider for TestCredentials {
    async fn vend_credentials(
        &self,
        request: &StorageCredentialRequest,
    ) -> Result<Vec<StorageCredential>, StorageCredentialVendingError> {
        let n = self.minted.fetch_add(1, Ordering::Relaxed) + 1;
        let nonce = uuid::Uuid::new_v4().simple();
        tracing::info!(
            target: "rustberg_catalog::credentials",
            table = %request.table_name,
            write = request.write_access,
            "vended test credential #{n}"
        );
        Ok(vec![StorageCredential::s3(
            format!("{}/", request.table_location.trim_end_matches('/')),
            format!("AKIATEST{n:012}"),
            format!("test-secret-{nonce}"),
            Some(format!("test-session-{nonce}")),
        )])
    }

    fn supports_location(&self, location: &str) -> bool {
        location == self.warehouse || location.starts_with(&format!("{}/", self.warehouse))
    }
}
