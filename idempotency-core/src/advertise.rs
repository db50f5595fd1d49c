//! Advertising: answers to requests that do not take part, which the advertiser amends to
//! tell clients about the layer (e.g. the key lifetime in a catalog's config answer).
//! Nothing here touches the store.

use std::sync::Arc;

use http::{HeaderValue, Response, header};

use crate::body_types::Bodies;
use crate::decisions::Advertise;
use crate::encoding;
use crate::read::read_whole;
use crate::rejection::Rejection;
use crate::settings::Settings;

/// The largest answer read to be amended; a larger one goes out as it is.
const MAX_ADVERTISED_BODY: usize = 1024 * 1024;

/// The inner service's `answer`, amended by `advertiser` when it succeeded.
pub(crate) async fn amend<B, F, E>(
    settings: Arc<Settings>,
    advertiser: Arc<dyn Advertise>,
    answer: F,
) -> Result<Response<B::ResponseOut>, E>
where
    B: Bodies,
    F: Future<Output = Result<Response<B::ResponseIn>, E>>,
{
    let (mut parts, body) = answer.await?.into_parts();
    if !parts.status.is_success() {
        return Ok(Response::from_parts(parts, B::ResponseOut::from(body)));
    }
    let (bytes, trailers) = match read_whole(body).await {
        Ok((bytes, trailers)) if bytes.len() > MAX_ADVERTISED_BODY => {
            return Ok(Response::from_parts(parts, B::made(bytes, trailers)));
        }
        Ok(whole) => whole,
        Err(error) => {
            tracing::warn!(%error, "idempotency: an answer to be advertised on failed while it was read");
            return Ok(Rejection::advertised_answer_failed(&error).into_response::<B>(&settings));
        }
    };
    // Asked for identity; a service that compressed anyway is decoded (gzip, deflate),
    // and the amended answer goes out unencoded.
    let bytes = match encoding::decode(&mut parts.headers, &bytes, MAX_ADVERTISED_BODY) {
        Ok(plain) => plain,
        Err(unreadable) => {
            tracing::warn!(
                outcome = "not-advertised",
                "idempotency: could not advertise on an answer because {}; it goes out as the service sent it (let the service honor Accept-Encoding, or put compression outside the layer)",
                unreadable.why
            );
            return Ok(Response::from_parts(parts, B::made(bytes, trailers)));
        }
    };
    let mut amended = advertiser.advertise(Response::from_parts(parts, bytes), settings.lifetime);
    if amended.headers().contains_key(header::CONTENT_LENGTH) {
        let length = HeaderValue::from(amended.body().len());
        amended.headers_mut().insert(header::CONTENT_LENGTH, length);
    }
    Ok(amended.map(|body| B::made(body, trailers)))
}
