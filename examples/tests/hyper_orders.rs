//! The `hyper-orders` example (a hyper 1 service served by hyper-util, no axum): a keyed
//! `POST /orders` runs once, and its retry gets the same body and the same trailers back,
//! read by hyper's own HTTP/2 client.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_hyper_service_replays_body_and_trailers() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hyper-orders"))
        .arg("127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start hyper-orders");
    let stdout = child.stdout.take().unwrap();
    let _child = Killed(child);
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(address) = line.strip_prefix("hyper-orders listening on ") {
                let _ = sender.send(address.to_owned());
            }
        }
    });
    let address = receiver
        .recv_timeout(Duration::from_secs(60))
        .expect("hyper-orders did not start");
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let send = |key: Option<&str>, item: &'static str| {
        let mut request = Request::post(format!("http://{address}/orders"));
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Full::new(Bytes::from_static(item.as_bytes())))
            .unwrap();
        let client = client.clone();
        async move {
            let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
                .await
                .expect("hung")
                .expect("request failed");
            let replayed = response.headers().contains_key("idempotent-replayed");
            let status = response.status();
            let collected = response.into_body().collect().await.expect("body");
            let trailers = collected.trailers().cloned();
            (status, collected.to_bytes(), trailers, replayed)
        }
    };
    let (status, body, trailers, replayed) = send(Some("order-1"), "book").await;
    assert_eq!(status, 201);
    assert_eq!(body, r#"{"order":1,"item":"book"}"#);
    assert_eq!(
        trailers.as_ref().map(|t| t["x-order"].clone()),
        Some("1".parse().unwrap()),
        "the first answer keeps its trailers"
    );
    assert!(!replayed);
    let (status, body_again, trailers_again, replayed) = send(Some("order-1"), "book").await;
    assert_eq!((status, &body_again), (http::StatusCode::CREATED, &body));
    assert_eq!(
        trailers_again, trailers,
        "the replay sends the same trailers"
    );
    assert!(replayed);
    let (_, other, other_trailers, _) = send(None, "pen").await;
    assert_eq!(
        other, r#"{"order":2,"item":"pen"}"#,
        "without a key the handler runs"
    );
    assert_eq!(
        other_trailers.map(|t| t["x-order"].clone()),
        Some("2".parse().unwrap())
    );
    let (status, _, _, _) = send(Some("order-1"), "lamp").await;
    assert_eq!(status, 422, "a reused key never runs");
    let (_, after, _, _) = send(None, "cup").await;
    assert_eq!(after, r#"{"order":3,"item":"cup"}"#);
}
