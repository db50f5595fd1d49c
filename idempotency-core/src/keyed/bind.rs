//! Stage 2, **bind**: the request body is read whole (within the size limit, the time
//! limit and the memory budget), and the record is bound to what the request is: the
//! method, the path in a normal form, a fingerprint of the query and of the body. A retry
//! with another binding is refused instead of replayed.
//!
//! The path is normalized so that spellings a server routes alike bind alike:
//!
//! - repeated slashes are one (`/v1//namespaces` is `/v1/namespaces`), and a trailing
//!   slash is dropped (`/v1/namespaces/` is `/v1/namespaces`);
//! - percent-escapes of unreserved characters are decoded (`%64b` is `db`), and the hex
//!   digits of the others are upper-cased (`%2f` is `%2F`), as RFC 3986 §6.2.2 allows.
//!
//! Nothing else changes: dot segments, encoded slashes and case are kept, because servers
//! differ on them and two operations must never share a binding. A path longer than
//! [`MAX_KEPT_PATH`] bytes is kept as its SHA-256. The query is never kept: only its
//! SHA-256 (a query can be long, and can hold a caller's secret such as a token).

use std::fmt::Write as _;

use bytes::Bytes;
use http::{HeaderMap, Request, header};
use sha2::{Digest, Sha256};

use crate::budget::Held;
use crate::read::{BodyRead, Past, Reader};
use crate::rejection::Rejection;
use crate::settings::Settings;
use crate::store::Binding;

/// The longest normalized path a binding keeps as it is; a longer one is kept as a hash,
/// so that a hostile path cannot grow the store.
pub const MAX_KEPT_PATH: usize = 512;

/// Reads the request body whole (it is fingerprinted and may be sent to the inner
/// service again), within the memory budget, the size limit and the time limit. A
/// declared `Content-Length` over the limit is refused before anything is read (so no
/// `100 Continue` is sent). The bytes stay taken from the budget while `held` lives.
pub(crate) async fn read_body<B>(
    settings: &Settings,
    headers: &HeaderMap,
    body: B,
    held: &mut Held,
) -> Result<Bytes, Rejection>
where
    B: http_body::Body<Data: Send, Error: Into<crate::BoxError>>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > settings.max_request_body as u64) {
        return Err(Rejection::body_too_large(settings));
    }
    // Take what the body declares up front, so an over-budget request is refused before
    // a byte of it is read; a body of unknown length is taken as it arrives.
    let upfront = declared.map_or(0, |length| length as usize);
    if !settings.memory.grow(held, upfront) {
        return Err(Rejection::over_budget(settings));
    }
    let body = std::pin::pin!(body);
    let read = Reader::up_to(settings.max_request_body)
        .within(&settings.memory, held, upfront)
        .in_time(settings.request_body_timeout)
        .read(body, Bytes::new())
        .await;
    match read {
        BodyRead::Whole(bytes, _trailers) => Ok(bytes),
        BodyRead::Over {
            past: Past::Limit, ..
        } => Err(Rejection::body_too_large(settings)),
        BodyRead::Over {
            past: Past::Budget, ..
        } => Err(Rejection::over_budget(settings)),
        BodyRead::TimedOut => Err(Rejection::body_timeout(settings)),
        BodyRead::Failed(error) => Err(Rejection::unreadable_body(&error)),
    }
}

/// The binding of a keyed request, its body read whole: to `fingerprint` instead of the
/// body when its key's [`PayloadKey`](crate::PayloadKey) names what it is bound to.
pub(crate) fn binding(request: &Request<Bytes>, fingerprint: Option<&[u8]>) -> Binding {
    let uri = request.uri();
    let mut path = normalized_path(uri.path());
    if path.len() > MAX_KEPT_PATH {
        path = format!("sha256:{}", hex(&Sha256::digest(path.as_bytes())));
    }
    if let Some(query) = uri.query() {
        let _ = write!(
            path,
            "?sha256:{}",
            hex(&Sha256::digest(query.as_bytes())[..16])
        );
    }
    Binding {
        method: request.method().as_str().to_owned(),
        path,
        body_sha256: Sha256::digest(fingerprint.unwrap_or(request.body())).into(),
    }
}

/// `path` in the normal form described in the [module docs](self).
pub(crate) fn normalized_path(path: &str) -> String {
    if is_normal(path) {
        return path.to_owned();
    }
    let mut out = String::with_capacity(path.len());
    for segment in path.split('/').filter(|segment| !segment.is_empty()) {
        out.push('/');
        push_normalized_segment(&mut out, segment);
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Whether `path` is already in the normal form, as most paths are: it starts with a
/// slash, has no empty segment (no `//`, no trailing slash unless it is `/`) and no
/// percent-escape. Such a path is its own normal form, and is copied as it is.
fn is_normal(path: &str) -> bool {
    let bytes = path.as_bytes();
    bytes.first() == Some(&b'/')
        && (bytes.len() == 1 || bytes.last() != Some(&b'/'))
        && !bytes.contains(&b'%')
        && !bytes.windows(2).any(|pair| pair == b"//")
}

fn push_normalized_segment(out: &mut String, segment: &str) {
    let mut rest = segment;
    while let Some(character) = rest.chars().next() {
        let escaped = match rest.as_bytes() {
            [b'%', high, low, ..] => hex_digit(*high).zip(hex_digit(*low)),
            _ => None,
        };
        match escaped {
            Some((high, low)) => {
                let byte = high << 4 | low;
                if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
                    out.push(byte as char);
                } else {
                    let _ = write!(out, "%{byte:02X}");
                }
                // `%` and two hex digits: three ASCII bytes.
                rest = &rest[3..];
            }
            None => {
                // Not an escape: copy the character whole (it may be more than one byte).
                out.push(character);
                rest = &rest[character.len_utf8()..];
            }
        }
    }
}

fn hex_digit(byte: u8) -> Option<u8> {
    (byte as char).to_digit(16).map(|digit| digit as u8)
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding_of(uri: &str) -> Binding {
        binding(
            &Request::post(uri).body(Bytes::from_static(b"{}")).unwrap(),
            None,
        )
    }

    #[test]
    fn spellings_a_server_routes_alike_bind_alike() {
        for same in [
            "/v1//namespaces",
            "/v1/namespaces/",
            "//v1/namespaces//",
            "/v1/n%61mespaces",
            "/v1/%6Eamespaces",
        ] {
            assert_eq!(normalized_path(same), "/v1/namespaces", "{same}");
        }
        assert_eq!(normalized_path("/a/b%2fc"), "/a/b%2Fc");
        assert_eq!(normalized_path("/"), "/");
        assert_eq!(normalized_path(""), "/");
        assert_eq!(normalized_path("/caf%C3%A9/é"), "/caf%C3%A9/é");
        assert_eq!(normalized_path("/100%"), "/100%");
        assert_eq!(normalized_path("/a%2"), "/a%2");
    }

    #[test]
    fn paths_already_normal_are_kept_as_they_are() {
        for path in [
            "/",
            "/orders",
            "/v1/namespaces/db/tables",
            "/a.b/~c_d-e",
            "/é/ü",
        ] {
            assert!(is_normal(path), "{path}");
            assert_eq!(normalized_path(path), path);
        }
        for path in ["", "orders", "//", "/a//b", "/a/", "/a%2fb", "*"] {
            assert!(!is_normal(path), "{path}");
        }
    }

    #[test]
    fn different_operations_never_bind_alike() {
        for (a, b) in [
            ("/v1/namespaces/db", "/v1/namespaces/db/tables"),
            ("/v1/namespaces/a%2Fb", "/v1/namespaces/a/b"),
            ("/v1/namespaces/x/..", "/v1/namespaces"),
            ("/v1/Namespaces", "/v1/namespaces"),
            ("/v1/namespaces?a=1", "/v1/namespaces?a=2"),
            ("/v1/namespaces?a=1", "/v1/namespaces"),
        ] {
            assert_ne!(binding_of(a), binding_of(b), "{a} and {b}");
        }
    }

    #[test]
    fn queries_and_long_paths_are_kept_as_hashes() {
        let secret = "access_token=SECRET-OF-CALLER-A";
        let bound = binding_of(&format!("/v1/namespaces?{secret}"));
        assert!(!bound.path.contains("SECRET"), "{}", bound.path);
        assert!(bound.path.starts_with("/v1/namespaces?sha256:"));
        let long = format!("/{}", "a".repeat(60_000));
        let bound = binding_of(&long);
        assert!(bound.path.len() < 100, "{} bytes kept", bound.path.len());
    }
}
