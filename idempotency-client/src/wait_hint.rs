//! How long the server asked a client to wait before it retries.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// The longest wait a server may ask for; a longer one is taken as this (the horizon
/// usually ends the retries first).
const LONGEST_HINT: Duration = Duration::from_secs(3600);

/// `Retry-After` as delta-seconds or as an HTTP date; `None` when absent or unreadable.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    let wait = match value.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => httpdate::parse_http_date(value)
            .ok()?
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    };
    Some(wait.min(LONGEST_HINT))
}

/// gRPC's `grpc-retry-pushback-ms`; a negative value means "do not retry" (`Err`).
pub(crate) fn grpc_pushback(headers: &HeaderMap) -> Result<Option<Duration>, ()> {
    const PUSHBACK: http::HeaderName = http::HeaderName::from_static("grpc-retry-pushback-ms");
    let Some(value) = headers.get(PUSHBACK) else {
        return Ok(None);
    };
    let value = value.to_str().map_err(|_| ())?.trim();
    if value.starts_with('-') {
        return Err(());
    }
    let millis = value.parse::<u64>().map_err(|_| ())?;
    Ok(Some(Duration::from_millis(millis).min(LONGEST_HINT)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: &'static str, value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, value.parse().unwrap());
        headers
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(
            retry_after(&headers("retry-after", "2")),
            Some(Duration::from_secs(2))
        );
        assert_eq!(retry_after(&HeaderMap::new()), None);
        assert_eq!(retry_after(&headers("retry-after", "soon")), None);
        let in_ten = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(10));
        let wait = retry_after(&headers("retry-after", &in_ten)).unwrap();
        assert!((8..=10).contains(&wait.as_secs()), "{wait:?}");
        let past = httpdate::fmt_http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(1));
        assert_eq!(
            retry_after(&headers("retry-after", &past)),
            Some(Duration::ZERO)
        );
        assert_eq!(
            retry_after(&headers("retry-after", "99999999")),
            Some(LONGEST_HINT)
        );
    }

    #[test]
    fn pushback_reads_milliseconds_and_refusals() {
        let pushback = |value| grpc_pushback(&headers("grpc-retry-pushback-ms", value));
        assert_eq!(pushback("1500"), Ok(Some(Duration::from_millis(1500))));
        assert_eq!(pushback("-1"), Err(()));
        assert_eq!(pushback("x"), Err(()));
        assert_eq!(grpc_pushback(&HeaderMap::new()), Ok(None));
    }
}
