//! The layer over an in-process service that answers from a script: what is keyed, what is
//! resent, when it stops, and what a caller is told. Time is paused, so the waits cost no
//! wall time and are measured exactly.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use idempotency_client::{Error, IdempotentRetryLayer, KeyedOutcome};
use tower::{BoxError, Layer, ServiceExt, service_fn};

/// One scripted answer: a status with headers, or a transport error.
#[derive(Clone)]
enum Scripted {
    Answer(u16, &'static [(&'static str, &'static str)]),
    TransportError,
}

/// What the service saw: method, key header, body, and the time it was called.
type Seen = Arc<Mutex<Vec<(String, Option<String>, Bytes, tokio::time::Instant)>>>;

fn scripted(
    script: Vec<Scripted>,
) -> (
    impl tower::Service<
        Request<Full<Bytes>>,
        Response = Response<Full<Bytes>>,
        Error = BoxError,
        Future = impl Send,
    > + Clone
    + Send
    + 'static,
    Seen,
) {
    let script = Arc::new(Mutex::new(VecDeque::from(script)));
    let seen: Seen = Arc::default();
    let record = Arc::clone(&seen);
    let service = service_fn(move |request: Request<Full<Bytes>>| {
        let script = Arc::clone(&script);
        let record = Arc::clone(&record);
        async move {
            let (parts, body) = request.into_parts();
            let body = http_body_util::BodyExt::collect(body)
                .await
                .map_err(|never: Infallible| match never {})?
                .to_bytes();
            let key = parts
                .headers
                .get("idempotency-key")
                .map(|key| key.to_str().unwrap().to_owned());
            record.lock().unwrap().push((
                parts.method.to_string(),
                key,
                body,
                tokio::time::Instant::now(),
            ));
            let next = script
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Scripted::Answer(201, &[]));
            match next {
                Scripted::TransportError => Err::<_, BoxError>("connection reset".into()),
                Scripted::Answer(status, headers) => {
                    let mut response = Response::new(Full::new(Bytes::from_static(b"done")));
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    for (name, value) in headers {
                        response.headers_mut().insert(*name, value.parse().unwrap());
                    }
                    Ok(response)
                }
            }
        }
    });
    (service, seen)
}

fn post(body: &'static str) -> Request<Full<Bytes>> {
    Request::post("http://orders.test/orders")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

fn fast() -> IdempotentRetryLayer {
    IdempotentRetryLayer::new().with_backoff(Duration::from_millis(100), Duration::from_secs(1))
}

#[tokio::test(start_paused = true)]
async fn every_attempt_sends_one_key_and_the_same_bytes() {
    let (service, seen) = scripted(vec![
        Scripted::TransportError,
        Scripted::Answer(503, &[("retry-after", "2")]),
        Scripted::Answer(500, &[]),
        Scripted::Answer(429, &[]),
        Scripted::Answer(409, &[("retry-after", "1")]),
    ]);
    let response = fast()
        .with_max_attempts(6)
        .layer(service)
        .oneshot(post("book"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let outcome = response.extensions().get::<KeyedOutcome>().unwrap().clone();
    assert_eq!((outcome.attempts, outcome.replayed), (6, false));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 6);
    let key = outcome.key.to_str().unwrap();
    assert_eq!(uuid::Uuid::parse_str(key).unwrap().get_version_num(), 7);
    for (method, sent_key, body, _) in seen.iter() {
        assert_eq!(
            (method.as_str(), sent_key.as_deref(), &body[..]),
            ("POST", Some(key), &b"book"[..])
        );
    }
    let waited = seen[2].3 - seen[1].3;
    assert!(
        waited >= Duration::from_secs(2),
        "Retry-After: 2, waited {waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn final_answers_are_returned_as_they_are() {
    for (status, headers) in [
        (400, &[][..]),
        (404, &[]),
        (409, &[]), // an application's conflict: no Retry-After
        (503, &[("idempotent-replayed", "true")]),
    ] {
        let (service, seen) = scripted(vec![Scripted::Answer(status, headers)]);
        let response = fast().layer(service).oneshot(post("book")).await.unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(seen.lock().unwrap().len(), 1, "{status} is not resent");
        let outcome = response.extensions().get::<KeyedOutcome>().unwrap();
        assert_eq!(outcome.replayed, !headers.is_empty());
    }
    let (service, seen) = scripted(vec![Scripted::Answer(422, &[])]);
    let mut request = post("book");
    request
        .headers_mut()
        .insert("idempotency-key", "my-key".parse().unwrap());
    match fast().layer(service).oneshot(request).await {
        Err(Error::KeyReused { key }) => assert_eq!(key, "my-key"),
        other => panic!("expected KeyReused, got {other:?}"),
    }
    assert_eq!(seen.lock().unwrap()[0].1.as_deref(), Some("my-key"));
    let (service, seen) = scripted(vec![Scripted::Answer(502, &[])]);
    let layer = fast().with_retry_on_server_errors(false);
    let response = layer.layer(service).oneshot(post("book")).await.unwrap();
    assert_eq!(
        (response.status().as_u16(), seen.lock().unwrap().len()),
        (502, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn retries_stop_at_the_attempts_or_the_horizon() {
    let (service, seen) = scripted(vec![Scripted::TransportError; 10]);
    match fast()
        .with_max_attempts(3)
        .layer(service)
        .oneshot(post("book"))
        .await
    {
        Err(Error::Transport {
            attempts, source, ..
        }) => {
            assert_eq!(attempts, 3);
            assert_eq!(source.to_string(), "connection reset");
        }
        other => panic!("expected Transport, got {other:?}"),
    }
    assert_eq!(seen.lock().unwrap().len(), 3);

    // A 10 s lifetime is a 9 s horizon: a server that asks for 4 s each time gets three
    // attempts (0, 4 and 8 s), and the third answer back.
    let (service, seen) = scripted(vec![Scripted::Answer(503, &[("retry-after", "4")]); 10]);
    let layer = fast()
        .with_max_attempts(10)
        .with_key_lifetime(Duration::from_secs(10));
    let started = tokio::time::Instant::now();
    let response = layer.layer(service).oneshot(post("book")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response
            .extensions()
            .get::<KeyedOutcome>()
            .unwrap()
            .attempts,
        3
    );
    assert_eq!(seen.lock().unwrap().len(), 3);
    assert!(started.elapsed() < Duration::from_secs(9));
}

#[tokio::test(start_paused = true)]
async fn other_requests_pass_through_untouched() {
    let (service, seen) = scripted(vec![Scripted::Answer(503, &[])]);
    let get = Request::get("http://orders.test/orders")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = fast().layer(service).oneshot(get).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "not retried"
    );
    assert!(response.extensions().get::<KeyedOutcome>().is_none());
    assert_eq!(seen.lock().unwrap()[0].1, None, "no key on a GET");

    let (service, seen) = scripted(vec![]);
    let layer =
        fast().with_mutations(|request: &http::request::Parts| request.uri.path() != "/orders");
    let response = layer.layer(service).oneshot(post("book")).await.unwrap();
    assert!(response.extensions().get::<KeyedOutcome>().is_none());
    assert_eq!(
        seen.lock().unwrap()[0].1,
        None,
        "the predicate leaves it out"
    );
}
