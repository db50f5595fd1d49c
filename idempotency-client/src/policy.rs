//! Which requests are keyed, which answers are retried, and when the retries stop. No I/O:
//! the service asks, this answers.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use http::{HeaderMap, HeaderName, Method, StatusCode, request};

use crate::wait_hint;

/// The answer header a server sets on a replayed answer.
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// A gRPC answer's status code, in the headers of a trailers-only answer.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// Whether the server marked an answer as the replay of an earlier attempt's.
pub(crate) fn is_replay(headers: &HeaderMap) -> bool {
    headers
        .get(REPLAYED)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// Decides whether a request is a mutation, to be keyed and retried.
pub(crate) type IsMutation = Arc<dyn Fn(&request::Parts) -> bool + Send + Sync>;

/// How the server's answers are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// By HTTP status and `Retry-After`.
    Http,
    /// By the `grpc-status` of a trailers-only answer and `grpc-retry-pushback-ms`.
    Grpc,
}

/// Everything the layer is configured with.
#[derive(Clone)]
pub(crate) struct Policy {
    pub(crate) protocol: Protocol,
    pub(crate) is_mutation: IsMutation,
    pub(crate) max_attempts: u32,
    pub(crate) first_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) horizon: Duration,
    pub(crate) retry_server_errors: bool,
    pub(crate) max_body_bytes: usize,
}

/// Retries end before this, unless the server's key lifetime is given.
pub(crate) const DEFAULT_HORIZON: Duration = Duration::from_secs(60);

impl Policy {
    pub(crate) fn new(protocol: Protocol) -> Self {
        let is_mutation: IsMutation = match protocol {
            Protocol::Http => Arc::new(|parts: &request::Parts| {
                matches!(
                    parts.method,
                    Method::POST | Method::PUT | Method::PATCH | Method::DELETE
                )
            }),
            // Every gRPC call is a POST; which of them mutate, only the caller knows.
            Protocol::Grpc => Arc::new(|_: &request::Parts| true),
        };
        Policy {
            protocol,
            is_mutation,
            max_attempts: 5,
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            horizon: DEFAULT_HORIZON,
            retry_server_errors: true,
            max_body_bytes: 8 * 1024 * 1024,
        }
    }

    /// What to do with an answer.
    pub(crate) fn judge(&self, status: StatusCode, headers: &HeaderMap) -> Verdict {
        // A gRPC answer's HTTP status is 200 whatever its gRPC status.
        if status.is_success() && self.protocol == Protocol::Http {
            return Verdict::Final;
        }
        if is_replay(headers) {
            // The first execution's stored answer: final, whatever its status.
            return Verdict::Final;
        }
        if self.protocol == Protocol::Grpc {
            if let Some(code) = headers.get(GRPC_STATUS) {
                return match (code.as_bytes(), wait_hint::grpc_pushback(headers)) {
                    (b"14", Ok(hint)) => Verdict::Retry { hint },
                    _ => Verdict::Final,
                };
            }
            // No gRPC status: an HTTP answer from something in between (a proxy, a load
            // balancer), read as gRPC reads it: 429, 502, 503 and 504 are UNAVAILABLE.
            return match status.as_u16() {
                429 | 502 | 503 | 504 => Verdict::Retry {
                    hint: wait_hint::retry_after(headers),
                },
                _ => Verdict::Final,
            };
        }
        let retry = || Verdict::Retry {
            hint: wait_hint::retry_after(headers),
        };
        match status.as_u16() {
            422 => Verdict::KeyReused,
            // 409 is also an application's "already exists": only a 409 that says when to
            // come back (the server's "still running") is retried.
            409 if headers.contains_key(http::header::RETRY_AFTER) => retry(),
            429 | 503 => retry(),
            500..=599 if self.retry_server_errors => retry(),
            _ => Verdict::Final,
        }
    }

    /// How long to wait before the next attempt, or `None` when the retries are over: the
    /// attempts are used up, or the next one would start past the horizon.
    pub(crate) fn next_wait(
        &self,
        started: Instant,
        attempts_sent: u32,
        hint: Option<Duration>,
    ) -> Option<Duration> {
        if attempts_sent >= self.max_attempts {
            return None;
        }
        let doubling = 1u32
            .checked_shl(attempts_sent.saturating_sub(1))
            .unwrap_or(u32::MAX);
        let backoff = self
            .first_backoff
            .saturating_mul(doubling)
            .min(self.max_backoff);
        // "Equal jitter": half the backoff for sure, the other half at random, so that
        // clients failed by one outage do not come back in step.
        let half = backoff / 2;
        let jittered = half + half.mul_f64(fastrand::f64());
        let wait = hint.map_or(jittered, |hint| hint.max(jittered));
        (started.elapsed() + wait < self.horizon).then_some(wait)
    }
}

/// What an answer means for the request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Return it.
    Final,
    /// The server refused the key: used before for another request.
    KeyReused,
    /// Send the request again, not before `hint` if the server gave one.
    Retry { hint: Option<Duration> },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&'static str, &str)]) -> (StatusCode, HeaderMap) {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, value.parse().unwrap());
        }
        (StatusCode::from_u16(status).unwrap(), map)
    }

    fn judge(protocol: Protocol, status: u16, headers: &[(&'static str, &str)]) -> Verdict {
        let (status, headers) = answer(status, headers);
        Policy::new(protocol).judge(status, &headers)
    }

    #[test]
    fn http_answers() {
        let second = Some(Duration::from_secs(1));
        assert_eq!(judge(Protocol::Http, 201, &[]), Verdict::Final);
        assert_eq!(judge(Protocol::Http, 422, &[]), Verdict::KeyReused);
        assert_eq!(judge(Protocol::Http, 400, &[]), Verdict::Final);
        assert_eq!(judge(Protocol::Http, 404, &[]), Verdict::Final);
        assert_eq!(judge(Protocol::Http, 409, &[]), Verdict::Final);
        assert_eq!(
            judge(Protocol::Http, 409, &[("retry-after", "1")]),
            Verdict::Retry { hint: second }
        );
        assert_eq!(
            judge(Protocol::Http, 429, &[]),
            Verdict::Retry { hint: None }
        );
        assert_eq!(
            judge(Protocol::Http, 503, &[("retry-after", "1")]),
            Verdict::Retry { hint: second }
        );
        assert_eq!(
            judge(Protocol::Http, 500, &[]),
            Verdict::Retry { hint: None }
        );
        assert_eq!(
            judge(Protocol::Http, 503, &[("idempotent-replayed", "true")]),
            Verdict::Final,
            "a replay is the first execution's answer"
        );
        let (status, headers) = answer(502, &[]);
        let strict = Policy {
            retry_server_errors: false,
            ..Policy::new(Protocol::Http)
        };
        assert_eq!(strict.judge(status, &headers), Verdict::Final);
        let (status, headers) = answer(503, &[]);
        assert_eq!(
            strict.judge(status, &headers),
            Verdict::Retry { hint: None }
        );
    }

    #[test]
    fn grpc_answers() {
        assert_eq!(judge(Protocol::Grpc, 200, &[]), Verdict::Final);
        assert_eq!(
            judge(Protocol::Grpc, 200, &[("grpc-status", "0")]),
            Verdict::Final
        );
        assert_eq!(
            judge(Protocol::Grpc, 200, &[("grpc-status", "14")]),
            Verdict::Retry { hint: None }
        );
        assert_eq!(
            judge(
                Protocol::Grpc,
                200,
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "250")]
            ),
            Verdict::Retry {
                hint: Some(Duration::from_millis(250))
            }
        );
        assert_eq!(
            judge(
                Protocol::Grpc,
                200,
                &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "-1")]
            ),
            Verdict::Final,
            "a negative pushback says: do not retry"
        );
        for final_code in ["3", "9", "6", "13"] {
            assert_eq!(
                judge(Protocol::Grpc, 200, &[("grpc-status", final_code)]),
                Verdict::Final
            );
        }
        assert_eq!(
            judge(Protocol::Grpc, 503, &[]),
            Verdict::Retry { hint: None }
        );
        assert_eq!(judge(Protocol::Grpc, 422, &[]), Verdict::Final);
    }

    #[test]
    fn retries_end_at_the_attempts_or_the_horizon() {
        let policy = Policy::new(Protocol::Http);
        let now = Instant::now();
        for sent in 1..5 {
            let wait = policy.next_wait(now, sent, None).unwrap();
            let backoff = Duration::from_millis(100 * (1 << (sent - 1)));
            assert!(wait >= backoff / 2 && wait <= backoff, "{sent}: {wait:?}");
        }
        assert_eq!(policy.next_wait(now, 5, None), None);
        let hint = Duration::from_secs(3);
        assert_eq!(policy.next_wait(now, 1, Some(hint)), Some(hint));
        assert_eq!(
            policy.next_wait(now, 1, Some(Duration::from_secs(60))),
            None,
            "a wait that ends past the horizon ends the retries"
        );
        let long = Policy {
            max_attempts: 100,
            ..Policy::new(Protocol::Http)
        };
        let wait = long.next_wait(now, 60, None).unwrap();
        assert!(wait <= long.max_backoff && wait >= long.max_backoff / 2);
    }
}
