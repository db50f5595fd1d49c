//! One logical request's attempts: what each answer means, and when to stop. The Tower
//! service and the reqwest middleware send; this decides, the same way for both.

use std::time::Duration;

use tokio::time::Instant;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::error::{BoxError, Error};
use crate::outcome::KeyedOutcome;
use crate::policy::{Policy, Verdict, is_replay};

/// The request header that carries the key (gRPC: the request metadata of that name).
pub(crate) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The key a request already carries, or a new one set on it: a UUIDv7, time-ordered, so
/// that a server's index of keys stays compact.
pub(crate) fn key_of(headers: &mut HeaderMap) -> HeaderValue {
    if let Some(key) = headers.get(&IDEMPOTENCY_KEY) {
        return key.clone();
    }
    let mut text = uuid::Uuid::encode_buffer();
    let text = uuid::Uuid::now_v7().hyphenated().encode_lower(&mut text);
    let key = HeaderValue::from_str(text).expect("a UUID is a valid header value");
    headers.insert(IDEMPOTENCY_KEY, key.clone());
    key
}

/// An answer as the attempts read it: an `http::Response` or a `reqwest::Response`.
pub(crate) trait Answer {
    fn status(&self) -> StatusCode;
    fn headers(&self) -> &HeaderMap;
    fn set_outcome(&mut self, outcome: KeyedOutcome);
}

impl<B> Answer for http::Response<B> {
    fn status(&self) -> StatusCode {
        self.status()
    }

    fn headers(&self) -> &HeaderMap {
        self.headers()
    }

    fn set_outcome(&mut self, outcome: KeyedOutcome) {
        self.extensions_mut().insert(outcome);
    }
}

/// What to do after an attempt.
pub(crate) enum Step<A> {
    /// Return this.
    Return(Result<A, Error>),
    /// Send the request again after this wait.
    Wait(Duration),
}

/// The attempts of one logical request so far.
pub(crate) struct Attempts<'a> {
    policy: &'a Policy,
    key: HeaderValue,
    started: Instant,
    sent: u32,
}

impl<'a> Attempts<'a> {
    pub(crate) fn new(policy: &'a Policy, key: HeaderValue) -> Self {
        Attempts {
            policy,
            key,
            started: Instant::now(),
            sent: 0,
        }
    }

    /// Counts an attempt about to be sent; its number, from 1.
    pub(crate) fn send(&mut self) -> u32 {
        self.sent += 1;
        self.sent
    }

    /// What the last attempt's answer (or transport error) means.
    pub(crate) fn settle<A: Answer>(&self, answer: Result<A, BoxError>) -> Step<A> {
        let (policy, sent) = (self.policy, self.sent);
        match answer {
            Ok(mut response) => {
                let wait = match policy.judge(response.status(), response.headers()) {
                    Verdict::Final => None,
                    Verdict::KeyReused => {
                        return Step::Return(Err(Error::KeyReused {
                            key: self.key.clone(),
                        }));
                    }
                    Verdict::Retry { hint } => policy.next_wait(self.started, sent, hint),
                };
                if let Some(wait) = wait {
                    tracing::debug!(status = %response.status(), ?wait, "retrying");
                    return Step::Wait(wait);
                }
                let replayed = is_replay(response.headers());
                tracing::debug!(status = %response.status(), attempts = sent, replayed, "answered");
                response.set_outcome(KeyedOutcome {
                    key: self.key.clone(),
                    attempts: sent,
                    replayed,
                });
                Step::Return(Ok(response))
            }
            Err(source) => match policy.next_wait(self.started, sent, None) {
                Some(wait) => {
                    tracing::debug!(error = %source, ?wait, "retrying");
                    Step::Wait(wait)
                }
                None => Step::Return(Err(Error::Transport {
                    key: self.key.clone(),
                    attempts: sent,
                    source,
                })),
            },
        }
    }
}
