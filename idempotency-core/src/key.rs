//! Parsing the `Idempotency-Key` header value into the key a record is stored under.
//!
//! Two formats ship with the crate: [`OpaqueKey`] (the default: 1–255 printable ASCII
//! bytes, kept as sent) and [`UuidKey`] (a hyphenated RFC 9562 UUID, lower-cased, as some
//! protocols ask). Any `Fn(&[u8]) -> Result<String, KeyError>` is a format too.
//!
//! Both check the length before they look at anything else, so a hostile multi-kilobyte
//! header costs nothing.

use std::fmt;

/// Why a header value is not a valid key. The message is shown to the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyError {
    message: String,
}

impl KeyError {
    /// A key error with a message for the client.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

/// Turns a header value (already trimmed of surrounding whitespace) into a key.
pub trait KeyFormat: Send + Sync + 'static {
    /// The normalized key, or why the value is not one.
    fn parse(&self, value: &[u8]) -> Result<String, KeyError>;
}

impl<F> KeyFormat for F
where
    F: Fn(&[u8]) -> Result<String, KeyError> + Send + Sync + 'static,
{
    fn parse(&self, value: &[u8]) -> Result<String, KeyError> {
        self(value)
    }
}

/// The longest opaque key accepted, in bytes.
pub const MAX_OPAQUE_KEY_LEN: usize = 255;

/// Any printable ASCII string of 1 to 255 bytes, kept exactly as sent (case matters).
#[derive(Clone, Copy, Debug, Default)]
pub struct OpaqueKey;

impl KeyFormat for OpaqueKey {
    fn parse(&self, value: &[u8]) -> Result<String, KeyError> {
        if value.is_empty() {
            return Err(KeyError::new(
                "the Idempotency-Key header is empty; send 1 to 255 printable ASCII bytes, such as a UUID",
            ));
        }
        if value.len() > MAX_OPAQUE_KEY_LEN {
            return Err(KeyError::new(format!(
                "the Idempotency-Key header is {} bytes long; send at most {MAX_OPAQUE_KEY_LEN}",
                value.len()
            )));
        }
        if let Some(position) = value.iter().position(|b| !(0x20..0x7f).contains(b)) {
            return Err(KeyError::new(format!(
                "the Idempotency-Key header has a byte that is not printable ASCII at position {position}; \
                 send printable ASCII only, such as a UUID"
            )));
        }
        // Printable ASCII is valid UTF-8, so this never fails; checking it again is
        // cheaper than the lossy conversion, which inspects the bytes the same way.
        std::str::from_utf8(value)
            .map(str::to_owned)
            .map_err(|_| KeyError::new("the Idempotency-Key header is not UTF-8".to_owned()))
    }
}

/// A 36-character hyphenated UUID (RFC 9562), lower-cased so that `ABC…` and `abc…` are
/// one key. Any version is accepted unless [`UuidKey::v7_only`] is used.
#[derive(Clone, Copy, Debug, Default)]
pub struct UuidKey {
    require_v7: bool,
}

impl UuidKey {
    /// Accepts any UUID version.
    pub const fn any_version() -> Self {
        Self { require_v7: false }
    }

    /// Accepts version 7 UUIDs only, for protocols that recommend clients send them.
    ///
    /// ```
    /// use idempotency_core::{KeyFormat, UuidKey};
    ///
    /// let v7 = UuidKey::v7_only();
    /// assert!(v7.parse(b"01890a5d-ac96-774b-bcce-b302099a8057").is_ok());
    /// assert!(v7.parse(b"f47ac10b-58cc-4372-a567-0e02b2c3d479").is_err()); // v4
    /// ```
    pub const fn v7_only() -> Self {
        Self { require_v7: true }
    }
}

const UUID_LEN: usize = 36;

impl KeyFormat for UuidKey {
    fn parse(&self, value: &[u8]) -> Result<String, KeyError> {
        if value.len() != UUID_LEN {
            return Err(KeyError::new(format!(
                "the Idempotency-Key header must be a UUID in its 36-character hyphenated form \
                 (e.g. 01890a5d-ac96-774b-bcce-b302099a8057); got {} bytes",
                value.len()
            )));
        }
        let mut key = String::with_capacity(UUID_LEN);
        for (i, byte) in value.iter().enumerate() {
            let hyphen_here = matches!(i, 8 | 13 | 18 | 23);
            match (hyphen_here, byte) {
                (true, b'-') => key.push('-'),
                (false, b) if b.is_ascii_hexdigit() => key.push(b.to_ascii_lowercase() as char),
                _ => {
                    return Err(KeyError::new(format!(
                        "the Idempotency-Key header is not a hyphenated UUID: unexpected character \
                         at position {i}; send a UUID such as 01890a5d-ac96-774b-bcce-b302099a8057"
                    )));
                }
            }
        }
        let version = key.as_bytes()[14];
        let variant = key.as_bytes()[19];
        if !matches!(variant, b'8' | b'9' | b'a' | b'b') {
            return Err(KeyError::new(
                "the Idempotency-Key header is not an RFC 9562 UUID (its variant bits are wrong); \
                 generate it with a UUID library",
            ));
        }
        if self.require_v7 && version != b'7' {
            return Err(KeyError::new(format!(
                "the Idempotency-Key header must be a version 7 UUID; got version {}",
                version as char
            )));
        }
        Ok(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opaque_keys_are_kept_as_sent() {
        assert_eq!(
            OpaqueKey.parse(b"Order-42 retry").unwrap(),
            "Order-42 retry"
        );
        assert_eq!(OpaqueKey.parse(&[b'a'; 255]).unwrap().len(), 255);
    }

    #[test]
    fn opaque_keys_reject_long_and_unprintable_values() {
        let long = OpaqueKey.parse(&[b'a'; 256]).unwrap_err();
        assert!(long.to_string().contains("256 bytes"), "{long}");
        let tab = OpaqueKey.parse(b"a\tb").unwrap_err();
        assert!(tab.to_string().contains("position 1"), "{tab}");
        assert!(OpaqueKey.parse("clé".as_bytes()).is_err());
    }

    #[test]
    fn uuid_keys_are_lower_cased() {
        assert_eq!(
            UuidKey::any_version()
                .parse(b"F47AC10B-58CC-4372-A567-0E02B2C3D479")
                .unwrap(),
            "f47ac10b-58cc-4372-a567-0e02b2c3d479"
        );
    }

    #[test]
    fn uuid_keys_reject_other_shapes() {
        let format = UuidKey::any_version();
        for bad in [
            &b"f47ac10b58cc4372a5670e02b2c3d479"[..],
            b"{f47ac10b-58cc-4372-a567-0e02b2c3d47}",
            b"f47ac10b-58cc-4372-a567-0e02b2c3d47g",
            b"f47ac10b-58cc-4372-c567-0e02b2c3d479",
            b"",
        ] {
            assert!(
                format.parse(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let huge = vec![b'a'; 100_000];
        assert!(
            format
                .parse(&huge)
                .unwrap_err()
                .to_string()
                .contains("100000 bytes")
        );
    }

    #[test]
    fn v7_only_names_the_version_it_got() {
        let error = UuidKey::v7_only()
            .parse(b"f47ac10b-58cc-4372-a567-0e02b2c3d479")
            .unwrap_err();
        assert!(error.to_string().contains("got version 4"), "{error}");
    }

    #[test]
    fn closures_are_key_formats() {
        let digits = |value: &[u8]| {
            if value.iter().all(u8::is_ascii_digit) {
                Ok(String::from_utf8_lossy(value).into_owned())
            } else {
                Err(KeyError::new("digits only"))
            }
        };
        assert_eq!(digits.parse(b"123").unwrap(), "123");
        assert!(digits.parse(b"12a").is_err());
    }
}
