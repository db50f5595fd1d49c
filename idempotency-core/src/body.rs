//! Reading a response body whole, as the layer must to store or amend it.

use bytes::Bytes;
use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt;

use crate::store::BoxError;

/// How a response body ended up after reading it.
pub(crate) enum Buffered {
    /// The whole body, within the limit, and the trailers it ended with.
    Whole(Bytes, Option<HeaderMap>),
    /// The whole body, over the limit: delivered, but not kept.
    TooLarge(Bytes, Option<HeaderMap>),
    /// The body failed while it was read.
    Failed(BoxError),
}

/// Reads `body` whole; over `limit` bytes it is still read (its caller gets it whole),
/// but reported as too large to keep.
pub(crate) async fn buffer<B>(body: B, limit: usize) -> Buffered
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match body.collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            let bytes = collected.to_bytes();
            if bytes.len() > limit {
                Buffered::TooLarge(bytes, trailers)
            } else {
                Buffered::Whole(bytes, trailers)
            }
        }
        Err(error) => Buffered::Failed(error.into()),
    }
}
