//! The rules for table, view and namespace names, and how a namespace is shown in
//! messages.

use iceberg::NamespaceIdent;

use crate::error::{ApiError, ApiResult};

/// Namespace levels are stored joined with `.` (the SQL catalogs' convention), so a level
/// must not contain one; nor may it be empty.
pub(super) fn check_namespace(namespace: &NamespaceIdent) -> ApiResult<()> {
    for level in namespace.iter() {
        if level.is_empty() || level.contains(['.', '/', '\u{1f}']) {
            return Err(ApiError::bad_request(format!(
                "Invalid namespace level {level:?}: must be non-empty and contain no '.' or '/'"
            )));
        }
    }
    Ok(())
}

/// A table or view name becomes a directory of the warehouse, so it must be one path
/// segment.
pub(super) fn check_name(name: &str) -> ApiResult<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(ApiError::bad_request(format!(
            "Invalid name {name:?}: must be non-empty, not . or .., and contain no '/'"
        )));
    }
    Ok(())
}

/// `a.b` for messages.
pub(super) fn display_namespace(namespace: &NamespaceIdent) -> String {
    namespace.join(".")
}
