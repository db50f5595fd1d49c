//! Table names: validated once, then formatted into every statement.

use std::fmt;

/// The table name used when none is configured.
pub const DEFAULT_TABLE_NAME: &str = "idempotency_records";

/// The longest table name accepted (PostgreSQL's identifier limit).
pub const MAX_TABLE_NAME_LEN: usize = 63;

/// A table name that is safe to format into SQL: an ASCII letter or `_`, then ASCII
/// letters, digits or `_`, at most [`MAX_TABLE_NAME_LEN`] characters.
///
/// Stores still quote it in every statement, so a name that happens to be a reserved word
/// (`order`, `user`) works, and PostgreSQL keeps its case.
///
/// ```
/// use idempotency_store_sql::TableName;
///
/// assert!(TableName::new("idempotency_records").is_ok());
/// assert!(TableName::new("records; DROP TABLE x").is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableName(String);

/// Why a table name was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid idempotency table name {name:?}: {reason} (expected an ASCII letter or '_' followed by ASCII letters, digits or '_', at most 63 characters)"
)]
pub struct InvalidTableName {
    /// The name as given.
    pub name: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl TableName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidTableName> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > MAX_TABLE_NAME_LEN {
            Some("it is longer than 63 characters")
        } else if !name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        {
            Some("it must start with an ASCII letter or '_'")
        } else if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            Some("it may only contain ASCII letters, digits and '_'")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(InvalidTableName { name, reason }),
            None => Ok(Self(name)),
        }
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name of the expiry index. Within PostgreSQL's and SQLite's per-schema index
    /// namespace it is derived from the table name; when that would pass 63 characters, a
    /// hash of the full name keeps it unique and short.
    pub(crate) fn expiry_index_name(&self) -> String {
        const SUFFIX: &str = "_expires_idx";
        if self.0.len() + SUFFIX.len() <= MAX_TABLE_NAME_LEN {
            format!("{}{SUFFIX}", self.0)
        } else {
            let hash = fnv1a(self.0.as_bytes());
            format!("{}_{:08x}{SUFFIX}", &self.0[..40], hash as u32)
        }
    }

    /// A stable 64-bit number derived from the name, used as the PostgreSQL advisory
    /// lock key that serializes concurrent `migrate()` calls for this table.
    #[cfg(feature = "postgres")]
    pub(crate) fn lock_key(&self) -> i64 {
        fnv1a(format!("idempotency-store-sql:migrate:{}", self.0).as_bytes()) as i64
    }

    /// The key of the advisory lock a one-commit owner holds on its key while its record
    /// is not written yet (PostgreSQL), which duplicates and `PostgresStore`'s reservations
    /// look at. A collision between two keys only makes one wait for the other's
    /// transaction.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn record_lock_key(&self, id: &idempotency_core::RecordId) -> i64 {
        let mut name =
            format!("idempotency-store-sql:key:{}:{}:", self.0, id.scope.len()).into_bytes();
        name.extend_from_slice(id.scope.as_bytes());
        name.extend_from_slice(id.key.as_bytes());
        fnv1a(&name) as i64
    }

    /// A number that names the lock a scope's quota is checked under, in this table.
    /// Two scopes may share a number: they then wait for each other, nothing worse.
    /// (PostgreSQL's advisory locks only.)
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn scope_lock_key(&self, scope: &str) -> i64 {
        let mut name = format!("idempotency-store-sql:scope:{}:", self.0).into_bytes();
        name.extend_from_slice(scope.as_bytes());
        fnv1a(&name) as i64
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self(DEFAULT_TABLE_NAME.to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for TableName {
    type Err = InvalidTableName;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::new(name)
    }
}

/// FNV-1a, 64 bit: stable across builds and platforms, unlike `DefaultHasher`.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_identifiers() {
        for name in ["a", "_", "idempotency_records", "T1", &"x".repeat(63)] {
            assert_eq!(TableName::new(name).unwrap().as_str(), name);
        }
    }

    #[test]
    fn refuses_everything_else() {
        for name in [
            "",
            "1abc",
            "a-b",
            "a b",
            "a.b",
            "a\"b",
            "a`b",
            "été",
            "x;drop",
            &"x".repeat(64),
        ] {
            let error = TableName::new(name).unwrap_err();
            assert_eq!(error.name, name);
            assert!(error.to_string().contains("invalid idempotency table name"));
        }
    }

    #[test]
    fn index_names_stay_within_63_characters_and_distinct() {
        let long_a = TableName::new(format!("{}a", "x".repeat(62))).unwrap();
        let long_b = TableName::new(format!("{}b", "x".repeat(62))).unwrap();
        assert!(long_a.expiry_index_name().len() <= 63);
        assert_ne!(long_a.expiry_index_name(), long_b.expiry_index_name());
        assert_eq!(
            TableName::default().expiry_index_name(),
            "idempotency_records_expires_idx"
        );
    }
}
