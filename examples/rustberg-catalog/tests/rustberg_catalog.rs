//! End-to-end tests of the `rustberg-catalog` binary: rustberg 0.3.0 wrapped by the layer
//! the way the README recommends. Each test starts the real server in a temporary
//! directory and drives it over HTTP, as a user would:
//!
//! - keyed requests with and without `Accept-Encoding: gzip` (rustberg compresses inside
//!   its router): replays come in the encoding each retry accepted, the store holds plain
//!   bytes, `/v1/config` advertises the layer's lifetime instead of rustberg's `PT24H`;
//! - `--vend-test-credentials`: the raw SQLite rows and files never hold a vended secret,
//!   and every replay carries a fresh credential;
//! - a key reused after the layer's lifetime runs again: rustberg's own key cache never
//!   answers in the layer's place (and does, with `--forward-idempotency-key`);
//! - PyIceberg end to end, every mutation sent with a key and sent twice (the first
//!   answer "lost").
//!
//! Under `CI=true` a failed PyIceberg install is a failure; elsewhere that test says why
//! and returns early.

use std::fs;
use std::io::Read as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::Row as _;

const BINARY: &str = env!("CARGO_BIN_EXE_rustberg-catalog");

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

// ------------------------------------------------------------------------------------------
// Running the server
// ------------------------------------------------------------------------------------------

/// A running `rustberg-catalog`; killed on drop, with its log printed if the test failed.
struct Server {
    child: Child,
    base: String,
    log: PathBuf,
    data: PathBuf,
}

impl Server {
    /// Starts the binary with `--data DIR/data` and `args`, and waits until it accepts
    /// connections.
    fn start(dir: &Path, args: &[&str]) -> Self {
        let data = dir.join("data");
        for attempt in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let log = dir.join(format!("rustberg-{port}.log"));
            let out = fs::File::create(&log).expect("log file");
            let child = Command::new(BINARY)
                .current_dir(dir)
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .arg("--data")
                .arg(&data)
                .args(args)
                .env("RUST_LOG", "info")
                .stdout(out.try_clone().expect("log file"))
                .stderr(out)
                .stdin(Stdio::null())
                .spawn()
                .expect("start rustberg-catalog");
            let mut server = Server {
                child,
                base: format!("http://127.0.0.1:{port}"),
                log,
                data: data.clone(),
            };
            if server.wait_ready(port) {
                return server;
            }
            eprintln!(
                "rustberg-catalog did not start (attempt {attempt}):\n{}",
                server.log_text()
            );
        }
        panic!("rustberg-catalog did not start");
    }

    fn wait_ready(&mut self, port: u16) -> bool {
        let address = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        false
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn log_text(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = fs::File::open(&self.log) {
            let _ = file.read_to_string(&mut text);
        }
        text
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- log of {} ----\n{}", self.base, self.log_text());
        }
    }
}

// ------------------------------------------------------------------------------------------
// HTTP
// ------------------------------------------------------------------------------------------

fn client() -> reqwest::Client {
    // No `gzip` feature: the client neither asks for nor decodes compression by itself,
    // so every test says what it accepts and sees the bytes as they came.
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("http client")
}

#[derive(Debug)]
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    /// The body as it came.
    raw: Vec<u8>,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// Whether rustberg's own key cache answered (its replay marker).
    fn answered_by_rustbergs_cache(&self) -> bool {
        self.headers.contains_key("idempotency-key-used")
    }

    fn encoding(&self) -> Option<&str> {
        self.headers
            .get("content-encoding")
            .map(|v| v.to_str().expect("ASCII"))
    }

    /// The body, decoded if it says it is gzip.
    fn text(&self) -> String {
        match self.encoding() {
            None => String::from_utf8(self.raw.clone()).expect("UTF-8 body"),
            Some("gzip") => {
                let mut text = String::new();
                flate2::read::GzDecoder::new(&self.raw[..])
                    .read_to_string(&mut text)
                    .expect("a gzip body");
                text
            }
            Some(other) => panic!("unexpected Content-Encoding {other}"),
        }
    }

    fn json(&self) -> Value {
        let text = self.text();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"))
    }
}

/// What a request sends besides its method, path and body.
#[derive(Clone, Copy, Default)]
struct With<'a> {
    key: Option<&'a str>,
    gzip: bool,
    vended_credentials: bool,
}

async fn send(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    with: With<'_>,
    body: Option<&Value>,
) -> Answer {
    let mut request = client.request(method, url);
    if let Some(key) = with.key {
        request = request.header("Idempotency-Key", key);
    }
    if with.gzip {
        request = request.header("Accept-Encoding", "gzip");
    }
    if with.vended_credentials {
        request = request.header("X-Iceberg-Access-Delegation", "vended-credentials");
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let response = request.send().await.expect("request sent");
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        raw: response.bytes().await.expect("response body").to_vec(),
    }
}

async fn post(client: &reqwest::Client, url: String, with: With<'_>, body: &Value) -> Answer {
    send(client, reqwest::Method::POST, url, with, Some(body)).await
}

async fn get(client: &reqwest::Client, url: String, with: With<'_>) -> Answer {
    send(client, reqwest::Method::GET, url, with, None).await
}

fn key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A namespace body large enough for compression to apply (tower-http leaves answers of
/// 32 bytes or less alone).
fn namespace_body(name: &str) -> Value {
    json!({
        "namespace": [name],
        "properties": {"owner": "rustberg-catalog test", "comment": "x".repeat(200)}
    })
}

fn create_table_body(name: &str) -> Value {
    json!({
        "name": name,
        "schema": {
            "type": "struct",
            "schema-id": 0,
            "fields": [
                {"id": 1, "name": "id", "required": true, "type": "long"},
                {"id": 2, "name": "data", "required": false, "type": "string"}
            ]
        },
        "properties": {"created-by": "rustberg-catalog test"}
    })
}

async fn namespaces(client: &reqwest::Client, server: &Server) -> Vec<String> {
    let answer = get(client, server.url("/v1/namespaces"), With::default()).await;
    assert_eq!(answer.status, 200, "list namespaces: {}", answer.text());
    answer.json()["namespaces"]
        .as_array()
        .expect("namespaces")
        .iter()
        .map(|ns| ns[0].as_str().expect("a name").to_owned())
        .collect()
}

// ------------------------------------------------------------------------------------------
// The layer's store, read as it is on disk
// ------------------------------------------------------------------------------------------

/// One row of the layer's SQLite table.
#[derive(Debug)]
struct Row {
    status: Option<i64>,
    headers: Vec<u8>,
    body: Vec<u8>,
}

async fn store_rows(server: &Server) -> Vec<Row> {
    let url = format!(
        "sqlite:{}?mode=ro",
        server.data.join("idempotency.db").display()
    );
    let pool = sqlx::SqlitePool::connect(&url)
        .await
        .expect("open the idempotency database");
    let rows = sqlx::query(
        "SELECT response_status, response_headers, response_body FROM idempotency_records",
    )
    .fetch_all(&pool)
    .await
    .expect("read the idempotency records");
    pool.close().await;
    rows.into_iter()
        .map(|row| Row {
            status: row.get("response_status"),
            headers: row
                .get::<Option<Vec<u8>>, _>("response_headers")
                .unwrap_or_default(),
            body: row
                .get::<Option<Vec<u8>>, _>("response_body")
                .unwrap_or_default(),
        })
        .collect()
}

/// Every finished row holds plain bytes: no gzip body, no stored `Content-Encoding`.
fn assert_rows_are_plain(rows: &[Row]) {
    for row in rows {
        assert!(
            !row.body.starts_with(&[0x1f, 0x8b]),
            "a gzip body was stored: {row:?}"
        );
        let headers = String::from_utf8_lossy(&row.headers).to_ascii_lowercase();
        assert!(
            !headers.contains("content-encoding"),
            "an encoding was stored: {headers}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// Encodings
// ------------------------------------------------------------------------------------------

#[tokio::test]
async fn keyed_requests_with_and_without_gzip_are_replayed_in_the_encoding_each_accepts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &[]);
    let client = client();

    // rustberg advertises its own cache's PT24H; the layer's lifetime replaces it, in
    // whatever encoding the client accepts.
    for gzip in [false, true] {
        let config = get(
            &client,
            server.url("/v1/config"),
            With {
                gzip,
                ..With::default()
            },
        )
        .await;
        assert_eq!(config.status, 200, "{}", config.text());
        assert_eq!(config.encoding(), gzip.then_some("gzip"), "gzip: {gzip}");
        assert_eq!(
            config.json()["idempotency-key-lifetime"],
            "PT30M",
            "gzip: {gzip}: {}",
            config.text()
        );
    }

    // createNamespace and createTable, each first sent by a client that accepts gzip,
    // then retried by clients that do and do not.
    let namespace_key = key();
    let table_key = key();
    let namespace = namespace_body("enc");
    let table = create_table_body("events");
    let cases = [
        ("/v1/namespaces", &namespace_key, &namespace),
        ("/v1/namespaces/enc/tables", &table_key, &table),
    ];
    for (path, key, body) in cases {
        let first = post(
            &client,
            server.url(path),
            With {
                key: Some(key),
                gzip: true,
                ..With::default()
            },
            body,
        )
        .await;
        assert_eq!(first.status, 200, "{path}: {}", first.text());
        assert!(!first.replayed());
        assert_eq!(
            first.encoding(),
            Some("gzip"),
            "{path}: compressed outside the layer"
        );
        let first_text = first.text();
        for gzip in [false, true, false] {
            let retry = post(
                &client,
                server.url(path),
                With {
                    key: Some(key),
                    gzip,
                    ..With::default()
                },
                body,
            )
            .await;
            assert_eq!(retry.status, 200, "{path}: {}", retry.text());
            assert!(retry.replayed(), "{path}, gzip {gzip}: not a replay");
            assert!(!retry.answered_by_rustbergs_cache(), "{path}");
            assert_eq!(
                retry.encoding(),
                gzip.then_some("gzip"),
                "{path}, gzip {gzip}"
            );
            assert_eq!(retry.text(), first_text, "{path}, gzip {gzip}");
            // rustberg's security headers come back with the replay.
            assert_eq!(retry.headers["x-content-type-options"], "nosniff");
        }
    }

    // Each ran once.
    assert_eq!(namespaces(&client, &server).await, ["enc"]);
    let tables = get(
        &client,
        server.url("/v1/namespaces/enc/tables"),
        With::default(),
    )
    .await;
    assert_eq!(
        tables.json()["identifiers"].as_array().map(Vec::len),
        Some(1)
    );

    let rows = store_rows(&server).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(rows.iter().all(|row| row.status == Some(200)), "{rows:?}");
    assert_rows_are_plain(&rows);
}

/// Sends a keyed request accepting gzip, then the same request with the same key from a
/// client that accepts no encoding, as a client that lost the first answer would: the
/// retry must be a replay of the first answer (decoded, byte for byte). Returns the first
/// answer.
async fn sent_and_replayed(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<&Value>,
) -> Answer {
    let key = key();
    let gzip = With {
        key: Some(&key),
        gzip: true,
        ..With::default()
    };
    let plain = With {
        key: Some(&key),
        ..With::default()
    };
    let first = send(client, method.clone(), url.clone(), gzip, body).await;
    let retry = send(client, method.clone(), url.clone(), plain, body).await;
    assert!(
        !first.replayed(),
        "{method} {url}: the first answer is a replay"
    );
    assert!(
        retry.replayed(),
        "{method} {url}: the retry was not replayed: {} {}",
        retry.status,
        retry.text()
    );
    assert_eq!(retry.encoding(), None, "{method} {url}");
    assert_eq!(
        (retry.status, retry.text()),
        (first.status, first.text()),
        "{method} {url}: the replay differs from the first answer"
    );
    first
}

/// The check our own catalog passes (`examples/tests/iceberg_catalog.rs`), on rustberg:
/// every keyed operation rustberg serves, replayed byte for byte, and run once.
#[tokio::test]
async fn every_keyed_operation_is_replayed_byte_for_byte() {
    use reqwest::Method;
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &[]);
    let client = client();
    let post = Method::POST;

    let namespace = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces"),
        Some(&json!({"namespace": ["replays"], "properties": {"owner": "ann"}})),
    )
    .await;
    assert_eq!(namespace.status, 200, "{}", namespace.text());
    let properties = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/prefix/namespaces/replays/properties"),
        Some(&json!({"removals": ["owner"], "updates": {"team": "bi"}})),
    )
    .await;
    assert_eq!(properties.status, 200, "{}", properties.text());
    let table = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/tables"),
        Some(&create_table_body("events")),
    )
    .await;
    assert_eq!(table.status, 200, "{}", table.text());
    let created = table.json();
    let commit = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/tables/events"),
        Some(&json!({
            "requirements": [{"type": "assert-table-uuid", "uuid": created["metadata"]["table-uuid"]}],
            "updates": [{"action": "set-properties", "updates": {"k": "v"}}]
        })),
    )
    .await;
    assert_eq!(commit.status, 200, "{}", commit.text());
    // A deterministic failure is stored and replayed too.
    let stale = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/tables/events"),
        Some(&json!({
            "requirements": [{"type": "assert-last-assigned-field-id", "last-assigned-field-id": 99}],
            "updates": [{"action": "set-properties", "updates": {"k": "w"}}]
        })),
    )
    .await;
    assert_eq!(stale.status, 409, "{}", stale.text());
    let transaction = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/transactions/commit"),
        Some(&json!({"table-changes": [
            {"identifier": {"namespace": ["replays"], "name": "events"},
             "requirements": [], "updates": [{"action": "set-properties", "updates": {"tx": "1"}}]}
        ]})),
    )
    .await;
    assert_eq!(transaction.status, 204, "{}", transaction.text());
    let renamed = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/tables/rename"),
        Some(
            &json!({"source": {"namespace": ["replays"], "name": "events"},
                     "destination": {"namespace": ["replays"], "name": "events_renamed"}}),
        ),
    )
    .await;
    // The spec says 204; rustberg 0.3.0 answers 200. Either way, the replay is the same.
    assert!(matches!(renamed.status, 200 | 204), "{}", renamed.text());
    let view = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/views"),
        Some(&json!({
            "name": "recent",
            "schema": {"type": "struct", "schema-id": 0,
                       "fields": [{"id": 1, "name": "id", "required": true, "type": "long"}]},
            "view-version": {
                "version-id": 1, "schema-id": 0, "timestamp-ms": 1_700_000_000_000_i64,
                "summary": {"engine-name": "test"},
                "representations": [{"type": "sql", "sql": "SELECT id FROM replays.events_renamed", "dialect": "spark"}],
                "default-namespace": ["replays"]
            },
            "properties": {}
        })),
    )
    .await;
    assert_eq!(view.status, 200, "{}", view.text());
    let replaced = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/views/recent"),
        Some(&json!({"requirements": [], "updates": [{"action": "set-properties", "updates": {"k": "v"}}]})),
    )
    .await;
    assert_eq!(replaced.status, 200, "{}", replaced.text());
    let view_renamed = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/views/rename"),
        Some(
            &json!({"source": {"namespace": ["replays"], "name": "recent"},
                     "destination": {"namespace": ["replays"], "name": "older"}}),
        ),
    )
    .await;
    // The spec says 204; rustberg 0.3.0 answers 200. Either way, the replay is the same.
    assert!(
        matches!(view_renamed.status, 200 | 204),
        "{}",
        view_renamed.text()
    );
    let dropped = sent_and_replayed(
        &client,
        Method::DELETE,
        server.url("/v1/namespaces/replays/views/older"),
        None,
    )
    .await;
    assert_eq!(dropped.status, 204, "{}", dropped.text());
    let dropped = sent_and_replayed(
        &client,
        Method::DELETE,
        server.url("/v1/namespaces/replays/tables/events_renamed"),
        None,
    )
    .await;
    assert_eq!(dropped.status, 204, "{}", dropped.text());
    let dropped = sent_and_replayed(
        &client,
        Method::DELETE,
        server.url("/v1/namespaces/replays"),
        None,
    )
    .await;
    assert_eq!(dropped.status, 204, "{}", dropped.text());
    assert!(namespaces(&client, &server).await.is_empty());
    let rows = store_rows(&server).await;
    assert_rows_are_plain(&rows);
    // The answers that carried metadata (createTable, updateTable, createView, replaceView)
    // were stored as a pointer to their metadata file, and replayed from it above.
    let pointers = rows
        .iter()
        .filter(|row| {
            let body = String::from_utf8_lossy(&row.body);
            body.contains("\"metadata-location\"") && body.contains("\"metadata\":null")
        })
        .count();
    assert_eq!(pointers, 4, "{rows:?}");
    assert!(
        rows.iter()
            .all(|row| !String::from_utf8_lossy(&row.body).contains("format-version")),
        "no stored answer holds metadata"
    );
}

// ------------------------------------------------------------------------------------------
// Vended credentials
// ------------------------------------------------------------------------------------------

/// The secret of an answer's vended credential.
fn vended_secret(answer: &Answer) -> String {
    let body = answer.json();
    let credentials = body["storage-credentials"]
        .as_array()
        .unwrap_or_else(|| panic!("no storage-credentials: {body}"));
    assert_eq!(credentials.len(), 1, "{body}");
    let secret = credentials[0]["config"]["s3.secret-access-key"]
        .as_str()
        .unwrap_or_else(|| panic!("no secret: {body}"));
    assert!(secret.starts_with("test-secret-"), "{body}");
    secret.to_owned()
}

/// Whether `needle` occurs in the bytes of any file under `dir` (the SQLite database, its
/// WAL and shared memory).
fn files_contain(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).expect("data dir").filter_map(Result::ok) {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_file() && name.starts_with("idempotency.db") {
            let bytes = fs::read(&path).expect("read a database file");
            if bytes.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                found.push(path);
            }
        }
    }
    found
}

#[tokio::test]
async fn vended_credentials_never_reach_the_store_and_every_replay_gets_fresh_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &["--vend-test-credentials"]);
    let client = client();

    let ns = post(
        &client,
        server.url("/v1/namespaces"),
        With::default(),
        &namespace_body("creds"),
    )
    .await;
    assert_eq!(ns.status, 200, "{}", ns.text());

    let key = key();
    let body = create_table_body("vended");
    let with = |gzip| With {
        key: Some(&key),
        gzip,
        vended_credentials: true,
    };
    let first = post(
        &client,
        server.url("/v1/namespaces/creds/tables"),
        with(true),
        &body,
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.encoding(), Some("gzip"));
    let mut secrets = vec![vended_secret(&first)];

    for gzip in [false, true] {
        let retry = post(
            &client,
            server.url("/v1/namespaces/creds/tables"),
            with(gzip),
            &body,
        )
        .await;
        assert_eq!(retry.status, 200, "{}", retry.text());
        assert!(retry.replayed(), "gzip {gzip}");
        assert_eq!(retry.encoding(), gzip.then_some("gzip"));
        let secret = vended_secret(&retry);
        assert!(
            !secrets.contains(&secret),
            "a stale credential was replayed: {secret}"
        );
        secrets.push(secret);
        // Everything but the credentials is the first answer.
        let (mut replayed, mut original) = (retry.json(), first.json());
        replayed
            .as_object_mut()
            .unwrap()
            .remove("storage-credentials");
        original
            .as_object_mut()
            .unwrap()
            .remove("storage-credentials");
        assert_eq!(replayed, original);
    }

    // The raw rows and the database files hold no secret, session token or key id.
    let rows = store_rows(&server).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_rows_are_plain(&rows);
    let stored = String::from_utf8_lossy(&rows[0].body).into_owned();
    assert!(stored.contains("\"metadata-location\""), "{stored}");
    for secret in &secrets {
        let session = secret.replace("test-secret-", "test-session-");
        for needle in [secret.as_str(), session.as_str()] {
            assert!(!stored.contains(needle), "the stored answer holds {needle}");
            let files = files_contain(&server.data, needle);
            assert!(files.is_empty(), "{needle} is written in {files:?}");
        }
    }
    for needle in [
        "test-secret-",
        "test-session-",
        "AKIATEST",
        "storage-credentials",
    ] {
        assert!(
            !stored.contains(needle),
            "the stored answer holds {needle}: {stored}"
        );
    }
}

// ------------------------------------------------------------------------------------------
// rustberg's own key cache
// ------------------------------------------------------------------------------------------

/// The issue's case: the layer's lifetime is 3 s, and one key is sent again after 5 s
/// with another body.
async fn reuse_a_key_after_the_lifetime(server: &Server) -> (Answer, Answer, Answer) {
    let client = client();
    let key = key();
    let with = With {
        key: Some(&key),
        ..With::default()
    };
    let first = post(
        &client,
        server.url("/v1/namespaces"),
        with,
        &namespace_body("first"),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let within = post(
        &client,
        server.url("/v1/namespaces"),
        with,
        &namespace_body("second"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = post(
        &client,
        server.url("/v1/namespaces"),
        with,
        &namespace_body("second"),
    )
    .await;
    (first, within, after)
}

#[tokio::test]
async fn a_key_reused_after_the_lifetime_runs_again_and_rustbergs_cache_never_answers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &["--idempotency-lifetime", "PT3S"]);
    let (_, within, after) = reuse_a_key_after_the_lifetime(&server).await;

    assert_eq!(within.status, 422, "within the lifetime: {}", within.text());
    assert_eq!(
        within.json()["error"]["type"],
        "IdempotencyKeyReusedException"
    );

    assert_eq!(after.status, 200, "after the lifetime: {}", after.text());
    assert!(!after.replayed() && !after.answered_by_rustbergs_cache());
    assert_eq!(after.json()["namespace"], json!(["second"]));
    let mut names = namespaces(&client(), &server).await;
    names.sort();
    assert_eq!(names, ["first", "second"]);
}

/// The control: with the key forwarded, rustberg's cache answers the reused key with its
/// first answer (24 hours, no check of the body), and the second namespace is never
/// created. This is why the layer keeps the key from the wrapped service by default.
#[tokio::test]
async fn forwarding_the_key_lets_rustbergs_cache_answer_in_the_layers_place() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(
        dir.path(),
        &[
            "--idempotency-lifetime",
            "PT3S",
            "--forward-idempotency-key",
        ],
    );
    let (_, _, after) = reuse_a_key_after_the_lifetime(&server).await;
    assert_eq!(after.status, 200, "{}", after.text());
    assert!(after.answered_by_rustbergs_cache(), "{:?}", after.headers);
    assert_eq!(after.json()["namespace"], json!(["first"]));
    assert_eq!(namespaces(&client(), &server).await, ["first"]);
}

// ------------------------------------------------------------------------------------------
// PyIceberg
// ------------------------------------------------------------------------------------------

/// A virtual environment with the pinned PyIceberg (the requirements of the `examples`
/// crate's PyIceberg test, so both share one environment under `target/tmp`), created once
/// and reused while the requirements are unchanged. `None` (outside CI) when it cannot
/// be set up.
fn pyiceberg_python() -> Option<PathBuf> {
    let requirements_file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/pyiceberg-requirements.txt");
    let requirements = fs::read_to_string(&requirements_file).expect("requirements file");
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyiceberg-venv");
    let python = venv.join("bin/python");
    let marker = venv.join("installed-requirements.txt");
    if python.exists() && fs::read_to_string(&marker).is_ok_and(|m| m == requirements) {
        return Some(python);
    }
    let _ = fs::remove_dir_all(&venv);
    let interpreter = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let venv_arg = venv.to_str().expect("UTF-8 path");
    let requirements_arg = requirements_file.to_str().expect("UTF-8 path");
    let python_arg = python.to_str().expect("UTF-8 path");
    let steps: [(&str, Vec<&str>); 2] = [
        (&interpreter, vec!["-m", "venv", venv_arg]),
        (
            python_arg,
            vec![
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--quiet",
                "-r",
                requirements_arg,
            ],
        ),
    ];
    for (program, args) in steps {
        let outcome = Command::new(program)
            .args(&args)
            .stdin(Stdio::null())
            .output();
        let why = match outcome {
            Ok(output) if output.status.success() => continue,
            Ok(output) => format!(
                "setting up PyIceberg failed: {program} {args:?}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
            Err(e) => format!("cannot run {program}: {e}"),
        };
        assert!(!in_ci(), "{why} (CI=true: this is a failure, not a skip)");
        eprintln!("SKIPPED: {why}");
        return None;
    }
    fs::write(&marker, requirements).expect("write marker");
    Some(python)
}

#[test]
fn pyiceberg_end_to_end_with_every_mutation_keyed_and_sent_twice() {
    let Some(python) = pyiceberg_python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &["--vend-test-credentials"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pyiceberg_keyed.py");
    let (stdout_path, stderr_path) = (dir.path().join("py.out"), dir.path().join("py.err"));
    let mut child = Command::new(python)
        .arg(script)
        .arg(&server.base)
        .arg("py_ns")
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(fs::File::create(&stdout_path).expect("stdout file"))
        .stderr(fs::File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .expect("run python");
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for python") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = fs::read_to_string(&stdout_path).unwrap_or_default();
    let stderr = fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(
        status.is_some_and(|status| status.success()),
        "PyIceberg script failed or ran over 300 s ({status:?}):\n{stdout}\n{stderr}"
    );
    let summary: Value = serde_json::from_str(stdout.lines().last().expect("summary line"))
        .unwrap_or_else(|e| panic!("summary is not JSON ({e}): {stdout}"));
    eprintln!("PyIceberg summary: {summary}");

    assert_eq!(summary["pyiceberg"], json!("0.12.0"));
    assert_eq!(summary["config_lifetime"], json!("PT30M"));
    assert_eq!(summary["config_encoding"], json!("gzip"), "{summary}");
    assert_eq!(
        summary["rows"],
        json!([{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}])
    );
    assert_eq!(
        summary["snapshots"],
        json!(2),
        "two appends, each committed once"
    );
    assert_eq!(summary["columns"], json!(["id", "name", "score"]));
    assert_eq!(summary["renamed_rows"], json!(3));
    assert_eq!(summary["after_drop"], json!("NoSuchTableError"));
    assert_eq!(summary["namespace_dropped"], json!(true));
    // Every mutation went out twice with one key, and the second was a replay.
    let keyed = summary["keyed"].as_u64().expect("keyed count");
    assert!(keyed >= 8, "{summary}");
    assert_eq!(summary["not_replayed"], json!([]), "{summary}");
    assert_eq!(summary["replayed"], json!(keyed), "{summary}");
    assert!(
        summary["gzip_answers"].as_u64().is_some_and(|n| n > 0),
        "PyIceberg accepts gzip, and some answers should have been compressed: {summary}"
    );
    // A table creation replayed with a credential other than the first answer's.
    assert_eq!(
        summary["fresh_credentials_on_replay"],
        json!(true),
        "{summary}"
    );

    // Nothing PyIceberg was vended is in the layer's database.
    for needle in ["test-secret-", "test-session-"] {
        let files = files_contain(&server.data, needle);
        assert!(files.is_empty(), "{needle} is written in {files:?}");
    }
}
