//! How a (scope, key) pair becomes a Redis key.
//!
//! ```text
//! <prefix>{<scope length>:<scope>:<key>}
//! idempotency:{6:tenant:0b7f…}      scope "tenant", key "0b7f…"
//! idempotency:{0::0b7f…}            no scope
//! ```
//!
//! The scope's length in bytes comes first, so no choice of bytes in the scope or the key
//! can make two pairs share a Redis key: scope `a:b` + key `c` is `{3:a:b:c}`, scope `a` +
//! key `b:c` is `{1:a:b:c}`. The braces are a Redis Cluster hash tag: only what lies
//! between the first `{` and the next `}` picks the slot, so every key a record may ever
//! have (today one hash; tomorrow perhaps a companion key with a suffix after the `}`)
//! lands in the same slot, while different records spread over all slots. A scope or key
//! that itself holds `}` ends the tag early; the tag is then shorter, but still the same
//! for all of that record's keys, which is all that atomicity needs.
//!
//! A store with a scope quota uses the layout by scope, whose hash tag holds the scope
//! alone, so that a scope's records and its accounting share a slot:
//!
//! ```text
//! <prefix>{<scope length>:<scope>}:<key>       a record
//! <prefix>{<scope length>:<scope>}#expiries    the scope's records by expiry (sorted set)
//! <prefix>{<scope length>:<scope>}#bytes       the scope's bytes (hash)
//! ```
//!
//! There too the length says where the scope ends; then comes `}`, where the other layout
//! has `:`, so no key belongs to both layouts; and after the `}`, `:` starts a record's
//! key and `#` an accounting key.

use std::fmt;

/// The prefix of every key the store writes when none is configured.
pub const DEFAULT_KEY_PREFIX: &str = "idempotency:";

/// The longest key prefix accepted.
const MAX_PREFIX_LEN: usize = 128;

/// A key prefix the store cannot use, with the reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid Redis key prefix {prefix:?}: {reason}")]
pub struct InvalidKeyPrefix {
    prefix: String,
    reason: &'static str,
}

/// A validated key prefix: at most 128 bytes, without `{` or `}` (they would move the
/// hash tag that keeps a record's keys in one cluster slot).
#[derive(Clone, PartialEq, Eq)]
pub struct KeyPrefix(String);

impl KeyPrefix {
    /// Checks `prefix`.
    pub fn new(prefix: impl Into<String>) -> Result<Self, InvalidKeyPrefix> {
        let prefix = prefix.into();
        let reason = if prefix.len() > MAX_PREFIX_LEN {
            Some("it is longer than 128 bytes; choose a shorter one")
        } else if prefix.contains(['{', '}']) {
            Some(
                "it contains '{' or '}', which would change the Redis Cluster hash tag; \
                 remove them",
            )
        } else {
            None
        };
        match reason {
            Some(reason) => Err(InvalidKeyPrefix { prefix, reason }),
            None => Ok(Self(prefix)),
        }
    }

    /// The prefix as configured.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `<prefix>{<scope length>:<scope>}`: the start of every key of `scope` in the
    /// layout by scope (a store with a [`ScopeQuota`](idempotency_core::ScopeQuota)).
    fn scope_tag(&self, scope: &str) -> Vec<u8> {
        let mut out = self.open_tag(scope, 16);
        out.push(b'}');
        out
    }

    /// `<prefix>{<scope length>:<scope>`, the start both layouts share, with room for
    /// `more` bytes after it.
    fn open_tag(&self, scope: &str, more: usize) -> Vec<u8> {
        let length = scope.len().to_string();
        let mut out = Vec::with_capacity(self.0.len() + length.len() + scope.len() + 2 + more);
        out.extend_from_slice(self.0.as_bytes());
        out.push(b'{');
        out.extend_from_slice(length.as_bytes());
        out.push(b':');
        out.extend_from_slice(scope.as_bytes());
        out
    }

    /// The Redis key of the record of (`scope`, `key`) in the layout by scope, used when
    /// the store has a scope quota: `<prefix>{<scope length>:<scope>}:<key>`. The hash
    /// tag holds the scope alone, so all of a scope's records and its accounting keys
    /// ([`scope_accounting_keys`](Self::scope_accounting_keys)) share one cluster slot.
    pub fn scoped_record_key(&self, scope: &str, key: &str) -> Vec<u8> {
        let mut out = self.scope_tag(scope);
        out.reserve(key.len() + 1);
        out.push(b':');
        out.extend_from_slice(key.as_bytes());
        out
    }

    /// The two keys that account for `scope`'s live records in the layout by scope: a
    /// sorted set `<prefix>{<scope length>:<scope>}#expiries` (member: a record's Redis
    /// key; score: its expiry, epoch milliseconds) and a hash
    /// `<prefix>{<scope length>:<scope>}#bytes` (field: a record's Redis key, value: the
    /// bytes it holds; field `total`: their sum).
    pub fn scope_accounting_keys(&self, scope: &str) -> [Vec<u8>; 2] {
        let tag = self.scope_tag(scope);
        let mut expiries = tag.clone();
        expiries.extend_from_slice(b"#expiries");
        let mut bytes = tag;
        bytes.extend_from_slice(b"#bytes");
        [expiries, bytes]
    }

    /// The Redis key of the record of (`scope`, `key`).
    pub fn record_key(&self, scope: &str, key: &str) -> Vec<u8> {
        let mut out = self.open_tag(scope, key.len() + 2);
        out.push(b':');
        out.extend_from_slice(key.as_bytes());
        out.push(b'}');
        out
    }
}

impl Default for KeyPrefix {
    fn default() -> Self {
        Self(DEFAULT_KEY_PREFIX.to_owned())
    }
}

impl fmt::Debug for KeyPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for KeyPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(scope: &str, key: &str) -> Vec<u8> {
        KeyPrefix::default().record_key(scope, key)
    }

    #[test]
    fn separators_inside_scope_or_key_cannot_collide() {
        assert_eq!(key("a:b", "c"), b"idempotency:{3:a:b:c}");
        assert_eq!(key("a", "b:c"), b"idempotency:{1:a:b:c}");
        assert_ne!(key("a:b", "c"), key("a", "b:c"));
        assert_ne!(key("", "1:a:b"), key("1:a", "b"));
        assert_ne!(key("}", "x"), key("", "}x"));
        assert_eq!(key("", "k"), b"idempotency:{0::k}");
    }

    #[test]
    fn the_layout_by_scope_is_unambiguous_and_never_meets_the_other() {
        let prefix = KeyPrefix::default();
        let scoped = |scope: &str, key: &str| prefix.scoped_record_key(scope, key);
        assert_eq!(scoped("tenant", "k"), b"idempotency:{6:tenant}:k");
        assert_eq!(scoped("", "k"), b"idempotency:{0:}:k");
        assert_ne!(scoped("a:b", "c"), scoped("a", "b:c"));
        assert_ne!(scoped("a}", "x"), scoped("a", "}x"));
        // A record key of one layout is never a key of the other, nor an accounting key.
        for (scope, key) in [("a", "b"), ("a:b", "c"), ("", ""), ("x}", "#bytes")] {
            let [expiries, bytes] = prefix.scope_accounting_keys(scope);
            let keys = [
                scoped(scope, key),
                prefix.record_key(scope, key),
                expiries,
                bytes,
            ];
            for (i, one) in keys.iter().enumerate() {
                for other in &keys[i + 1..] {
                    assert_ne!(one, other, "{scope:?} {key:?}");
                }
            }
        }
        assert_eq!(
            prefix.scope_accounting_keys("t"),
            [
                b"idempotency:{1:t}#expiries".to_vec(),
                b"idempotency:{1:t}#bytes".to_vec()
            ]
        );
    }

    #[test]
    fn the_length_is_in_bytes() {
        assert_eq!(key("é", "k"), "idempotency:{2:é:k}".as_bytes());
    }

    #[test]
    fn prefixes_with_braces_or_too_long_are_refused() {
        assert!(KeyPrefix::new("app:{x}").is_err());
        let error = KeyPrefix::new("x".repeat(129)).unwrap_err();
        assert!(error.to_string().contains("shorter"));
        assert_eq!(KeyPrefix::new("").unwrap().record_key("s", "k"), b"{1:s:k}");
    }
}
