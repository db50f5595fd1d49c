//! The Iceberg Java client (`RESTCatalog` of iceberg-core 1.12.0, the first client that
//! sends `Idempotency-Key`) against the `iceberg-catalog` binary, with lost answers.
//!
//! `examples/java-client` is a small Maven project: `CatalogCheck` drives the real client
//! through `FaultProxy`, a fault-injecting HTTP proxy on loopback, and checks every
//! operation's effect through a second client that talks to the catalog directly. Each
//! operation (create a namespace, two tables, append data files, add a column, a
//! multi-table transaction, rename, create/register/replace/drop a view, drop a table) runs
//! under four scenarios: no fault; (a) the catalog commits and the answer is dropped with
//! the connection; (b) the proxy answers 503 for a request the catalog never sees; (c) the
//! catalog takes 3 s (it is started with `ICEBERG_CATALOG_TEST_DELAYS=1` and the proxy asks
//! for the delay on the first attempt only) and the proxy answers 504 after 0.5 s, so the
//! client's retry arrives while the first attempt still runs.
//!
//! In the scenarios that lose an answer after the commit, (a) and (c), the first table is
//! grown to a few hundred snapshots before the operations on it, so that their answers
//! (and the replays of the lost ones, read back from their metadata files) carry a large
//! table's metadata; on SQLite the test checks
//! that no stored answer is over 2 KiB.
//!
//! With the layer (SQLite and PostgreSQL) no error surfaces, every effect lands exactly
//! once, the client deletes none of its files, every mutation carries a UUIDv7 key and the
//! catalog logs the retries as `replayed`. The control runs start the catalog with
//! `--no-idempotency`; the test asserts that they lose something and prints the counts.
//!
//! Maven downloads iceberg-core and its dependencies into `~/.m2` on the first run. Under
//! `CI=true` a missing `mvn` or `java`, or an unreachable PostgreSQL, is a failure;
//! elsewhere the test says why and returns early.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BINARY: &str = env!("CARGO_BIN_EXE_iceberg-catalog");

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Gives up on a prerequisite: a failure under CI, a note and an early return elsewhere.
fn unavailable(what: &str) {
    if in_ci() {
        panic!("{what} (CI=true: this is a failure, not a skip)");
    }
    eprintln!("SKIPPED: {what}");
}

/// A running `iceberg-catalog`; killed on drop, its log printed if the test failed.
struct Catalog {
    child: Child,
    uri: String,
    log: PathBuf,
}

impl Catalog {
    fn start(dir: &Path, args: &[&str]) -> Self {
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
                .env("ICEBERG_CATALOG_TEST_DELAYS", "1")
                .stdout(out.try_clone().expect("log file"))
                .stderr(out)
                .spawn()
                .expect("start iceberg-catalog");
            let mut catalog = Self {
                child,
                uri: format!("http://127.0.0.1:{port}"),
                log,
            };
            let address = SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = catalog.child.try_wait() {
                    break;
                }
                if TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() {
                    return catalog;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            eprintln!(
                "iceberg-catalog did not start (attempt {attempt}):\n{}",
                catalog.log_text()
            );
        }
        panic!("iceberg-catalog did not start");
    }

    fn log_text(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = fs::File::open(&self.log) {
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    /// How many access-log lines end in `idempotency=OUTCOME`.
    fn outcomes(&self, outcome: &str) -> usize {
        let needle = format!(" idempotency={outcome} ");
        self.log_text()
            .lines()
            .filter(|line| line.contains(&needle))
            .count()
    }
}

impl Drop for Catalog {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- log of {} ----\n{}", self.uri, self.log_text());
        }
    }
}

/// The Java program's class path: compiles `examples/java-client` with Maven (once per
/// test binary; the first run downloads iceberg-core 1.12.0 from Maven Central into
/// `~/.m2`). `None` outside CI when `mvn` or `java` is missing.
fn java_client_classpath() -> Option<String> {
    static BUILT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    maven_classpath(&BUILT, "java-client", "java.client.build")
}

/// The class path of `SparkCheck`: `examples/java-client/spark` (Spark 3.5.8 and
/// iceberg-spark-runtime-3.5_2.12 1.12.0 from Maven Central, about 320 MB in `~/.m2` on
/// the first run) with the Java client's sources.
fn spark_check_classpath() -> Option<String> {
    static BUILT: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    maven_classpath(&BUILT, "java-client/spark", "spark.check.build")
}

/// Compiles the Maven project in `examples/<project>` into `target/tmp/<project>` (once
/// per test binary) and returns its class path.
fn maven_classpath(
    built: &std::sync::Mutex<Option<String>>,
    project: &str,
    build_property: &str,
) -> Option<String> {
    // One Maven at a time: both projects download the same plugins into `~/.m2` on a
    // cold machine, and Maven 3.8 does not lock its local repository.
    static MAVEN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = MAVEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut built = built
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(classpath) = built.as_ref() {
        return Some(classpath.clone());
    }
    if let Err(e) = Command::new("java").arg("-version").output() {
        unavailable(&format!("java (17 or later) is needed: {e}"));
        return None;
    }
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join(project);
    let build = Path::new(env!("CARGO_TARGET_TMPDIR")).join(project);
    let dependencies = build.join("classpath.txt");
    let started = Instant::now();
    let output = Command::new("mvn")
        .current_dir(&directory)
        .args(["-q", "-B", "compile", "dependency:build-classpath"])
        .arg(format!("-D{build_property}={}", build.display()))
        .arg(format!("-Dmdep.outputFile={}", dependencies.display()))
        .stdin(Stdio::null())
        .output();
    let output = match output {
        Ok(output) => output,
        Err(e) => {
            unavailable(&format!(
                "mvn (Maven 3) is needed to build examples/java-client: {e}"
            ));
            return None;
        }
    };
    assert!(
        output.status.success(),
        "mvn failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!(
        "examples/{project} built in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let classpath = format!(
        "{}:{}",
        build.join("classes").display(),
        fs::read_to_string(&dependencies)
            .expect("classpath.txt")
            .trim()
    );
    *built = Some(classpath.clone());
    Some(classpath)
}

/// What one run of `CatalogCheck` printed.
struct Run {
    stdout: String,
    summary: BTreeMap<String, String>,
}

impl Run {
    fn count(&self, field: &str) -> usize {
        self.summary
            .get(field)
            .unwrap_or_else(|| panic!("no {field} in the summary:\n{}", self.stdout))
            .parse()
            .expect("a count")
    }

    /// The `OP` lines, each as its `name=value` fields.
    fn operations(&self) -> Vec<BTreeMap<String, String>> {
        self.stdout
            .lines()
            .filter_map(|line| line.strip_prefix("OP "))
            .map(fields)
            .collect()
    }
}

fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|field| field.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

/// Runs `CatalogCheck` against `catalog` in `mode` (`layer`, `control`,
/// `control-advertised`).
fn run_java_client(classpath: &str, catalog: &Catalog, mode: &str, run: &str) -> Run {
    run_java_client_with(classpath, catalog, mode, run, &[])
}

/// [`run_java_client`] with more options for `CatalogCheck`.
fn run_java_client_with(
    classpath: &str,
    catalog: &Catalog,
    mode: &str,
    run: &str,
    options: &[&str],
) -> Run {
    let started = Instant::now();
    let output = Command::new("java")
        .arg("-cp")
        .arg(classpath)
        .arg("dev.idempotency.CatalogCheck")
        .args(["--catalog", &catalog.uri, "--run", run, "--mode", mode])
        .args(options)
        .stdin(Stdio::null())
        .output()
        .expect("run java");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    println!(
        "---- CatalogCheck --mode {mode} ({:.1} s) ----\n{stdout}",
        started.elapsed().as_secs_f64()
    );
    let summary = stdout
        .lines()
        .find_map(|line| line.strip_prefix("SUMMARY "))
        .map(fields)
        .unwrap_or_else(|| {
            panic!(
                "CatalogCheck printed no summary ({}):\n{stdout}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        });
    if mode == "layer" {
        assert!(
            output.status.success(),
            "CatalogCheck failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Run { stdout, summary }
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    format!("{prefix}_{}_{}", std::process::id(), nanos % 1_000_000_000)
}

/// Snapshots the Java tests grow their first table by before the operations on it, so
/// that those operations (and their lost answers' replays) carry a large table's metadata.
const GROWN_SNAPSHOTS: usize = 300;

/// Every operation under every fault, through the layer, on a table grown to a few
/// hundred snapshots where an answer is lost after the commit: nothing surfaces, every effect lands once, no file is deleted, every
/// mutation is keyed (UUIDv7), and the catalog executed each key once and replayed the
/// retries. Returns the catalog's directory.
fn the_java_client_never_sees_a_lost_answer(database: &str) -> Option<tempfile::TempDir> {
    let classpath = java_client_classpath()?;
    let dir = tempfile::tempdir().expect("temp dir");
    let catalog = Catalog::start(dir.path(), &["--database", database]);
    let run = run_java_client_with(
        &classpath,
        &catalog,
        "layer",
        &unique("java"),
        &["--grow", &GROWN_SNAPSHOTS.to_string()],
    );

    let operations = run.operations();
    assert_eq!(operations.len(), run.count("operations"));
    assert_eq!(
        operations.len(),
        4 * 12,
        "12 operations under each of 4 scenarios"
    );
    for operation in &operations {
        assert_eq!(operation["error"], "none", "{operation:?}");
        assert_eq!(operation["effect"], "ok", "{operation:?}");
        assert_eq!(
            operation["keys"], "uuidv7",
            "every mutation of an operation carries one UUIDv7 key, on the retry too: {operation:?}"
        );
    }
    assert_eq!(run.count("errors"), 0);
    assert_eq!(run.count("wrong_effects"), 0);
    assert_eq!(run.count("deleted_files"), 0);
    assert_eq!(run.count("unkeyed_mutations"), 0);
    assert_eq!(run.count("faults_not_used"), 0);

    // Every operation's key was executed once: 12 per scenario, 4 scenarios, less the 12
    // the proxy answered 503 itself (the catalog never saw those first attempts; their
    // retries executed), besides the commits that grew the tables (keyed too: the
    // observer that made them is a Java client). The lost answers (a) and the slow
    // commits (c) were replayed.
    let executed = catalog.outcomes("executed");
    let replayed = catalog.outcomes("replayed");
    println!("catalog outcomes: executed={executed} replayed={replayed}");
    assert_eq!(
        executed,
        4 * 12 + 2 * GROWN_SNAPSHOTS,
        "one execution per operation and growing commit"
    );
    assert_eq!(
        catalog.outcomes("executed") + catalog.outcomes("replayed"),
        catalog.log_text().matches(" idempotency=").count() - catalog.outcomes("passed-through"),
        "no keyed request was rejected"
    );
    assert!(
        replayed >= 2 * 12,
        "each retry after a lost answer (a) or a gateway timeout (c) is replayed: {replayed}"
    );
    Some(dir)
}

#[tokio::test(flavor = "multi_thread")]
async fn java_client_on_sqlite_never_sees_a_lost_answer() {
    let Some(dir) = tokio::task::spawn_blocking(|| {
        the_java_client_never_sees_a_lost_answer("sqlite://catalog.db?mode=rwc")
    })
    .await
    .expect("the Java run") else {
        return;
    };
    // The answers about the grown tables carried hundreds of snapshots; their records
    // hold a pointer to the metadata file instead.
    use sqlx::Connection as _;
    let url = format!("sqlite:{}", dir.path().join("catalog.db").display());
    let mut records = sqlx::SqliteConnection::connect(&url)
        .await
        .expect("open the catalog's SQLite file");
    let largest: i64 = sqlx::query_scalar(
        "SELECT MAX(LENGTH(response_body) + LENGTH(response_headers)) FROM idempotency_records",
    )
    .fetch_one(&mut records)
    .await
    .expect("the largest stored answer");
    assert!(
        (1..=2048).contains(&largest),
        "the largest stored answer is {largest} bytes"
    );
}

/// A commit whose answer is lost and whose metadata file is gone before the client's
/// retry (a purge, `remove_orphan_files`, storage down): the catalog cannot rebuild the
/// answer from the file and answers 503 `CommitStateUnknownException`; iceberg-core
/// resends it and then reports the commit's state as unknown, neither a success nor a
/// failure, and deletes none of its files; the commit landed once.
#[test]
fn a_commit_whose_metadata_file_is_gone_before_the_retry_is_reported_as_state_unknown() {
    let Some(classpath) = java_client_classpath() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let catalog = Catalog::start(dir.path(), &["--database", "sqlite://catalog.db?mode=rwc"]);
    let run = run_java_client_with(
        &classpath,
        &catalog,
        "gone",
        &unique("gone"),
        &["--grow", "20"],
    );
    assert_eq!(
        run.summary["error"], "CommitStateUnknownException",
        "{}",
        run.stdout
    );
    assert_eq!(run.summary["property"], "1", "the commit landed");
    assert_eq!(run.count("commits"), 1, "once");
    assert_eq!(run.count("deleted_files"), 0);
    // The first attempt committed (its answer dropped); every retry was told 503.
    let statuses: Vec<&str> = run.summary["catalog/client"].split(',').collect();
    assert_eq!(statuses[0], "200/0", "{statuses:?}");
    assert!(
        statuses.len() >= 2 && statuses[1..].iter().all(|s| *s == "503/503"),
        "{statuses:?}"
    );
    assert!(catalog.log_text().contains("replay-unavailable"));
}

/// A fresh PostgreSQL database for this run (dropped at the end), or `None` outside CI
/// when the server is unreachable.
struct PostgresDatabase {
    admin_url: String,
    name: String,
}

impl PostgresDatabase {
    fn create() -> Option<Self> {
        let admin_url = std::env::var("TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let name = unique("java_client");
        let created = Self::execute(&admin_url, &format!("CREATE DATABASE {name}"));
        match created {
            Ok(()) => Some(Self { admin_url, name }),
            Err(e) => {
                unavailable(&format!("PostgreSQL at {admin_url} is unreachable: {e}"));
                None
            }
        }
    }

    fn url(&self) -> String {
        let base = self
            .admin_url
            .rsplit_once('/')
            .map_or(self.admin_url.as_str(), |(base, _)| base);
        format!("{base}/{}", self.name)
    }

    fn execute(url: &str, statement: &str) -> Result<(), sqlx::Error> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            sqlx::any::install_default_drivers();
            let pool = sqlx::any::AnyPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(5))
                .connect(url)
                .await?;
            let result = sqlx::query(statement).execute(&pool).await;
            pool.close().await;
            result.map(|_| ())
        })
    }
}

impl Drop for PostgresDatabase {
    fn drop(&mut self) {
        let _ = Self::execute(
            &self.admin_url,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

#[test]
fn java_client_on_postgres_never_sees_a_lost_answer() {
    let Some(database) = PostgresDatabase::create() else {
        return;
    };
    the_java_client_never_sees_a_lost_answer(&database.url());
}

/// What the layer cannot help with: iceberg-core 1.12.0 does not retry a request that hit
/// its own socket timeout (`rest.client.socket-timeout-ms`; `SocketTimeoutException` is
/// an `InterruptedIOException`, which its retry strategy never retries), so a commit
/// slower than that timeout surfaces as `RESTException` (not even
/// `CommitStateUnknownException`) although the catalog commits it, and no retry with the
/// key ever arrives. If a later client retries its timeouts, this test fails and the
/// README's advice (a socket timeout above the slowest commit) can change.
#[test]
fn a_client_socket_timeout_is_not_retried_by_iceberg_core_1_12() {
    let Some(classpath) = java_client_classpath() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let catalog = Catalog::start(dir.path(), &["--database", "sqlite://catalog.db?mode=rwc"]);
    let run = run_java_client_with(
        &classpath,
        &catalog,
        "control",
        &unique("timeout"),
        &["--scenarios", "SLOW", "--socket-timeout-ms", "1000"],
    );
    println!("SOCKET TIMEOUT (layer on) {:?}", run.summary);
    let operations = run.operations();
    assert_eq!(operations.len(), 12);
    for operation in &operations {
        assert_eq!(
            operation["error"], "RESTException",
            "the client gives up at its socket timeout, without a retry: {operation:?}"
        );
    }
    assert_eq!(
        catalog.outcomes("replayed"),
        0,
        "no retry with the same key reached the catalog"
    );
}

/// The control: the same run against the catalog without the layer. The client then
/// sends no keys (nothing is advertised) and does not retry its POSTs, so the faults
/// surface as exceptions; the program retries a failed operation once, as an application
/// would, and a lost answer's retry then fails or runs twice.
#[test]
fn without_the_layer_the_same_faults_surface_and_retries_run_twice() {
    let Some(classpath) = java_client_classpath() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let catalog = Catalog::start(
        dir.path(),
        &[
            "--database",
            "sqlite://catalog.db?mode=rwc",
            "--no-idempotency",
        ],
    );
    let run = run_java_client(&classpath, &catalog, "control", &unique("control"));
    println!("CONTROL (no layer, no keys) {:?}", run.summary);
    assert_eq!(
        run.count("keyed_requests"),
        0,
        "nothing advertised, no keys"
    );
    assert!(
        run.count("errors") > 0,
        "the faults surface without the layer"
    );
    assert!(
        run.count("wrong_effects") > 0,
        "an application's retry of a lost answer fails or runs twice"
    );
    assert_eq!(catalog.outcomes("executed"), 0);
    assert_eq!(catalog.outcomes("replayed"), 0);
}

/// The control with keys: the proxy advertises a key lifetime that the catalog (without
/// the layer) does not honour, so the client keys its mutations and retries them on its
/// own, and the catalog runs each retry again: a retried commit finds its own change and
/// fails with 409, and the client deletes files that the committed snapshot needs.
#[test]
fn keys_sent_to_a_catalog_without_the_layer_run_twice() {
    let Some(classpath) = java_client_classpath() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let catalog = Catalog::start(
        dir.path(),
        &[
            "--database",
            "sqlite://catalog.db?mode=rwc",
            "--no-idempotency",
        ],
    );
    let run = run_java_client(
        &classpath,
        &catalog,
        "control-advertised",
        &unique("advertised"),
    );
    println!("CONTROL (no layer, keys sent) {:?}", run.summary);
    assert!(run.count("keyed_requests") > 0, "the client sent keys");
    assert!(
        run.count("errors") + run.count("wrong_effects") > 0,
        "retries that run twice surface or leave wrong effects"
    );
}

/// What Spark 3.5 needs opened on Java 17 (what `spark-submit` adds itself).
const SPARK_JAVA_OPTIONS: &[&str] = &[
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.invoke=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/java.net=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/java.util=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.cs=ALL-UNNAMED",
    "--add-opens=java.base/sun.security.action=ALL-UNNAMED",
    "--add-opens=java.base/sun.util.calendar=ALL-UNNAMED",
    "-Djdk.reflect.useDirectMethodHandle=false",
];

/// Spark SQL (3.5.8, local mode, iceberg-spark-runtime 1.12.0) through the proxy, with
/// the answer of every write's commit dropped after the catalog committed it: `CREATE
/// NAMESPACE`, `CREATE TABLE`, `INSERT`, `ALTER TABLE … ADD COLUMN`, `INSERT`, `DELETE`,
/// `MERGE` all succeed on a table grown to a few hundred snapshots right after its
/// creation, and the counts (rows, snapshots, history, metadata log) show each write
/// landed once.
#[test]
fn spark_sql_writes_land_once_when_every_commit_answer_is_lost() {
    let Some(classpath) = spark_check_classpath() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let catalog = Catalog::start(dir.path(), &["--database", "sqlite://catalog.db?mode=rwc"]);
    let started = Instant::now();
    let output = Command::new("java")
        .args(SPARK_JAVA_OPTIONS)
        .arg("-cp")
        .arg(&classpath)
        .arg("dev.idempotency.SparkCheck")
        .args(["--catalog", &catalog.uri, "--namespace", &unique("spark")])
        .args(["--fault", "DROP_ANSWER"])
        .args(["--grow", &GROWN_SNAPSHOTS.to_string()])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("run java");
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!(
        "---- SparkCheck ({:.1} s) ----\n{stdout}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        output.status.success(),
        "SparkCheck failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = stdout
        .lines()
        .find_map(|line| line.strip_prefix("SPARK_SUMMARY "))
        .map(fields)
        .expect("a SPARK_SUMMARY line");
    let count = |field: &str| -> usize { summary[field].parse().expect("a count") };
    assert_eq!(count("statements"), 7);
    assert_eq!(count("errors"), 0);
    assert_eq!(count("wrong"), 0);
    assert_eq!(count("deleted_files"), 0);
    assert_eq!(count("unkeyed_mutations"), 0);
    assert_eq!(
        stdout
            .lines()
            .filter(|line| line.starts_with("CHECK "))
            .count(),
        10,
        "every count was checked"
    );
    // Each write's key executed once; each lost answer's retry was replayed. (The commits
    // that grew the table were keyed too: a Java client made them.)
    assert_eq!(catalog.outcomes("executed"), 7 + GROWN_SNAPSHOTS);
    assert_eq!(catalog.outcomes("replayed"), 7);
}
