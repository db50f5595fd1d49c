//! An HTTP proxy on loopback, in front of one server, that fails requests on a plan the
//! test sets: it passes a request through, **loses the answer after the server gave it**
//! (reads the whole answer, then closes the connection, or resets the HTTP/2 stream,
//! without a byte of it: the server committed, the client cannot know), or **answers 503
//! itself before the server sees the request** (a gRPC request gets `UNAVAILABLE`), with
//! `Retry-After` (gRPC: `grpc-retry-pushback-ms`). HTTP/1 and HTTP/2 (gRPC) alike.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// What the proxy does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Forward it and return the answer.
    Pass,
    /// Forward it, read the whole answer, and give the client none.
    LoseAnswer,
    /// Answer 503 (gRPC: `UNAVAILABLE`) with this wait, without forwarding.
    Unavailable(Duration),
}

type ProxyBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

struct Shared {
    upstream: String,
    client: Client<HttpConnector, Full<Bytes>>,
    /// The faults for the next requests, in order; `Pass` once it is empty.
    plan: Mutex<VecDeque<Fault>>,
    /// `(method, path, fault)` of every request received, in order.
    seen: Mutex<Vec<(String, String, Fault)>>,
}

/// A running proxy; it stops when dropped.
pub(crate) struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// A proxy in front of `upstream` (`http://host:port`), speaking HTTP/2 to it when
    /// `http2` (gRPC), HTTP/1.1 otherwise.
    pub(crate) async fn start(upstream: &str, http2: bool) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let address = listener.local_addr().unwrap();
        let client = Client::builder(TokioExecutor::new())
            .http2_only(http2)
            .build_http::<Full<Bytes>>();
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            client,
            plan: Mutex::new(VecDeque::new()),
            seen: Mutex::new(Vec::new()),
        });
        let serving = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let shared = Arc::clone(&serving);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let shared = Arc::clone(&shared);
                        async move { shared.handle(request).await }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        FaultProxy {
            address,
            shared,
            task,
        }
    }

    /// `http://` and the proxy's address.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Queues faults for the next requests, after those already queued.
    pub(crate) fn plan(&self, faults: impl IntoIterator<Item = Fault>) {
        self.shared.plan.lock().unwrap().extend(faults);
    }

    /// Every request received so far: method, path, and what the proxy did with it.
    pub(crate) fn seen(&self) -> Vec<(String, String, Fault)> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// Forgets the requests seen so far.
    pub(crate) fn clear_seen(&self) {
        self.shared.seen.lock().unwrap().clear();
    }
}

impl Shared {
    async fn handle(&self, request: Request<Incoming>) -> Result<Response<ProxyBody>, String> {
        let fault = self.plan.lock().unwrap().pop_front().unwrap_or(Fault::Pass);
        let (mut parts, body) = request.into_parts();
        self.seen.lock().unwrap().push((
            parts.method.to_string(),
            parts.uri.path().to_owned(),
            fault,
        ));
        let grpc = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"));
        // The whole request first, also for a 503: an HTTP/1 connection whose request was
        // not read to its end is closed after the answer, and a client that reused it
        // would see a transport error the plan did not ask for.
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        if let Fault::Unavailable(wait) = fault {
            return Ok(unavailable(grpc, wait));
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}{path}", self.upstream).parse().unwrap();
        parts.headers.remove(http::header::HOST);
        let answer = self
            .client
            .request(Request::from_parts(parts, Full::new(body)))
            .await
            .map_err(|e| e.to_string())?;
        if fault == Fault::LoseAnswer {
            // The whole answer (and with it the server's commit) first, then nothing for
            // the client: hyper closes the connection or resets the stream on this error.
            let _ = answer.into_body().collect().await;
            return Err("the fault proxy lost this answer".to_owned());
        }
        Ok(answer.map(|body| body.map_err(Into::into).boxed()))
    }
}

fn unavailable(grpc: bool, wait: Duration) -> Response<ProxyBody> {
    let empty = || {
        Empty::<Bytes>::new()
            .map_err(|never| match never {})
            .boxed()
    };
    if grpc {
        return Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .header("grpc-message", "the fault proxy is unavailable")
            .header("grpc-retry-pushback-ms", wait.as_millis().to_string())
            .body(empty())
            .unwrap();
    }
    Response::builder()
        .status(503)
        .header("retry-after", wait.as_secs().to_string())
        .body(empty())
        .unwrap()
}
