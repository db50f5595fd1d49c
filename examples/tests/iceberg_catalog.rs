//! End-to-end tests of the `iceberg-catalog` binary: each test starts the real server on a
//! free port in a temporary directory and drives it with real clients.
//!
//! - PyIceberg (installed from PyPI into `target/tmp/pyiceberg-venv` on first use) creates
//!   a namespace and tables, appends rows and reads them back through the catalog.
//! - Raw HTTP (reqwest) retries requests with `Idempotency-Key` and checks replays, key
//!   reuse with another body, the `idempotency-key-lifetime` config field (parsed by
//!   `java.time.Duration.parse` itself), Iceberg error bodies and `{prefix}` paths.
//! - A server stopped with SIGTERM and started again on its SQLite file still replays.
//! - With `--idempotency-store redis://…` the records live in a Redis server the test
//!   starts itself: a retry is replayed from it, also after the catalog restarts.
//! - Two replicas over one PostgreSQL (and one MariaDB/MySQL) database act as one catalog:
//!   a keyed retry on replica B replays replica A's answer, and commits racing on one base
//!   across both have exactly one winner.
//! - A replica that dies right after it committed an `updateTable` (it aborts on purpose,
//!   `ICEBERG_CATALOG_CRASH_AFTER_COMMIT=1`) is replayed by the other on the retry, not
//!   answered 409, and PyIceberg loads the table with its one new schema.
//! - A `COMMIT` whose answer a proxy loses (the server commits) is never run again by its
//!   retry, over PostgreSQL and MySQL, with the records in the same database (one commit
//!   or two) and in Redis.
//!
//! Under `CI=true` an unreachable database, a failed `pip install`, a missing `java` or
//! `redis-server` is a failure; elsewhere the test that needs it says why and returns early.

use simulation::proxy as commit_proxy;

use std::fs;
use std::io::Read as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BINARY: &str = env!("CARGO_BIN_EXE_iceberg-catalog");

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Gives up on an optional prerequisite: a failure under CI, a note and an early return
/// elsewhere.
fn unavailable(what: &str) {
    if in_ci() {
        panic!("{what} (CI=true: this is a failure, not a skip)");
    }
    eprintln!("SKIPPED: {what}");
}

// ------------------------------------------------------------------------------------------
// Running the server
// ------------------------------------------------------------------------------------------

/// A running `iceberg-catalog` process; killed on drop, with its log printed if the test
/// failed.
struct Server {
    child: Child,
    base: String,
    log: PathBuf,
    /// Started without `--no-idempotency`.
    idempotent: bool,
}

impl Server {
    /// Starts the binary in `dir` with `args` (plus `--listen`) and waits until it accepts
    /// connections.
    fn start(dir: &Path, args: &[&str]) -> Self {
        Self::start_with_env(dir, args, &[])
    }

    /// [`start`](Self::start), with environment variables set for the process.
    fn start_with_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        for attempt in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let log = dir.join(format!("catalog-{port}.log"));
            let out = fs::File::create(&log).expect("log file");
            let child = Command::new(BINARY)
                .current_dir(dir)
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .args(args)
                .env("RUST_LOG", "info")
                .envs(env.iter().copied())
                .stdout(out.try_clone().expect("log file"))
                .stderr(out)
                .spawn()
                .expect("start iceberg-catalog");
            let mut server = Server {
                child,
                base: format!("http://127.0.0.1:{port}"),
                log,
                idempotent: !args.contains(&"--no-idempotency"),
            };
            if server.wait_ready(port) {
                return server;
            }
            eprintln!(
                "iceberg-catalog did not start (attempt {attempt}):\n{}",
                server.log_text()
            );
        }
        panic!("iceberg-catalog did not start");
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

    /// Sends SIGTERM and waits for the process to exit; returns whether it exited cleanly.
    fn terminate(&mut self) -> bool {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
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
// HTTP helpers
// ------------------------------------------------------------------------------------------

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("http client")
}

struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The `type` of an Iceberg `ErrorModel` body, checking its shape.
    fn error_type(&self) -> String {
        let body = self.json();
        let error = &body["error"];
        assert_eq!(error["code"], json!(self.status), "ErrorModel code: {body}");
        assert!(error["message"].is_string(), "ErrorModel message: {body}");
        error["type"].as_str().expect("ErrorModel type").to_owned()
    }
}

async fn send(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    key: Option<&str>,
    body: Option<&Value>,
) -> Answer {
    let mut request = client.request(method, url);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let response = request.send().await.expect("request sent");
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = response.text().await.expect("response body");
    Answer {
        status,
        replayed,
        body,
    }
}

async fn get(client: &reqwest::Client, url: String) -> Answer {
    send(client, reqwest::Method::GET, url, None, None).await
}

async fn post(client: &reqwest::Client, url: String, key: Option<&str>, body: &Value) -> Answer {
    send(client, reqwest::Method::POST, url, key, Some(body)).await
}

fn key() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
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
        "properties": {"created-by": "iceberg_catalog test"}
    })
}

/// A new namespace (its name starts with `prefix`) with the table `evolving` in it, for
/// [`add_a_column_to_schema_0`]; the namespace's name.
async fn create_evolving_table(client: &reqwest::Client, server: &Server, prefix: &str) -> String {
    let namespace = unique(prefix);
    create_namespace(client, server, &namespace).await;
    let created = post(
        client,
        server.url(&format!("/v1/namespaces/{namespace}/tables")),
        Some(&key()),
        &create_table_body("evolving"),
    )
    .await;
    assert_eq!(created.status, 200, "{}", created.body);
    namespace
}

/// An `updateTable` that adds a column to the schema of a table created by
/// [`create_table_body`]: run a second time, its requirement fails (409).
fn add_a_column_to_schema_0() -> Value {
    json!({
        "requirements": [{"type": "assert-current-schema-id", "current-schema-id": 0}],
        "updates": [
            {"action": "add-schema", "schema": {
                "type": "struct", "schema-id": 1,
                "fields": [
                    {"id": 1, "name": "id", "required": true, "type": "long"},
                    {"id": 2, "name": "data", "required": false, "type": "string"},
                    {"id": 3, "name": "added", "required": false, "type": "int"}
                ]
            }},
            {"action": "set-current-schema", "schema-id": -1}
        ]
    })
}

/// Creates a namespace with a key, and checks that a retry is replayed byte for byte
/// (or, without the layer, runs again and conflicts).
async fn create_namespace(client: &reqwest::Client, server: &Server, namespace: &str) {
    let key = key();
    let body = json!({"namespace": [namespace]});
    let answer = post(client, server.url("/v1/namespaces"), Some(&key), &body).await;
    assert_eq!(answer.status, 200, "create namespace: {}", answer.body);
    let retry = post(client, server.url("/v1/namespaces"), Some(&key), &body).await;
    if server.idempotent {
        assert!(retry.replayed, "retried createNamespace: {}", retry.body);
        assert_eq!((retry.status, &retry.body), (200, &answer.body));
    } else {
        assert_eq!(retry.status, 409, "{}", retry.body);
        assert!(!retry.replayed);
    }
}

async fn table_names(client: &reqwest::Client, server: &Server, namespace: &str) -> Vec<String> {
    let answer = get(
        client,
        server.url(&format!("/v1/namespaces/{namespace}/tables")),
    )
    .await;
    assert_eq!(answer.status, 200, "list tables: {}", answer.body);
    answer.json()["identifiers"]
        .as_array()
        .expect("identifiers")
        .iter()
        .map(|id| id["name"].as_str().expect("name").to_owned())
        .collect()
}

/// The metadata files written for one table, i.e. how many times it was created or
/// committed.
fn metadata_files(warehouse: &Path, namespace: &str, table: &str) -> usize {
    fs::read_dir(warehouse.join(namespace).join(table).join("metadata"))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".metadata.json"))
                .count()
        })
        .unwrap_or(0)
}

// ------------------------------------------------------------------------------------------
// Raw HTTP: replay, key reuse, config field, errors
// ------------------------------------------------------------------------------------------

#[tokio::test]
async fn create_table_retried_with_a_key_is_replayed_and_runs_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The defaults: a SQLite file and ./warehouse in the working directory.
    let server = Server::start(dir.path(), &[]);
    let client = client();
    create_namespace(&client, &server, "db").await;

    let key = key();
    let body = create_table_body("orders");
    let url = server.url("/v1/namespaces/db/tables");
    let first = post(&client, url.clone(), Some(&key), &body).await;
    assert_eq!(first.status, 200, "first create: {}", first.body);
    assert!(!first.replayed, "the first answer is not a replay");
    let created = first.json();
    let location = created["metadata-location"]
        .as_str()
        .expect("metadata-location");
    assert!(
        location.starts_with("file://")
            && location.contains("/warehouse/db/orders/metadata/00000-")
            && location.ends_with(".metadata.json"),
        "metadata location {location}"
    );
    assert_eq!(created["metadata"]["format-version"], json!(2));

    // The client lost the answer and retries with the same key: the stored answer comes
    // back byte for byte (this catalog vends no credentials, so nothing was taken out of
    // it), and the table is not created again.
    let retry = post(&client, url.clone(), Some(&key), &body).await;
    assert_eq!(retry.status, 200, "retry: {}", retry.body);
    assert!(
        retry.replayed,
        "the retry carries idempotent-replayed: true"
    );
    assert_eq!(
        retry.body, first.body,
        "the replay is the first answer, byte for byte"
    );
    assert!(dir.path().join("iceberg-catalog.db").exists());
    assert_eq!(table_names(&client, &server, "db").await, ["orders"]);
    assert_eq!(
        metadata_files(&dir.path().join("warehouse"), "db", "orders"),
        1
    );

    // The same key with another body is refused before it reaches the catalog.
    let other = post(
        &client,
        url.clone(),
        Some(&key),
        &create_table_body("other"),
    )
    .await;
    assert_eq!(other.status, 422, "key reuse: {}", other.body);
    assert!(!other.replayed);
    other.error_type();
    assert_eq!(table_names(&client, &server, "db").await, ["orders"]);

    // A commit retried with its key: the retry is not applied a second time (which, for
    // an append, would add the data twice, or fail a requirement and make the client
    // think its commit failed).
    let commit_key = self::key();
    let commit = json!({
        "requirements": [{"type": "assert-table-uuid", "uuid": created["metadata"]["table-uuid"]}],
        "updates": [{"action": "set-properties", "updates": {"owner": "ops"}}]
    });
    let table_url = server.url("/v1/namespaces/db/tables/orders");
    let committed = post(&client, table_url.clone(), Some(&commit_key), &commit).await;
    assert_eq!(committed.status, 200, "commit: {}", committed.body);
    let commit_retry = post(&client, table_url.clone(), Some(&commit_key), &commit).await;
    assert_eq!(
        commit_retry.status, 200,
        "commit retry: {}",
        commit_retry.body
    );
    assert!(commit_retry.replayed);
    assert_eq!(commit_retry.body, committed.body);
    assert_eq!(
        metadata_files(&dir.path().join("warehouse"), "db", "orders"),
        2,
        "one file from the create, one from the single commit"
    );
    let loaded = get(&client, table_url).await.json();
    assert_eq!(
        loaded["metadata-location"],
        committed.json()["metadata-location"]
    );

    // A new key for the same body runs the create again, which now conflicts; that answer
    // (a deterministic 4xx) is itself stored and replayed.
    let second_key = self::key();
    let conflict = post(&client, url.clone(), Some(&second_key), &body).await;
    assert_eq!(conflict.status, 409);
    assert_eq!(conflict.error_type(), "AlreadyExistsException");
    let conflict_retry = post(&client, url.clone(), Some(&second_key), &body).await;
    assert_eq!(conflict_retry.status, 409);
    assert!(conflict_retry.replayed);

    // Without a key the request passes straight through.
    let unkeyed = post(&client, url, None, &body).await;
    assert_eq!(unkeyed.status, 409);
    assert!(!unkeyed.replayed);

    // A malformed key is refused in the Iceberg error shape.
    let bad = post(
        &client,
        server.url("/v1/namespaces"),
        Some("not-a-uuid"),
        &json!({"namespace": ["x"]}),
    )
    .await;
    assert_eq!(bad.status, 400, "malformed key: {}", bad.body);
    bad.error_type();

    let log = server.log_text();
    assert!(
        log.contains("POST /v1/namespaces/db/tables 200 idempotency=executed"),
        "{log}"
    );
    assert!(
        log.contains("POST /v1/namespaces/db/tables 200 idempotency=replayed"),
        "{log}"
    );
}

/// Parses each duration with `java.time.Duration.parse` (the Iceberg Java client's
/// parser) and returns the seconds; `None` when no `java` is installed outside CI.
fn java_duration_seconds(durations: &[&str]) -> Option<Vec<u64>> {
    let checker = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/DurationCheck.java");
    let output = match Command::new("java").arg(&checker).args(durations).output() {
        Ok(output) => output,
        Err(e) => {
            unavailable(&format!("java is needed to check durations: {e}"));
            return None;
        }
    };
    assert!(
        output.status.success(),
        "java.time.Duration.parse rejected {durations:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(
        String::from_utf8(output.stdout)
            .expect("utf-8")
            .lines()
            .map(|line| line.trim().parse().expect("seconds"))
            .collect(),
    )
}

#[tokio::test]
async fn config_advertises_the_key_lifetime_only_when_enabled() {
    let dir = tempfile::tempdir().expect("temp dir");
    let client = client();

    let default = Server::start(dir.path(), &["--database", "sqlite://a.db?mode=rwc"]);
    let config = get(&client, default.url("/v1/config")).await;
    assert_eq!(config.status, 200);
    let config = config.json();
    assert_eq!(
        config["idempotency-key-lifetime"],
        json!("PT30M"),
        "{config}"
    );
    assert!(config["defaults"].is_object() && config["overrides"].is_object());
    assert!(config["defaults"].get("idempotency-key-lifetime").is_none());
    assert!(
        config["overrides"]
            .get("idempotency-key-lifetime")
            .is_none()
    );

    let hour = Server::start(
        dir.path(),
        &[
            "--database",
            "sqlite://b.db?mode=rwc",
            "--warehouse",
            "wh-b",
            "--idempotency-lifetime",
            "PT1H30M",
        ],
    );
    let config = get(&client, hour.url("/v1/config")).await.json();
    let advertised = config["idempotency-key-lifetime"]
        .as_str()
        .expect("lifetime advertised")
        .to_owned();
    assert_eq!(advertised, "PT1H30M");
    if let Some(seconds) = java_duration_seconds(&["PT30M", &advertised]) {
        assert_eq!(seconds, [1800, 5400]);
    }

    let off = Server::start(
        dir.path(),
        &[
            "--database",
            "sqlite://c.db?mode=rwc",
            "--warehouse",
            "wh-c",
            "--no-idempotency",
        ],
    );
    let config = get(&client, off.url("/v1/config")).await.json();
    assert!(
        config.get("idempotency-key-lifetime").is_none(),
        "disabled: no lifetime, so clients send no keys: {config}"
    );
    // With the layer off the header means nothing: a retry runs again and conflicts.
    create_namespace(&client, &off, "db").await;
    let key = key();
    let url = off.url("/v1/namespaces/db/tables");
    let first = post(&client, url.clone(), Some(&key), &create_table_body("t")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let retry = post(&client, url, Some(&key), &create_table_body("t")).await;
    assert_eq!(retry.status, 409, "{}", retry.body);
    assert!(!retry.replayed);
    assert!(off.log_text().contains("idempotency=passed-through"));
}

/// Sends a keyed request, then the same request with the same key, as a client that
/// lost the first answer would: the retry must be a replay of the first answer, byte for
/// byte. Returns the first answer.
async fn sent_and_replayed(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<&Value>,
) -> Answer {
    let key = key();
    let first = send(client, method.clone(), url.clone(), Some(&key), body).await;
    let retry = send(client, method.clone(), url.clone(), Some(&key), body).await;
    assert!(
        !first.replayed,
        "{method} {url}: the first answer is not a replay"
    );
    assert!(
        retry.replayed,
        "{method} {url}: the retry was not replayed: {}",
        retry.body
    );
    assert_eq!(
        (retry.status, &retry.body),
        (first.status, &first.body),
        "{method} {url}: the replay differs from the first answer"
    );
    first
}

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
    assert_eq!(namespace.status, 200, "{}", namespace.body);
    let properties = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/prefix/namespaces/replays/properties"),
        Some(&json!({"removals": ["owner"], "updates": {"team": "bi"}})),
    )
    .await;
    assert_eq!(properties.status, 200, "{}", properties.body);
    let table = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/tables"),
        Some(&create_table_body("events")),
    )
    .await;
    assert_eq!(table.status, 200, "{}", table.body);
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
    assert_eq!(commit.status, 200, "{}", commit.body);
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
    assert_eq!(stale.status, 409, "{}", stale.body);
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
    assert_eq!(transaction.status, 204, "{}", transaction.body);
    let registered = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/register"),
        Some(&json!({"name": "events_copy", "metadata-location": commit.json()["metadata-location"]})),
    )
    .await;
    assert_eq!(registered.status, 200, "{}", registered.body);
    let renamed = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/tables/rename"),
        Some(
            &json!({"source": {"namespace": ["replays"], "name": "events_copy"},
                     "destination": {"namespace": ["replays"], "name": "copy"}}),
        ),
    )
    .await;
    assert_eq!(renamed.status, 204, "{}", renamed.body);
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
                "representations": [{"type": "sql", "sql": "SELECT id FROM replays.events", "dialect": "spark"}],
                "default-namespace": ["replays"]
            },
            "properties": {}
        })),
    )
    .await;
    assert_eq!(view.status, 200, "{}", view.body);
    let replaced = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/views/recent"),
        Some(&json!({"requirements": [], "updates": [{"action": "set-properties", "updates": {"k": "v"}}]})),
    )
    .await;
    assert_eq!(replaced.status, 200, "{}", replaced.body);
    let view_registered = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/namespaces/replays/register-view"),
        Some(&json!({"name": "recent_copy", "metadata-location": replaced.json()["metadata-location"]})),
    )
    .await;
    assert_eq!(view_registered.status, 200, "{}", view_registered.body);
    let view_renamed = sent_and_replayed(
        &client,
        post.clone(),
        server.url("/v1/views/rename"),
        Some(
            &json!({"source": {"namespace": ["replays"], "name": "recent_copy"},
                     "destination": {"namespace": ["replays"], "name": "older"}}),
        ),
    )
    .await;
    assert_eq!(view_renamed.status, 204, "{}", view_renamed.body);
    for view in ["recent", "older"] {
        let dropped = sent_and_replayed(
            &client,
            Method::DELETE,
            server.url(&format!("/v1/namespaces/replays/views/{view}")),
            None,
        )
        .await;
        assert_eq!(dropped.status, 204, "{}", dropped.body);
    }
    for table in ["events", "copy"] {
        let dropped = sent_and_replayed(
            &client,
            Method::DELETE,
            server.url(&format!("/v1/namespaces/replays/tables/{table}")),
            None,
        )
        .await;
        assert_eq!(dropped.status, 204, "{}", dropped.body);
    }
    let dropped = sent_and_replayed(
        &client,
        Method::DELETE,
        server.url("/v1/namespaces/replays"),
        None,
    )
    .await;
    assert_eq!(dropped.status, 204, "{}", dropped.body);
}

#[tokio::test]
async fn catalog_speaks_the_rest_spec_with_and_without_prefix() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &[]);
    let client = client();

    // Namespaces, also through a {prefix} path, and nested ones (levels joined by 0x1F).
    let created = post(
        &client,
        server.url("/v1/warehouse1/namespaces"),
        Some(&key()),
        &json!({"namespace": ["sales"], "properties": {"owner": "ann"}}),
    )
    .await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(created.json()["properties"], json!({"owner": "ann"}));
    create_namespace(&client, &server, "other").await;
    let nested = post(
        &client,
        server.url("/v1/namespaces"),
        None,
        &json!({"namespace": ["sales", "eu"]}),
    )
    .await;
    assert_eq!(nested.status, 200, "{}", nested.body);
    let top = get(&client, server.url("/v1/namespaces")).await.json();
    assert_eq!(top["namespaces"], json!([["other"], ["sales"]]));
    let children = get(&client, server.url("/v1/namespaces?parent=sales"))
        .await
        .json();
    assert_eq!(children["namespaces"], json!([["sales", "eu"]]));
    let eu = get(&client, server.url("/v1/namespaces/sales%1Feu")).await;
    assert_eq!(eu.status, 200, "{}", eu.body);

    let head = send(
        &client,
        reqwest::Method::HEAD,
        server.url("/v1/namespaces/sales"),
        None,
        None,
    )
    .await;
    assert_eq!(head.status, 204);
    let head = send(
        &client,
        reqwest::Method::HEAD,
        server.url("/v1/namespaces/nope"),
        None,
        None,
    )
    .await;
    assert_eq!(head.status, 404);
    let missing = get(&client, server.url("/v1/namespaces/nope")).await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.error_type(), "NoSuchNamespaceException");

    let updated = post(
        &client,
        server.url("/v1/namespaces/sales/properties"),
        Some(&key()),
        &json!({"removals": ["owner", "absent"], "updates": {"team": "bi"}}),
    )
    .await;
    assert_eq!(updated.status, 200, "{}", updated.body);
    assert_eq!(
        updated.json(),
        json!({"updated": ["team"], "removed": ["owner"], "missing": ["absent"]})
    );
    let both = post(
        &client,
        server.url("/v1/namespaces/sales/properties"),
        None,
        &json!({"removals": ["team"], "updates": {"team": "x"}}),
    )
    .await;
    assert_eq!(both.status, 422);
    let loaded = get(&client, server.url("/v1/namespaces/sales"))
        .await
        .json();
    assert_eq!(loaded["properties"], json!({"team": "bi"}));

    // Tables: create, errors, commit with requirements, rename, register, drop.
    let in_missing = post(
        &client,
        server.url("/v1/namespaces/nope/tables"),
        None,
        &create_table_body("t"),
    )
    .await;
    assert_eq!(in_missing.status, 404);
    assert_eq!(in_missing.error_type(), "NoSuchNamespaceException");
    let created = post(
        &client,
        server.url("/v1/p/namespaces/sales/tables"),
        Some(&key()),
        &create_table_body("events"),
    )
    .await;
    assert_eq!(created.status, 200, "{}", created.body);
    let created = created.json();
    let uuid = created["metadata"]["table-uuid"].clone();
    let mut elsewhere = create_table_body("elsewhere");
    elsewhere["location"] = json!("file:///tmp/not-the-warehouse/elsewhere");
    let outside = post(
        &client,
        server.url("/v1/namespaces/sales/tables"),
        None,
        &elsewhere,
    )
    .await;
    assert_eq!(outside.status, 400, "{}", outside.body);
    assert_eq!(outside.error_type(), "BadRequestException");
    let no_table = get(&client, server.url("/v1/namespaces/sales/tables/nope")).await;
    assert_eq!(no_table.status, 404);
    assert_eq!(no_table.error_type(), "NoSuchTableException");

    let commit_url = server.url("/v1/namespaces/sales/tables/events");
    let commit = post(
        &client,
        commit_url.clone(),
        Some(&key()),
        &json!({
            "requirements": [
                {"type": "assert-table-uuid", "uuid": uuid},
                {"type": "assert-last-assigned-field-id", "last-assigned-field-id": 2}
            ],
            "updates": [
                {"action": "set-properties", "updates": {"k": "v"}},
                {"action": "add-schema", "schema": {
                    "type": "struct", "schema-id": 1,
                    "fields": [
                        {"id": 1, "name": "id", "required": true, "type": "long"},
                        {"id": 2, "name": "data", "required": false, "type": "string"},
                        {"id": 3, "name": "extra", "required": false, "type": "int"}
                    ]
                }},
                {"action": "set-current-schema", "schema-id": -1}
            ]
        }),
    )
    .await;
    assert_eq!(commit.status, 200, "{}", commit.body);
    let committed = commit.json();
    assert!(
        committed["metadata-location"]
            .as_str()
            .is_some_and(|l| l.contains("/metadata/00001-")),
        "{committed}"
    );
    assert_eq!(committed["metadata"]["properties"]["k"], json!("v"));
    assert_eq!(committed["metadata"]["current-schema-id"], json!(1));
    // The same requirement again fails: the base moved on.
    let stale = post(
        &client,
        commit_url.clone(),
        None,
        &json!({
            "requirements": [{"type": "assert-last-assigned-field-id", "last-assigned-field-id": 2}],
            "updates": [{"action": "set-properties", "updates": {"k": "w"}}]
        }),
    )
    .await;
    assert_eq!(stale.status, 409, "{}", stale.body);
    assert_eq!(stale.error_type(), "CommitFailedException");
    let unknown = post(
        &client,
        commit_url.clone(),
        None,
        &json!({"requirements": [], "updates": [{"action": "teleport"}]}),
    )
    .await;
    assert_eq!(unknown.status, 400, "{}", unknown.body);
    assert_eq!(unknown.error_type(), "BadRequestException");
    let loaded = get(&client, commit_url.clone()).await.json();
    assert_eq!(loaded["metadata-location"], committed["metadata-location"]);

    // A transaction over two tables: one requirement fails, so neither changes.
    let second = post(
        &client,
        server.url("/v1/namespaces/sales/tables"),
        None,
        &create_table_body("second"),
    )
    .await;
    assert_eq!(second.status, 200);
    let transaction = post(
        &client,
        server.url("/v1/transactions/commit"),
        Some(&key()),
        &json!({"table-changes": [
            {"identifier": {"namespace": ["sales"], "name": "events"},
             "requirements": [], "updates": [{"action": "set-properties", "updates": {"tx": "1"}}]},
            {"identifier": {"namespace": ["sales"], "name": "second"},
             "requirements": [{"type": "assert-current-schema-id", "current-schema-id": 7}],
             "updates": [{"action": "set-properties", "updates": {"tx": "1"}}]}
        ]}),
    )
    .await;
    assert_eq!(transaction.status, 409, "{}", transaction.body);
    let events = get(&client, commit_url.clone()).await.json();
    assert!(events["metadata"]["properties"].get("tx").is_none());
    let transaction = post(
        &client,
        server.url("/v1/transactions/commit"),
        None,
        &json!({"table-changes": [
            {"identifier": {"namespace": ["sales"], "name": "events"},
             "requirements": [], "updates": [{"action": "set-properties", "updates": {"tx": "1"}}]},
            {"identifier": {"namespace": ["sales"], "name": "second"},
             "requirements": [{"type": "assert-current-schema-id", "current-schema-id": 0}],
             "updates": [{"action": "set-properties", "updates": {"tx": "1"}}]}
        ]}),
    )
    .await;
    assert_eq!(transaction.status, 204, "{}", transaction.body);
    for table in ["events", "second"] {
        let loaded = get(
            &client,
            server.url(&format!("/v1/namespaces/sales/tables/{table}")),
        )
        .await
        .json();
        assert_eq!(
            loaded["metadata"]["properties"]["tx"],
            json!("1"),
            "{table}"
        );
    }

    let rename = post(
        &client,
        server.url("/v1/tables/rename"),
        Some(&key()),
        &json!({"source": {"namespace": ["sales"], "name": "second"},
                "destination": {"namespace": ["other"], "name": "moved"}}),
    )
    .await;
    assert_eq!(rename.status, 204, "{}", rename.body);
    assert_eq!(table_names(&client, &server, "other").await, ["moved"]);
    let rename_missing = post(
        &client,
        server.url("/v1/tables/rename"),
        None,
        &json!({"source": {"namespace": ["sales"], "name": "second"},
                "destination": {"namespace": ["other"], "name": "again"}}),
    )
    .await;
    assert_eq!(rename_missing.status, 404);
    assert_eq!(rename_missing.error_type(), "NoSuchTableException");

    let registered = post(
        &client,
        server.url("/v1/namespaces/other/register"),
        Some(&key()),
        &json!({"name": "events_copy", "metadata-location": committed["metadata-location"]}),
    )
    .await;
    assert_eq!(registered.status, 200, "{}", registered.body);
    assert_eq!(registered.json()["metadata"]["table-uuid"], uuid);

    let not_empty = send(
        &client,
        reqwest::Method::DELETE,
        server.url("/v1/namespaces/other"),
        None,
        None,
    )
    .await;
    assert_eq!(not_empty.status, 409);
    assert_eq!(not_empty.error_type(), "NamespaceNotEmptyException");
    for table in ["moved", "events_copy"] {
        let dropped = send(
            &client,
            reqwest::Method::DELETE,
            server.url(&format!("/v1/namespaces/other/tables/{table}")),
            Some(&key()),
            None,
        )
        .await;
        assert_eq!(dropped.status, 204, "{}", dropped.body);
    }
    let dropped = send(
        &client,
        reqwest::Method::DELETE,
        server.url("/v1/namespaces/other"),
        None,
        None,
    )
    .await;
    assert_eq!(dropped.status, 204, "{}", dropped.body);
    let head = send(
        &client,
        reqwest::Method::HEAD,
        server.url("/v1/namespaces/sales/tables/events"),
        None,
        None,
    )
    .await;
    assert_eq!(head.status, 204);
}

#[tokio::test]
async fn sigterm_stops_cleanly_and_a_restart_still_replays_from_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let client = client();
    let key = key();
    let body = json!({"namespace": ["kept"]});
    let mut server = Server::start(dir.path(), &[]);
    let first = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(server.terminate(), "exit status after SIGTERM");
    let log = server.log_text();
    assert!(
        log.contains("shutting down") && log.contains("stopped"),
        "{log}"
    );

    // The records are in the SQLite file, so the retry after the restart is replayed.
    let restarted = Server::start(dir.path(), &[]);
    let retry = post(&client, restarted.url("/v1/namespaces"), Some(&key), &body).await;
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert!(retry.replayed, "replayed after a restart");
    assert_eq!(retry.body, first.body);
}

// ------------------------------------------------------------------------------------------
// PyIceberg
// ------------------------------------------------------------------------------------------

/// A virtual environment with the pinned PyIceberg, created once and reused while the
/// requirements file is unchanged. `None` (outside CI) when it cannot be set up. Tests
/// that run at once wait for the one that sets it up.
fn pyiceberg_python() -> Option<PathBuf> {
    static SETTING_UP: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = SETTING_UP
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let requirements_file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pyiceberg-requirements.txt");
    let requirements = fs::read_to_string(&requirements_file).expect("requirements file");
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pyiceberg-venv");
    let python = venv.join("bin/python");
    let marker = venv.join("installed-requirements.txt");
    if python.exists() && fs::read_to_string(&marker).is_ok_and(|m| m == requirements) {
        return Some(python);
    }
    let _ = fs::remove_dir_all(&venv);
    let interpreter = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let steps: [(&str, Vec<&std::ffi::OsStr>); 2] = [
        (
            &interpreter,
            vec!["-m".as_ref(), "venv".as_ref(), venv.as_os_str()],
        ),
        (
            python.to_str().expect("utf-8 path"),
            vec![
                "-m".as_ref(),
                "pip".as_ref(),
                "install".as_ref(),
                "--disable-pip-version-check".as_ref(),
                "--quiet".as_ref(),
                "-r".as_ref(),
                requirements_file.as_os_str(),
            ],
        ),
    ];
    for (program, args) in steps {
        let output = Command::new(program)
            .args(&args)
            .stdin(Stdio::null())
            .output();
        match output {
            Ok(output) if output.status.success() => {}
            Ok(output) => {
                unavailable(&format!(
                    "setting up PyIceberg failed: {program} {args:?}: {}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ));
                return None;
            }
            Err(e) => {
                unavailable(&format!("cannot run {program}: {e}"));
                return None;
            }
        }
    }
    fs::write(&marker, requirements).expect("write marker");
    Some(python)
}

#[test]
fn pyiceberg_creates_appends_and_reads_back_through_the_catalog() {
    let Some(python) = pyiceberg_python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pyiceberg_roundtrip.py");
    let output = Command::new(python)
        .arg(script)
        .arg(&server.base)
        .arg("py_ns")
        .current_dir(dir.path())
        .output()
        .expect("run python");
    assert!(
        output.status.success(),
        "PyIceberg script failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).expect("utf-8");
    let summary: Value = serde_json::from_str(stdout.lines().last().expect("summary line"))
        .unwrap_or_else(|e| panic!("summary is not JSON ({e}): {stdout}"));
    eprintln!("PyIceberg summary: {summary}");

    assert_eq!(summary["pyiceberg"], json!("0.12.0"));
    assert_eq!(summary["namespaces"], json!([["py_ns"]]));
    assert_eq!(
        summary["namespace_properties"],
        json!({"owner": "pyiceberg-test"})
    );
    let warehouse = fs::canonicalize(dir.path().join("warehouse")).expect("warehouse");
    assert_eq!(
        summary["location"],
        json!(format!("file://{}/py_ns/events", warehouse.display()))
    );
    assert!(
        summary["first_metadata_location"]
            .as_str()
            .is_some_and(|l| l.contains("/py_ns/events/metadata/00000-")),
        "{summary}"
    );
    assert_eq!(summary["second_create"], json!("TableAlreadyExistsError"));
    assert_eq!(
        summary["rows"],
        json!([{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}])
    );
    assert_eq!(summary["snapshots"], json!(2));
    assert!(
        summary["metadata_location"]
            .as_str()
            .is_some_and(|l| l.contains("/metadata/00002-")),
        "two appends, two commits: {summary}"
    );
    assert_eq!(summary["columns"], json!(["id", "name", "score"]));
    assert_eq!(summary["staged_rows"], json!([{"id": 10, "name": "z"}]));
    assert_eq!(summary["view_sql"], json!("SELECT id FROM py_ns.events"));
    assert_eq!(summary["views"], json!([["py_ns", "recent"]]));
    assert_eq!(summary["view_exists"], json!(true));
    assert_eq!(summary["view_exists_after_drop"], json!(false));
    assert_eq!(
        summary["tables"],
        json!([["py_ns", "events"], ["py_ns", "staged"]])
    );
    assert_eq!(summary["renamed_rows"], json!(3));
    assert_eq!(summary["after_drop"], json!("NoSuchTableError"));
    assert_eq!(summary["namespace_dropped"], json!(true));
    // Data files were written by pyarrow into the table's location in the warehouse.
    let data = warehouse.join("py_ns/events/data");
    assert!(
        fs::read_dir(&data).is_ok_and(|d| d.count() >= 2),
        "data files under {}",
        data.display()
    );
}

// ------------------------------------------------------------------------------------------
// Replicas over one database
// ------------------------------------------------------------------------------------------

/// The database URL from `variable` (or `default`), if a server answers there.
async fn database(variable: &str, default: &str) -> Option<String> {
    let url = std::env::var(variable).unwrap_or_else(|_| default.to_owned());
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await;
    match pool {
        Ok(pool) => {
            pool.close().await;
            Some(url)
        }
        Err(e) => {
            unavailable(&format!("database {url} is unreachable: {e}"));
            None
        }
    }
}

/// Two processes on one database and one warehouse act as one catalog: a keyed retry on
/// the other replica is replayed, what one creates the other serves, and of many commits
/// racing on one base across both, exactly one wins.
async fn two_replicas_act_as_one_catalog(database_url: &str) {
    let dir = tempfile::tempdir().expect("temp dir");
    let args = [
        "--database",
        database_url,
        "--warehouse",
        "shared-warehouse",
    ];
    let a = Server::start(dir.path(), &args);
    let b = Server::start(dir.path(), &args);
    let client = client();
    let namespace = unique("replicas");
    create_namespace(&client, &a, &namespace).await;

    // Create on replica A with a key; the answer is lost and the client's retry lands on
    // replica B, which replays A's answer from the shared store.
    let create_key = key();
    let created = post(
        &client,
        a.url(&format!("/v1/namespaces/{namespace}/tables")),
        Some(&create_key),
        &create_table_body("race"),
    )
    .await;
    assert_eq!(created.status, 200, "{}", created.body);
    let retried_on_b = post(
        &client,
        b.url(&format!("/v1/namespaces/{namespace}/tables")),
        Some(&create_key),
        &create_table_body("race"),
    )
    .await;
    assert_eq!(
        retried_on_b.status, 200,
        "retry on B: {}",
        retried_on_b.body
    );
    assert!(retried_on_b.replayed, "B replays A's answer");
    assert_eq!(retried_on_b.json(), created.json());
    assert_eq!(table_names(&client, &b, &namespace).await, ["race"]);
    assert_eq!(
        metadata_files(&dir.path().join("shared-warehouse"), &namespace, "race"),
        1,
        "the table was created once"
    );
    assert!(a.log_text().contains("idempotency=executed"));
    assert!(b.log_text().contains(&format!(
        "POST /v1/namespaces/{namespace}/tables 200 idempotency=replayed"
    )));
    let on_b = get(
        &client,
        b.url(&format!("/v1/namespaces/{namespace}/tables/race")),
    )
    .await;
    assert_eq!(
        on_b.status, 200,
        "replica B serves A's table: {}",
        on_b.body
    );
    assert_eq!(
        on_b.json()["metadata-location"],
        created.json()["metadata-location"]
    );
    let again_on_b = post(
        &client,
        b.url(&format!("/v1/namespaces/{namespace}/tables")),
        None,
        &create_table_body("race"),
    )
    .await;
    assert_eq!(again_on_b.status, 409, "{}", again_on_b.body);

    // Eight commits, four per replica, all computed on the same base (last assigned field
    // id 2) and each adding a column.
    let mut racers = Vec::new();
    for i in 0..8 {
        let server = if i % 2 == 0 { &a } else { &b };
        let url = server.url(&format!("/v1/namespaces/{namespace}/tables/race"));
        let body = json!({
            "requirements": [{"type": "assert-last-assigned-field-id", "last-assigned-field-id": 2}],
            "updates": [
                {"action": "add-schema", "schema": {
                    "type": "struct", "schema-id": 1,
                    "fields": [
                        {"id": 1, "name": "id", "required": true, "type": "long"},
                        {"id": 2, "name": "data", "required": false, "type": "string"},
                        {"id": 3, "name": format!("writer_{i}"), "required": false, "type": "int"}
                    ]
                }},
                {"action": "set-current-schema", "schema-id": -1}
            ]
        });
        let client = client.clone();
        racers.push(tokio::spawn(async move {
            post(&client, url, Some(&key()), &body).await
        }));
    }
    let mut won = 0;
    for racer in racers {
        let answer = racer.await.expect("racer");
        match answer.status {
            200 => won += 1,
            409 => assert_eq!(answer.error_type(), "CommitFailedException"),
            other => panic!("unexpected {other}: {}", answer.body),
        }
    }
    assert_eq!(won, 1, "exactly one commit on one base wins");
    let table = get(
        &client,
        a.url(&format!("/v1/namespaces/{namespace}/tables/race")),
    )
    .await
    .json();
    assert_eq!(table["metadata"]["last-column-id"], json!(3));
    assert_eq!(
        table["metadata"]["schemas"].as_array().map(Vec::len),
        Some(2)
    );

    // Leave the shared database as it was.
    let dropped = send(
        &client,
        reqwest::Method::DELETE,
        b.url(&format!("/v1/namespaces/{namespace}/tables/race")),
        None,
        None,
    )
    .await;
    assert_eq!(dropped.status, 204);
    let dropped = send(
        &client,
        reqwest::Method::DELETE,
        a.url(&format!("/v1/namespaces/{namespace}")),
        None,
        None,
    )
    .await;
    assert_eq!(dropped.status, 204);
}

#[tokio::test]
async fn two_replicas_over_postgres_replay_each_other_and_commit_atomically() {
    let Some(url) = database(
        "IDEMPOTENCY_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
    .await
    else {
        return;
    };
    two_replicas_act_as_one_catalog(&url).await;
}

#[tokio::test]
async fn two_replicas_over_mysql_replay_each_other_and_commit_atomically() {
    let Some(url) = database(
        "IDEMPOTENCY_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
    .await
    else {
        return;
    };
    two_replicas_act_as_one_catalog(&url).await;
}

// ------------------------------------------------------------------------------------------
// A replica killed between its commit and its answer
// ------------------------------------------------------------------------------------------

/// The case the header exists for (apache/iceberg#13867): replica A commits an
/// `updateTable` with a requirement and dies before it answers. The client's retry with
/// the same key goes to replica B. Without the answer committed together with the change,
/// B would run the update again, fail its requirement (`assert-current-schema-id`) with a
/// 409 `CommitFailedException`, and the Java client would delete the files of the commit
/// that did happen. With it, B replays A's answer: a success, and the table has exactly
/// one new schema, which PyIceberg loads.
// The crash switch is in builds with the `test-hooks` feature only.
#[cfg(feature = "test-hooks")]
#[tokio::test]
async fn a_replica_killed_after_committing_update_table_is_replayed_by_the_other() {
    let Some(url) = database(
        "IDEMPOTENCY_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
    .await
    else {
        return;
    };
    let Some(python) = pyiceberg_python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let args = [
        "--database",
        url.as_str(),
        "--warehouse",
        "shared-warehouse",
    ];
    let b = Server::start(dir.path(), &args);
    let mut a = Server::start_with_env(
        dir.path(),
        &args,
        &[("ICEBERG_CATALOG_CRASH_AFTER_COMMIT", "1")],
    );
    let client = client();
    // Set up on B: every change A commits kills it.
    let namespace = create_evolving_table(&client, &b, "killed").await;

    let table_url =
        |server: &Server| server.url(&format!("/v1/namespaces/{namespace}/tables/evolving"));
    let update = add_a_column_to_schema_0();
    let key = key();
    let lost = client
        .post(table_url(&a))
        .header("Idempotency-Key", &key)
        .header("content-type", "application/json")
        .body(update.to_string())
        .send()
        .await;
    assert!(lost.is_err(), "A must die before it answers: {lost:?}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(status) = a.child.try_wait().expect("wait for A") {
            break status;
        }
        assert!(Instant::now() < deadline, "A did not die");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!exit.success(), "A aborted: {exit:?}");
    assert!(
        a.log_text().contains("aborting after the commit"),
        "{}",
        a.log_text()
    );

    // The client retries with the same key, on B.
    let retry = post(&client, table_url(&b), Some(&key), &update).await;
    assert_eq!(
        retry.status, 200,
        "a replay of A's success, not a 409: {}",
        retry.body
    );
    assert!(
        retry.replayed,
        "B replays the answer A committed with the change"
    );
    let answer = retry.json();
    assert_eq!(answer["metadata"]["current-schema-id"], json!(1));
    assert!(
        b.log_text().contains("idempotency=replayed"),
        "{}",
        b.log_text()
    );

    let loaded = get(&client, table_url(&b)).await.json();
    assert_eq!(
        loaded["metadata"]["schemas"].as_array().map(Vec::len),
        Some(2),
        "exactly one new schema: {loaded}"
    );
    assert_eq!(loaded["metadata"]["current-schema-id"], json!(1));
    assert_eq!(loaded["metadata-location"], answer["metadata-location"]);
    assert_eq!(
        metadata_files(&dir.path().join("shared-warehouse"), &namespace, "evolving"),
        2,
        "the create and the one commit"
    );

    // PyIceberg, a real client, loads the table as the commit left it.
    let script = r#"
import json, sys
from pyiceberg.catalog.rest import RestCatalog
table = RestCatalog("it", uri=sys.argv[1]).load_table(sys.argv[2])
print(json.dumps({"schema_id": table.schema().schema_id,
                  "columns": [field.name for field in table.schema().fields],
                  "schemas": len(table.metadata.schemas)}))
"#;
    let output = Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(&b.base)
        .arg(format!("{namespace}.evolving"))
        .output()
        .expect("run python");
    assert!(
        output.status.success(),
        "PyIceberg failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).expect("utf-8");
    let seen: Value = serde_json::from_str(stdout.lines().last().expect("a line"))
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    assert_eq!(
        seen,
        json!({"schema_id": 1, "columns": ["id", "data", "added"], "schemas": 2})
    );

    // Leave the shared database as it was.
    let dropped = send(&client, reqwest::Method::DELETE, table_url(&b), None, None).await;
    assert_eq!(dropped.status, 204);
    let dropped = send(
        &client,
        reqwest::Method::DELETE,
        b.url(&format!("/v1/namespaces/{namespace}")),
        None,
        None,
    )
    .await;
    assert_eq!(dropped.status, 204);
}

// ------------------------------------------------------------------------------------------
// Idempotency records in Redis (--idempotency-store)
// ------------------------------------------------------------------------------------------

/// A `redis-server` of the test's own on a free port (append-only file on, so that its
/// records survive its restart); killed on drop.
struct Redis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// `None` (outside CI) when `redis-server` is not installed.
    fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// A replica of `primary`, once the primary counts it online (it then acknowledges
    /// writes).
    fn replica_of(primary: &Redis) -> Self {
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()])
            .expect("redis-server is installed");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !primary
            .cli(&["INFO", "replication"])
            .lines()
            .any(|line| line.starts_with("slave0:") && line.contains("state=online"))
        {
            assert!(
                Instant::now() < deadline,
                "the replica did not come online within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        replica
    }

    /// How many `WAIT`s the server has run.
    fn waits_run(&self) -> u64 {
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find_map(|line| line.strip_prefix("cmdstat_wait:calls="))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    fn start_with(extra: &[&str]) -> Option<Self> {
        if Command::new("redis-server")
            .arg("--version")
            .output()
            .is_err()
        {
            unavailable("redis-server is not installed (apt-get install redis-server)");
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(dir.path())
            .args(["--appendonly", "yes", "--save", ""])
            .args(["--repl-diskless-sync-delay", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let redis = Redis {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while redis.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(redis)
    }

    fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn idempotency_records_can_live_in_redis() {
    let Some(redis) = Redis::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!("redis://127.0.0.1:{}", redis.port);
    let mut server = Server::start(dir.path(), &["--idempotency-store", &store]);
    assert!(
        server.log_text().contains(&format!("in {store}")),
        "the start-up line names the Redis store:\n{}",
        server.log_text()
    );
    let client = client();
    create_namespace(&client, &server, "db").await;

    let key = key();
    let body = create_table_body("events");
    let url = server.url("/v1/namespaces/db/tables");
    let first = post(&client, url.clone(), Some(&key), &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let retry = post(&client, url.clone(), Some(&key), &body).await;
    assert!(retry.replayed, "retry not replayed: {}", retry.body);
    // Same JSON (a table-loading answer is reloaded on replay for fresh credentials).
    assert_eq!(retry.json(), first.json());
    assert_eq!(table_names(&client, &server, "db").await, ["events"]);
    assert_eq!(
        metadata_files(&dir.path().join("warehouse"), "db", "events"),
        1
    );

    // The record is a hash in Redis, under the key the store documents.
    let records = redis.cli(&["--scan", "--pattern", "idempotency:*"]);
    let record = format!("idempotency:{{0::{key}}}");
    assert!(
        records.lines().any(|line| line == record),
        "{record} not among Redis keys:\n{records}"
    );
    assert_eq!(
        redis.cli(&["HGET", &record, "response_status"]).trim(),
        "200"
    );

    // A restarted catalog replays from Redis; the catalog's own state is still in SQLite.
    assert!(server.terminate(), "exit status after SIGTERM");
    let restarted = Server::start(dir.path(), &["--idempotency-store", &store]);
    let again = post(
        &client,
        restarted.url("/v1/namespaces/db/tables"),
        Some(&key),
        &body,
    )
    .await;
    assert!(
        again.replayed,
        "not replayed after a restart: {}",
        again.body
    );
    assert_eq!(again.json(), first.json());
    assert_eq!(table_names(&client, &restarted, "db").await, ["events"]);
}

/// `--idempotency-store 'redis://…?replica-acks=1&…'`: the catalog's keyed writes wait
/// for the replica, and what the catalog answered is on the replica.
#[tokio::test]
async fn the_store_url_turns_replica_acknowledgement_on_in_the_catalog() {
    let Some(primary) = Redis::start() else {
        return;
    };
    let replica = Redis::replica_of(&primary);
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!(
        "redis://127.0.0.1:{}?replica-acks=1&replica-ack-timeout=2s",
        primary.port
    );
    let server = Server::start(dir.path(), &["--idempotency-store", &store]);
    let client = client();
    create_namespace(&client, &server, "db").await;
    let waits = primary.waits_run();
    let key = key();
    let first = post(
        &client,
        server.url("/v1/namespaces/db/tables"),
        Some(&key),
        &create_table_body("events"),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    // Reserve and finalize, each acknowledged.
    assert!(
        primary.waits_run() >= waits + 2,
        "the keyed request made the primary run {} WAIT(s)",
        primary.waits_run() - waits
    );
    let record = format!("idempotency:{{0::{key}}}");
    assert_eq!(
        replica.cli(&["HGET", &record, "response_status"]).trim(),
        "200",
        "the acknowledged answer is not on the replica"
    );
}

#[test]
fn a_bad_idempotency_store_url_stops_the_catalog_with_what_to_fix() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = Command::new(BINARY)
        .current_dir(dir.path())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--idempotency-store",
            "memcached://127.0.0.1:11211",
        ])
        .output()
        .expect("run iceberg-catalog");
    assert!(!output.status.success());
    let printed = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    assert!(printed.contains("--idempotency-store"), "{printed}");
    assert!(printed.contains("redis://host:port"), "{printed}");

    // A parameter it does not know, or a bad value, is refused, not ignored.
    for (url, expected) in [
        (
            "redis://127.0.0.1:6379?replica-ack=1",
            &["`replica-ack`", "replica-acks"][..],
        ),
        (
            "redis://127.0.0.1:6379?replica-acks=many",
            &["`replica-acks`", "many", "whole number"][..],
        ),
    ] {
        let output = Command::new(BINARY)
            .current_dir(dir.path())
            .args(["--listen", "127.0.0.1:0", "--idempotency-store", url])
            .output()
            .expect("run iceberg-catalog");
        assert!(!output.status.success(), "{url} was accepted");
        let printed = String::from_utf8_lossy(&output.stderr).into_owned()
            + &String::from_utf8_lossy(&output.stdout);
        assert!(printed.contains("--idempotency-store"), "{printed}");
        for part in expected {
            assert!(printed.contains(part), "{part} missing: {printed}");
        }
    }

    let help = Command::new(BINARY).arg("--help").output().expect("--help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--idempotency-store <URL>"), "{help}");
    assert!(help.contains("redis+cluster://"), "{help}");
    assert!(help.contains("replica-acks"), "{help}");
}

// ------------------------------------------------------------------------------------------
// Operating it: Prometheus metrics, and the admin endpoints that inspect and evict records
// ------------------------------------------------------------------------------------------

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Every sample of a Prometheus text scrape, by series (`name{labels}`, labels as the
/// exporter prints them).
fn samples(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn scrape(
    client: &reqwest::Client,
    url: &str,
) -> (String, std::collections::BTreeMap<String, f64>) {
    let response = client.get(url).send().await.expect("scrape /metrics");
    assert_eq!(response.status(), 200);
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    let text = response.text().await.expect("metrics text");
    let parsed = samples(&text);
    (text, parsed)
}

#[tokio::test]
async fn metrics_served_for_prometheus_count_keyed_requests_by_outcome() {
    let dir = tempfile::tempdir().expect("temp dir");
    let metrics_port = free_port();
    let metrics_listen = format!("127.0.0.1:{metrics_port}");
    let server = Server::start(dir.path(), &["--metrics-listen", &metrics_listen]);
    let client = client();
    let metrics_url = format!("http://{metrics_listen}/metrics");
    let (_, before) = scrape(&client, &metrics_url).await;
    let count = |samples: &std::collections::BTreeMap<String, f64>, series: &str| {
        samples.get(series).copied().unwrap_or(0.0)
    };

    // Executed, then replayed (create_namespace retries its key); the key reused with
    // another body; a malformed key; requests without a key, which are not counted.
    let key = key();
    let body = json!({"namespace": ["metered"]});
    let first = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let retry = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
    assert!(retry.replayed);
    let reused = post(
        &client,
        server.url("/v1/namespaces"),
        Some(&key),
        &json!({"namespace": ["other"]}),
    )
    .await;
    assert_eq!(reused.status, 422);
    let malformed = post(&client, server.url("/v1/namespaces"), Some("nope"), &body).await;
    assert_eq!(malformed.status, 400);
    assert_eq!(get(&client, server.url("/v1/namespaces")).await.status, 200);
    let unkeyed = post(
        &client,
        server.url("/v1/namespaces"),
        None,
        &json!({"namespace": ["plain"]}),
    )
    .await;
    assert_eq!(unkeyed.status, 200);

    let (text, after) = scrape(&client, &metrics_url).await;
    let moved = |series: &str| count(&after, series) - count(&before, series);
    assert_eq!(
        moved(r#"idempotency_requests_total{idempotency_outcome="executed"}"#),
        1.0,
        "{text}"
    );
    assert_eq!(
        moved(r#"idempotency_requests_total{idempotency_outcome="replayed"}"#),
        1.0,
        "{text}"
    );
    assert_eq!(
        moved(
            r#"idempotency_requests_total{idempotency_outcome="rejected",idempotency_rejection="key-reused"}"#
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        moved(
            r#"idempotency_requests_total{idempotency_outcome="rejected",idempotency_rejection="invalid-key"}"#
        ),
        1.0,
        "{text}"
    );
    let requests: f64 = after
        .iter()
        .filter(|(series, _)| series.starts_with("idempotency_requests_total{"))
        .map(|(_, value)| value)
        .sum();
    assert_eq!(requests, 4.0, "nothing else was counted: {text}");
    // Three reservations reached the store (executed, replayed, reused), and no finalize:
    // the catalog wrote the answer in the change's own transaction.
    assert_eq!(
        moved(
            r#"idempotency_store_duration_seconds_count{idempotency_operation="reserve",idempotency_store_result="ok"}"#
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        moved(
            r#"idempotency_store_duration_seconds_count{idempotency_operation="finalize",idempotency_store_result="ok"}"#
        ),
        0.0,
        "{text}"
    );
    assert!(
        text.contains("# TYPE idempotency_requests_total counter"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE idempotency_store_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains("# HELP idempotency_requests_total "),
        "{text}"
    );
    // Prometheus' naming conventions: every counter ends in `_total`, every duration
    // carries its unit.
    for line in text
        .lines()
        .filter(|line| line.starts_with("# TYPE idempotency_"))
    {
        let name = line.split(' ').nth(2).unwrap();
        match line.rsplit(' ').next() {
            Some("counter") => assert!(name.ends_with("_total"), "{line}"),
            Some("histogram") => assert!(name.ends_with("_seconds"), "{line}"),
            _ => {}
        }
    }
    // No key, path or namespace in any label.
    for secret in [key.as_str(), "/v1/", "metered"] {
        assert!(!text.contains(secret), "{secret:?} in the metrics:\n{text}");
    }

    // Without --admin-token the admin endpoints are off, and say how to turn them on.
    let off = get(
        &client,
        server.url(&format!("/admin/idempotency/records/{key}")),
    )
    .await;
    assert_eq!(off.status, 404, "{}", off.body);
    assert!(off.body.contains("--admin-token"), "{}", off.body);
}

const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

async fn admin(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
) -> (u16, Option<String>, Value) {
    let mut request = client.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("admin request");
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.json().await.expect("admin answers are JSON");
    (status, challenge, body)
}

fn parse_time(value: &Value) -> chrono::DateTime<chrono::FixedOffset> {
    chrono::DateTime::parse_from_rfc3339(value.as_str().expect("an RFC 3339 time"))
        .expect("an RFC 3339 time")
}

#[tokio::test]
async fn admin_endpoints_inspect_and_evict_records_behind_a_token() {
    use idempotency_core::{Binding, IdempotencyStore, RecordId, Reservation};
    use sha2::Digest as _;

    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &["--admin-token", ADMIN_TOKEN]);
    let client = client();
    let record_url = |key: &str| server.url(&format!("/admin/idempotency/records/{key}"));

    // A keyed createNamespace, stored.
    let key = key();
    let body = json!({"namespace": ["admin_db"], "properties": {"owner": "alice"}});
    let first = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
    assert_eq!(first.status, 200, "{}", first.body);

    // No token, a wrong token: 401, saying what to send.
    let (status, challenge, answer) =
        admin(&client, reqwest::Method::GET, record_url(&key), None).await;
    assert_eq!(status, 401, "{answer}");
    assert_eq!(
        challenge.as_deref(),
        Some("Bearer realm=\"idempotency-admin\"")
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Bearer")
    );
    let (status, _, answer) = admin(
        &client,
        reqwest::Method::DELETE,
        record_url(&key),
        Some("not-the-token-at-all-0000"),
    )
    .await;
    assert_eq!(status, 401, "{answer}");

    // Inspect, with the key in capitals as a client log might show it.
    let (status, _, record) = admin(
        &client,
        reqwest::Method::GET,
        record_url(&key.to_uppercase()),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{record}");
    assert_eq!(record["scope"], json!(""));
    assert_eq!(record["key"], json!(key));
    assert_eq!(record["state"], json!("completed"));
    assert_eq!(record["status"], json!(200));
    assert_eq!(record["binding"]["method"], json!("POST"));
    assert_eq!(record["binding"]["path"], json!("/v1/namespaces"));
    let body_sha256: String = sha2::Sha256::digest(body.to_string().as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(record["binding"]["body_sha256"], json!(body_sha256));
    let (created, expires, inspected) = (
        parse_time(&record["created_at"]),
        parse_time(&record["expires_at"]),
        parse_time(&record["inspected_at"]),
    );
    assert!(created <= inspected && inspected < expires, "{record}");
    assert_eq!(
        (expires - created).num_seconds(),
        30 * 60,
        "the default lifetime"
    );
    // Never the stored answer.
    let shown = record.to_string();
    assert!(
        !shown.contains("alice") && !shown.contains("properties"),
        "{shown}"
    );

    // Evict it: the key runs again (and now conflicts, the namespace exists).
    let (status, _, evicted) = admin(
        &client,
        reqwest::Method::DELETE,
        record_url(&key),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{evicted}");
    assert_eq!(evicted["evicted"], json!(true));
    assert_eq!(evicted["record"]["state"], json!("completed"));
    let (status, _, gone) = admin(
        &client,
        reqwest::Method::GET,
        record_url(&key),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 404, "{gone}");
    let again = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
    assert!(!again.replayed, "an evicted key runs again");
    assert_eq!(again.status, 409, "{}", again.body);
    assert_eq!(again.error_type(), "AlreadyExistsException");

    // A request in flight, as a stuck owner leaves it: reserved in the catalog's own
    // database with a long lease, through the store API.
    let database = dir.path().join("iceberg-catalog.db");
    let store = idempotency_store_sql::SqliteStore::connect(
        &format!("sqlite:{}", database.display()),
        &idempotency_store_sql::PoolSettings::default(),
    )
    .await
    .expect("open the catalog's SQLite file");
    let binding = Binding {
        method: "POST".into(),
        path: "/v1/namespaces".into(),
        body_sha256: [7; 32],
    };
    let stuck = self::key();
    let reserved = store
        .reserve(
            &RecordId::new("", stuck.clone()),
            &binding,
            Duration::from_secs(600),
            Duration::from_secs(1800),
        )
        .await
        .expect("reserve");
    assert!(matches!(reserved, Reservation::Reserved(_)));
    let (status, _, refused) = admin(
        &client,
        reqwest::Method::DELETE,
        record_url(&stuck),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["type"], json!("RecordInFlight"));
    let why = refused["error"]["message"].as_str().unwrap();
    assert!(
        why.contains("running now") && why.contains("?force=true"),
        "{why}"
    );
    assert_eq!(refused["record"]["state"], json!("in-flight"));
    assert_eq!(refused["record"]["lease_lapsed"], json!(false));
    let (status, _, still) = admin(
        &client,
        reqwest::Method::GET,
        record_url(&stuck),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(
        (status, &still["state"]),
        (200, &json!("in-flight")),
        "{still}"
    );
    let (status, _, bad_force) = admin(
        &client,
        reqwest::Method::DELETE,
        format!("{}?force=yes", record_url(&stuck)),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 400, "{bad_force}");
    let (status, _, forced) = admin(
        &client,
        reqwest::Method::DELETE,
        format!("{}?force=true", record_url(&stuck)),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{forced}");
    assert_eq!(forced["record"]["state"], json!("in-flight"));
    assert!(
        store
            .load(&RecordId::new("", stuck.clone()))
            .await
            .unwrap()
            .is_none()
    );

    // A named scope, percent-encoded in the path; scopes never see each other's records.
    let scope = "tenant a/b%";
    let scoped = self::key();
    store
        .reserve(
            &RecordId::new(scope, scoped.clone()),
            &binding,
            Duration::from_secs(600),
            Duration::from_secs(1800),
        )
        .await
        .expect("reserve");
    let (status, _, found) = admin(
        &client,
        reqwest::Method::GET,
        server.url(&format!(
            "/admin/idempotency/scopes/tenant%20a%2Fb%25/records/{scoped}"
        )),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{found}");
    assert_eq!(found["scope"], json!(scope));
    let (status, _, other_scope) = admin(
        &client,
        reqwest::Method::GET,
        record_url(&scoped),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 404, "{other_scope}");

    // Not a key this catalog stores.
    let (status, _, bad) = admin(
        &client,
        reqwest::Method::GET,
        record_url("not-a-uuid"),
        Some(ADMIN_TOKEN),
    )
    .await;
    assert_eq!(status, 400, "{bad}");

    // The log tells what was evicted by its hash, never the keys.
    let log = server.log_text();
    assert!(log.contains("evicted an idempotency record"), "{log}");
    for secret in [&key, &key.to_uppercase(), &stuck, &scoped] {
        assert!(!log.contains(secret.as_str()), "a key in the log:\n{log}");
    }
}

#[test]
fn a_short_admin_token_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = Command::new(BINARY)
        .current_dir(dir.path())
        .args(["--listen", "127.0.0.1:0", "--admin-token", "short"])
        .output()
        .expect("run iceberg-catalog");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("at least 16 characters"),
        "stderr: {stderr}\nstdout: {}",
        String::from_utf8_lossy(&output.stdout)
    );
}

// ------------------------------------------------------------------------------------------
// Answers that carry table metadata, stored as a pointer to their metadata file
// ------------------------------------------------------------------------------------------

/// An `add-snapshot` commit (and the `main` branch moved to it) for snapshot `id`, whose
/// parent is `id - 1`: each adds a snapshot and a snapshot-log entry to the table.
fn add_snapshot(id: i64) -> Value {
    let now_ms = chrono::Utc::now().timestamp_millis();
    json!({
        "requirements": [],
        "updates": [
            {"action": "add-snapshot", "snapshot": {
                "snapshot-id": id,
                "parent-snapshot-id": if id > 1 { json!(id - 1) } else { Value::Null },
                "sequence-number": id,
                "timestamp-ms": now_ms,
                "manifest-list": format!("file:///nowhere/snap-{id}.avro"),
                "summary": {"operation": "append", "added-records": "1", "total-records": id.to_string()},
                "schema-id": 0
            }},
            {"action": "set-snapshot-ref", "ref-name": "main", "type": "branch", "snapshot-id": id}
        ]
    })
}

/// Creates `namespace.table` and commits `snapshots` snapshots to it, unkeyed.
async fn grown_table(
    client: &reqwest::Client,
    server: &Server,
    namespace: &str,
    table: &str,
    snapshots: i64,
) {
    let url = server.url(&format!("/v1/namespaces/{namespace}/tables"));
    let created = post(client, url, None, &create_table_body(table)).await;
    assert_eq!(created.status, 200, "{}", created.body);
    let table_url = server.url(&format!("/v1/namespaces/{namespace}/tables/{table}"));
    for id in 1..=snapshots {
        let committed = post(client, table_url.clone(), None, &add_snapshot(id)).await;
        assert_eq!(committed.status, 200, "snapshot {id}: {}", committed.body);
    }
}

/// The bytes of stored answers (body and headers) in the catalog's SQLite file.
async fn stored_answer_bytes(database: &Path) -> i64 {
    use sqlx::Connection as _;
    let url = format!("sqlite:{}", database.display());
    let mut connection = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("open the catalog's SQLite file");
    let total: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(LENGTH(response_body) + LENGTH(response_headers)), 0) \
         FROM idempotency_records",
    )
    .fetch_one(&mut connection)
    .await
    .expect("sum the stored answers");
    total
}

/// A local path for a `file://` location.
fn local_path(location: &str) -> PathBuf {
    PathBuf::from(
        location
            .strip_prefix("file://")
            .expect("a file:// location"),
    )
}

#[tokio::test]
async fn commits_to_a_table_of_hundreds_of_snapshots_are_stored_small_and_replayed_byte_for_byte() {
    let dir = tempfile::tempdir().expect("temp dir");
    let database = dir.path().join("iceberg-catalog.db");
    let client = client();
    let table_url = |server: &Server| server.url("/v1/namespaces/big/tables/events");
    let mut server = Server::start(dir.path(), &[]);
    create_namespace(&client, &server, "big").await;
    grown_table(&client, &server, "big", "events", 300).await;

    // A keyed commit: its answer carries every snapshot, its record does not.
    let before = stored_answer_bytes(&database).await;
    let commit = sent_and_replayed(
        &client,
        reqwest::Method::POST,
        table_url(&server),
        Some(&add_snapshot(301)),
    )
    .await;
    assert_eq!(commit.status, 200, "{}", commit.body);
    assert_eq!(
        commit.json()["metadata"]["snapshots"]
            .as_array()
            .map(Vec::len),
        Some(301)
    );
    assert!(commit.body.len() > 80_000, "{} bytes", commit.body.len());
    let stored = stored_answer_bytes(&database).await - before;
    assert!(
        (1..=2048).contains(&stored),
        "a {} byte answer stored in {stored} bytes",
        commit.body.len()
    );
    assert!(
        server.log_text().contains("stored as a pointer"),
        "the catalog says how it stores them"
    );

    // Registering the table's file under another name: answered with the file's own
    // JSON, stored as a pointer to it, replayed byte for byte.
    let location = commit.json()["metadata-location"].clone();
    let before = stored_answer_bytes(&database).await;
    let registered = sent_and_replayed(
        &client,
        reqwest::Method::POST,
        server.url("/v1/namespaces/big/register"),
        Some(&json!({"name": "events_copy", "metadata-location": location})),
    )
    .await;
    assert_eq!(registered.status, 200, "{}", registered.body);
    let file = fs::read_to_string(local_path(location.as_str().unwrap())).expect("the file");
    assert!(registered.body.contains(file.trim()));
    assert!((1..=2048).contains(&(stored_answer_bytes(&database).await - before)));

    // The same commit stored whole, as without a metadata reader: the record holds the
    // whole answer (what the pointer saves).
    assert!(server.terminate(), "stopped cleanly");
    let server = Server::start(dir.path(), &["--store-whole-metadata"]);
    let before = stored_answer_bytes(&database).await;
    let whole = sent_and_replayed(
        &client,
        reqwest::Method::POST,
        table_url(&server),
        Some(&add_snapshot(302)),
    )
    .await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    let stored = stored_answer_bytes(&database).await - before;
    assert!(stored >= whole.body.len() as i64, "{stored} bytes stored");
    assert!(
        server.log_text().contains("stored whole"),
        "the layer says so at its first request"
    );
}

/// What the admin endpoint says of a record.
async fn inspected(client: &reqwest::Client, server: &Server, key: &str) -> Value {
    let url = server.url(&format!("/admin/idempotency/records/{key}"));
    let (status, _, record) = admin(client, reqwest::Method::GET, url, Some(ADMIN_TOKEN)).await;
    assert_eq!(status, 200, "{record}");
    record
}

#[tokio::test]
async fn a_retry_whose_metadata_file_is_unreadable_or_gone_is_told_the_state_is_unknown() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = Server::start(dir.path(), &["--admin-token", ADMIN_TOKEN]);
    let client = client();
    create_namespace(&client, &server, "lost").await;
    grown_table(&client, &server, "lost", "events", 3).await;
    let url = server.url("/v1/namespaces/lost/tables/events");
    let key = key();
    let commit = add_snapshot(4);
    let first = post(&client, url.clone(), Some(&key), &commit).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let file = local_path(first.json()["metadata-location"].as_str().unwrap());
    let metadata_dir = file.parent().unwrap().to_owned();
    let unknown_state = |retry: &Answer| {
        assert_eq!(retry.status, 503, "{}", retry.body);
        assert_eq!(retry.error_type(), "CommitStateUnknownException");
        assert!(retry.body.contains("already ran"), "{}", retry.body);
    };

    // Storage down: the metadata directory is unreachable (a file stands in its place).
    let away = dir.path().join("metadata-away");
    fs::rename(&metadata_dir, &away).expect("move the metadata away");
    fs::write(&metadata_dir, b"not a directory").expect("block the path");
    let retry = post(&client, url.clone(), Some(&key), &commit).await;
    unknown_state(&retry);
    let response = client
        .post(url.clone())
        .header("Idempotency-Key", &key)
        .header("content-type", "application/json")
        .body(commit.to_string())
        .send()
        .await
        .expect("retry");
    assert_eq!(response.status(), 503);
    assert!(response.headers().contains_key("retry-after"));
    // The record itself is intact: an operator sees a request that ran and succeeded.
    let record = inspected(&client, &server, &key).await;
    assert_eq!(record["state"], json!("completed"), "{record}");
    assert_eq!(record["status"], json!(200), "{record}");

    // Storage back: the retry gets the first answer, byte for byte.
    fs::remove_file(&metadata_dir).expect("unblock the path");
    fs::rename(&away, &metadata_dir).expect("move the metadata back");
    let retry = post(&client, url.clone(), Some(&key), &commit).await;
    assert!(retry.replayed);
    assert_eq!((retry.status, &retry.body), (200, &first.body));

    // The file deleted (remove_orphan_files, a purge): never a success or a failure.
    fs::remove_file(&file).expect("delete the metadata file");
    let retry = post(&client, url.clone(), Some(&key), &commit).await;
    unknown_state(&retry);
    let record = inspected(&client, &server, &key).await;
    assert_eq!(record["state"], json!("completed"), "{record}");
    assert!(
        server.log_text().contains("replay-unavailable"),
        "{}",
        server.log_text()
    );
}

// ------------------------------------------------------------------------------------------
// A COMMIT whose answer is lost
// ------------------------------------------------------------------------------------------

/// Where the records are kept, beside the catalog's state in a database behind the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecordsKept {
    /// In the same database, reserved in the change's transaction (the default).
    WithTheChange,
    /// In the same database, reserved in a commit of their own (`--two-commit`, in builds
    /// with the `test-hooks` feature).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    InACommitOfTheirOwn,
    /// In Redis.
    InRedis,
}

/// Keyed changes whose `COMMIT` answer the proxy loses (the server commits them) are
/// never run again by their retry, and the change is there once. `first` is the status
/// the first request gets: 200 where the catalog can tell that its change committed
/// (PostgreSQL asks `txid_status`), else 500 `CommitStateUnknownException` — released to
/// the record's judgement when the record is in the same database (the retry replays the
/// committed 200), its key kept reserved when it is not (MySQL with records in Redis:
/// the retry waits for the key, then is told it is in flight, 503).
async fn lost_commit_answers_never_run_a_change_twice(
    wire: commit_proxy::Wire,
    database_url: &str,
    records: RecordsKept,
    first: u16,
) {
    let mut url = reqwest::Url::parse(database_url).expect("database URL");
    let upstream = SocketAddr::from((
        url.host_str()
            .expect("database host")
            .parse::<std::net::IpAddr>()
            .expect("an IP address"),
        url.port().expect("database port"),
    ));
    let proxy = commit_proxy::CommitProxy::start(wire, upstream).await;
    url.set_port(Some(proxy.port())).expect("port");
    let redis = match records {
        RecordsKept::InRedis => match Redis::start() {
            Some(redis) => Some(redis),
            None => return,
        },
        _ => None,
    };
    let store = redis
        .as_ref()
        .map(|redis| format!("redis://127.0.0.1:{}", redis.port));
    let dir = tempfile::tempdir().expect("temp dir");
    let mut args = vec!["--database", url.as_str()];
    match (&records, &store) {
        (RecordsKept::InACommitOfTheirOwn, _) => args.push("--two-commit"),
        (RecordsKept::InRedis, Some(store)) => args.extend(["--idempotency-store", store]),
        _ => {}
    }
    let server = Server::start(dir.path(), &args);
    let client = client();
    let kept_reserved = records == RecordsKept::InRedis && first != 200;
    let check_retry = |retry: &Answer| {
        if kept_reserved {
            assert_eq!(retry.status, 503, "the key stays reserved: {}", retry.body);
            assert!(!retry.replayed, "a 5xx is never replayed");
        } else {
            assert_eq!(
                (retry.status, retry.replayed),
                (200, true),
                "the committed answer, replayed: {}",
                retry.body
            );
        }
    };

    // createNamespace, a few times.
    for round in 0..4 {
        let namespace = unique("lost");
        let key = key();
        let body = json!({"namespace": [namespace]});
        proxy.lose_next_commit_answer();
        let answer = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
        assert_eq!(proxy.lost(), round + 1, "the proxy lost a COMMIT answer");
        assert_eq!(answer.status, first, "first answer: {}", answer.body);
        if first != 200 {
            assert_eq!(answer.error_type(), "CommitStateUnknownException");
        }
        let retry = post(&client, server.url("/v1/namespaces"), Some(&key), &body).await;
        check_retry(&retry);
        let loaded = get(&client, server.url(&format!("/v1/namespaces/{namespace}"))).await;
        assert_eq!(
            loaded.status, 200,
            "the namespace is there: {}",
            loaded.body
        );
    }

    // updateTable: run twice, its requirement would fail (409 CommitFailedException).
    let namespace = create_evolving_table(&client, &server, "lost").await;
    let table_url = server.url(&format!("/v1/namespaces/{namespace}/tables/evolving"));
    let update = add_a_column_to_schema_0();
    let key = key();
    let lost_before = proxy.lost();
    proxy.lose_next_commit_answer();
    let answer = post(&client, table_url.clone(), Some(&key), &update).await;
    assert_eq!(proxy.lost(), lost_before + 1);
    assert_eq!(answer.status, first, "first answer: {}", answer.body);
    let retry = post(&client, table_url.clone(), Some(&key), &update).await;
    check_retry(&retry);
    let loaded = get(&client, table_url).await;
    assert_eq!(loaded.json()["metadata"]["current-schema-id"], json!(1));
    let log = server.log_text();
    if first == 200 {
        assert!(
            log.contains("the database says it committed"),
            "the catalog asked the database:\n{log}"
        );
    }
}

/// [`lost_commit_answers_never_run_a_change_twice`] on the test database `wire` speaks,
/// for each way of keeping the records.
async fn lost_commit_answers_over(wire: commit_proxy::Wire, records: &[RecordsKept], first: u16) {
    let (variable, default) = match wire {
        commit_proxy::Wire::Postgres => (
            "IDEMPOTENCY_TEST_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        ),
        commit_proxy::Wire::MySql => (
            "IDEMPOTENCY_TEST_MYSQL_URL",
            "mysql://root@127.0.0.1:3306/test",
        ),
    };
    let Some(url) = database(variable, default).await else {
        return;
    };
    for records in records {
        lost_commit_answers_never_run_a_change_twice(wire, &url, *records, first).await;
    }
}

// Several threads: the proxy runs on the test's runtime while the test blocks on the
// server's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_answer_over_postgres_with_records_in_redis_is_asked_about() {
    let wire = commit_proxy::Wire::Postgres;
    lost_commit_answers_over(wire, &[RecordsKept::InRedis], 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_answer_over_mysql_with_records_in_redis_keeps_the_key_reserved() {
    let wire = commit_proxy::Wire::MySql;
    lost_commit_answers_over(wire, &[RecordsKept::InRedis], 500).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_answer_with_records_in_the_same_database_is_replayed() {
    #[cfg_attr(not(feature = "test-hooks"), allow(unused_mut))]
    let mut same = vec![RecordsKept::WithTheChange];
    // `--two-commit` is in builds with the `test-hooks` feature only.
    #[cfg(feature = "test-hooks")]
    same.push(RecordsKept::InACommitOfTheirOwn);
    lost_commit_answers_over(commit_proxy::Wire::Postgres, &same, 500).await;
    lost_commit_answers_over(commit_proxy::Wire::MySql, &same, 500).await;
}
