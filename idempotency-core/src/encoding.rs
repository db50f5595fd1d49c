//! Content encodings of the answers the layer reads but never stores.
//!
//! The layer asks the inner service for unencoded answers (`Accept-Encoding: identity`)
//! wherever it reads one. A service that compresses anyway is handled in two ways:
//!
//! - **An answer to be stored** (a keyed request's) that arrives encoded is not stored
//!   at all (`keyed::classify`, not stored because encoded): a replay must never go out in an
//!   encoding its retry did not accept, and a profile must be able to read what it keeps.
//! - **An answer the layer only reads** (what a profile amends, such as a
//!   catalog's config answer, and the load that refreshes a replay) is decoded here when it is
//!   gzip or deflate, the encodings HTTP servers send unasked, and goes on unencoded, which
//!   every client accepts. Any other encoding is left alone and reported.

use std::io::Read;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};

/// Asks the inner service for an answer the layer can store, inspect and replay to any
/// retry: one without a content encoding.
pub(crate) fn ask_for_identity(headers: &mut HeaderMap) {
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
}

/// Whether an answer carries a content encoding other than `identity`.
pub(crate) fn is_encoded(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|value| {
            !value
                .as_bytes()
                .trim_ascii()
                .eq_ignore_ascii_case(b"identity")
        })
}

/// An answer the layer could not read as plain bytes.
#[derive(Debug)]
pub(crate) struct Unreadable {
    /// Why, for the log: the encoding, or what went wrong decoding it.
    pub(crate) why: String,
}

/// The content codings an answer declares, in the order they were applied, without
/// `identity`.
fn codings(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .flat_map(|value| {
            String::from_utf8_lossy(value.as_bytes())
                .split(',')
                .map(|coding| coding.trim().to_ascii_lowercase())
                .filter(|coding| !coding.is_empty() && coding != "identity")
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The body of an answer with `headers`, decoded: unchanged when it declares no
/// encoding; decoded (and its `Content-Encoding` and `Content-Length` removed) when it
/// is gzip or deflate and decodes to at most `limit` bytes; otherwise [`Unreadable`],
/// with `headers` and `body` untouched for the caller to pass on as they are.
pub(crate) fn decode(
    headers: &mut HeaderMap,
    body: &Bytes,
    limit: usize,
) -> Result<Bytes, Unreadable> {
    let codings = codings(headers);
    if codings.is_empty() {
        return Ok(body.clone());
    }
    let mut plain = body.to_vec();
    // The last coding listed was applied last, so it comes off first.
    for coding in codings.iter().rev() {
        plain = decode_one(coding, &plain, limit)?;
    }
    headers.remove(header::CONTENT_ENCODING);
    headers.remove(header::CONTENT_LENGTH);
    Ok(Bytes::from(plain))
}

fn decode_one(coding: &str, encoded: &[u8], limit: usize) -> Result<Vec<u8>, Unreadable> {
    match coding {
        "gzip" | "x-gzip" => read_bounded(flate2::read::MultiGzDecoder::new(encoded), limit)
            .map_err(|error| Unreadable {
                why: format!("its gzip body could not be decoded ({error})"),
            }),
        // HTTP's deflate is zlib-wrapped; some servers send raw deflate instead.
        "deflate" => read_bounded(flate2::read::ZlibDecoder::new(encoded), limit)
            .or_else(|_| read_bounded(flate2::read::DeflateDecoder::new(encoded), limit))
            .map_err(|error| Unreadable {
                why: format!("its deflate body could not be decoded ({error})"),
            }),
        other => Err(Unreadable {
            why: format!("it is encoded as {other:?}, which the layer does not decode"),
        }),
    }
}

/// Reads `reader` to its end, failing once it yields more than `limit` bytes (a small
/// compressed body can expand to gigabytes).
fn read_bounded(reader: impl Read, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut plain = Vec::new();
    reader
        .take(limit as u64 + 1)
        .read_to_end(&mut plain)
        .and_then(|read| {
            if read > limit {
                Err(std::io::Error::other(format!(
                    "it decodes to more than {limit} bytes"
                )))
            } else {
                Ok(plain)
            }
        })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    fn headers(encoding: &str, length: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_ENCODING, encoding.parse().unwrap());
        headers.insert(header::CONTENT_LENGTH, length.into());
        headers
    }

    #[test]
    fn gzip_and_deflate_are_decoded_and_their_headers_dropped() {
        let plain = br#"{"defaults":{},"overrides":{}}"#;
        let gzipped = gzip(plain);
        let mut gzip_headers = headers("gzip", gzipped.len());
        let decoded = decode(&mut gzip_headers, &Bytes::from(gzipped), 1024).unwrap();
        assert_eq!(&decoded[..], plain);
        assert!(gzip_headers.is_empty(), "{gzip_headers:?}");

        let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        zlib.write_all(plain).unwrap();
        let zlib = zlib.finish().unwrap();
        let mut deflate_headers = headers("Deflate", zlib.len());
        assert_eq!(
            &decode(&mut deflate_headers, &Bytes::from(zlib), 1024).unwrap()[..],
            plain
        );

        // Two codings: gzip applied first, then gzip again.
        let twice = gzip(&gzip(plain));
        let mut twice_headers = headers("gzip, identity, gzip", twice.len());
        assert_eq!(
            &decode(&mut twice_headers, &Bytes::from(twice), 1024).unwrap()[..],
            plain
        );
    }

    #[test]
    fn other_encodings_bombs_and_garbage_are_left_alone() {
        let body = Bytes::from_static(b"\x1b\x00\x00br-bytes");
        let mut br = headers("br", body.len());
        let unreadable = decode(&mut br, &body, 1024).unwrap_err();
        assert!(unreadable.why.contains("\"br\""), "{}", unreadable.why);
        assert!(br.contains_key(header::CONTENT_ENCODING), "left untouched");

        let bomb = Bytes::from(gzip(&vec![b'a'; 10_000]));
        let mut bomb_headers = headers("gzip", bomb.len());
        let unreadable = decode(&mut bomb_headers, &bomb, 1024).unwrap_err();
        assert!(
            unreadable.why.contains("more than 1024"),
            "{}",
            unreadable.why
        );

        let mut garbage = headers("gzip", 3);
        assert!(decode(&mut garbage, &Bytes::from_static(b"abc"), 1024).is_err());

        let mut plain = HeaderMap::new();
        plain.insert(header::CONTENT_ENCODING, "identity".parse().unwrap());
        assert_eq!(
            &decode(&mut plain, &Bytes::from_static(b"x"), 1024).unwrap()[..],
            b"x"
        );
    }
}
