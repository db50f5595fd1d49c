//! `compare [--quick | --smoke] [--only inprocess,http,grpc,sql,redis,redis-acks,scale,client,purge] [--out FILE] …`: runs every
//! comparison of `BENCHMARKS.md` and prints the tables (Markdown).
//!
//! Options:
//! - `--quick`: short runs (about 15–20 minutes in all on 2 cores);
//! - `--smoke`: every table and row once, with tiny runs and sizes (1 s per load run, one
//!   round, 16 connections, 10,000 records, …), figures not worth reading; then checks
//!   that every section produced its tables and rows, that nothing was skipped, that every
//!   figure is there and finite and that no load run saw an error, and exits 1 if not
//!   (what `benches/run.sh --smoke` and CI run);
//! - `--only LIST`: a comma-separated subset of `inprocess`, `http`, `grpc`, `sql`, `redis`,
//!   `redis-acks` (what `replica_acks` costs, on a primary and a replica of the
//!   benchmark's own), `scale`, `client` (the client layer against the bare hyper client), or `purge` (only the default PostgreSQL purge of `scale`, batches of 100, without
//!   its batches-of-1,000 comparison: for trying purge settings and for repeated runs);
//! - `--connections LIST`: HTTP connections and gRPC calls in flight (default `1,16,64`);
//! - `--grpc-connections N`: HTTP/2 connections the gRPC calls are spread over (default:
//!   one per 16 calls in flight, rounded up);
//! - `--seconds N`, `--rounds N`: length of each `wrk` (or `grpc-load`) run and
//!   interleaved rounds;
//! - `--server-threads N`: tokio worker threads of each HTTP or gRPC server (default 1);
//! - `--peer PATH`: the `peer-idempotent` binary (default: its release build);
//! - `--postgres-url`, `--mysql-url`: databases for the SQL benchmarks;
//! - `--redis-url`: the Redis for the Redis benchmarks (default: a `redis-server` of the
//!   benchmark's own on a free port, without persistence, stopped at the end);
//! - `--out FILE`: also write the tables to FILE.

use std::collections::BTreeMap;
use std::path::PathBuf;

use benches::harness::median;
use benches::http_load::{self, Load, LoadResult, Server};
use benches::report::{self, Row, Table, Verdict, micros};
use benches::{client, inprocess, scale};

/// How long everything runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The figures of BENCHMARKS.md.
    Full,
    /// `--quick`: short runs.
    Quick,
    /// `--smoke`: every figure once, tiny, then checked (see the module docs).
    Smoke,
}

impl Mode {
    /// The value for this mode.
    fn pick<T>(self, full: T, quick: T, smoke: T) -> T {
        match self {
            Self::Full => full,
            Self::Quick => quick,
            Self::Smoke => smoke,
        }
    }

    fn name(self) -> &'static str {
        self.pick("full", "quick", "smoke")
    }
}

struct Options {
    mode: Mode,
    sections: Vec<String>,
    connections: Vec<usize>,
    seconds: Option<u64>,
    rounds: Option<usize>,
    server_threads: usize,
    grpc_connections: Option<usize>,
    peer: PathBuf,
    postgres_url: String,
    mysql_url: String,
    redis_url: Option<String>,
    out: Option<PathBuf>,
}

fn options() -> Options {
    let mut o = Options {
        mode: Mode::Full,
        sections: [
            "inprocess",
            "http",
            "grpc",
            "sql",
            "redis",
            "redis-acks",
            "scale",
            "client",
        ]
        .map(str::to_owned)
        .to_vec(),
        connections: vec![1, 16, 64],
        seconds: None,
        rounds: None,
        server_threads: 1,
        grpc_connections: None,
        peer: PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/peer-idempotent/target/release/peer-idempotent"
        )),
        postgres_url: std::env::var("BENCH_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        mysql_url: std::env::var("BENCH_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
        redis_url: std::env::var("BENCH_REDIS_URL").ok(),
        out: None,
    };
    let mut connections_given = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--quick" || arg == "--smoke" {
            o.mode = if arg == "--quick" {
                Mode::Quick
            } else {
                Mode::Smoke
            };
            continue;
        }
        let value = args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        let list = || value.split(',').map(str::trim).map(str::to_owned);
        match arg.as_str() {
            "--only" => o.sections = list().collect(),
            "--connections" => {
                connections_given = true;
                o.connections = list()
                    .map(|c| c.parse().expect("--connections takes numbers"))
                    .collect()
            }
            "--seconds" => o.seconds = Some(value.parse().expect("--seconds takes a number")),
            "--rounds" => o.rounds = Some(value.parse().expect("--rounds takes a number")),
            "--server-threads" => {
                o.server_threads = value.parse().expect("--server-threads takes a number")
            }
            "--grpc-connections" => {
                o.grpc_connections = Some(value.parse().expect("--grpc-connections takes a number"))
            }
            "--peer" => o.peer = PathBuf::from(value),
            "--postgres-url" => o.postgres_url = value,
            "--mysql-url" => o.mysql_url = value,
            "--redis-url" => o.redis_url = Some(value),
            "--out" => o.out = Some(PathBuf::from(value)),
            other => panic!("unknown argument {other}"),
        }
    }
    if o.mode == Mode::Smoke && !connections_given {
        // One level, high enough for the rows judged at 16 connections.
        o.connections = vec![16];
    }
    o
}

/// The client layer against the bare hyper client, both sending keyed POSTs to a keyed
/// benchmark server (the target) and to the bare one (one process each).
fn client_section(o: &Options, rows: &mut Vec<Row>) {
    // Calls per round per call in flight: a round of about 0.15 s at 1 in flight and
    // 0.3 s at 16 (full mode), long enough for a scheduler's hiccup to average out.
    let settings = o.mode.pick(
        inprocess::Settings {
            rounds: 31,
            iters: 1_500,
        },
        inprocess::Settings {
            rounds: 11,
            iters: 500,
        },
        inprocess::Settings::smoke(),
    );
    let threads = o.server_threads.to_string();
    for (server, mode) in [
        (client::Server::Keyed, "memory"),
        (client::Server::Bare, "bare"),
    ] {
        let process = match Server::spawn(
            mode,
            &sibling("bench-server"),
            &["--threads", &threads, "--mode", mode],
        ) {
            Ok(process) => process,
            Err(error) => return rows.push(skipped("client layer", error)),
        };
        let in_flight: &[u64] = match server {
            client::Server::Keyed => &[1, 16],
            client::Server::Bare => &[16],
        };
        for &in_flight in in_flight {
            rows.extend(client::run(settings, server, process.addr, in_flight));
        }
    }
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .expect("current executable")
        .with_file_name(name)
}

fn skipped(name: &str, why: impl Into<String>) -> Row {
    Row {
        name: name.to_owned(),
        measured: why.into(),
        baseline: String::new(),
        ratio: String::new(),
        target: String::new(),
        verdict: Verdict::Skipped,
    }
}

/// Starts a server: name, program, arguments, and the `wrk` modes to drive it with.
type StartServer<'a> = dyn FnMut(&str, &PathBuf, &[&str], &[&'static str]) + 'a;

/// One line of load: which server, which `wrk` mode.
struct Scenario {
    label: String,
    server: usize,
    mode: &'static str,
}

/// Results of one scenario at one concurrency level, one per round, and its ratio to the
/// bare server of the same round.
#[derive(Default)]
struct Samples {
    runs: Vec<LoadResult>,
    vs_bare: Vec<f64>,
}

impl Samples {
    fn med(&self, f: impl Fn(&LoadResult) -> f64) -> f64 {
        median(&mut self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

fn http_section(o: &Options, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    let seconds = o.seconds.unwrap_or(o.mode.pick(2, 2, 1));
    let rounds = o.rounds.unwrap_or(o.mode.pick(5, 1, 1));
    if std::process::Command::new("wrk")
        .arg("--version")
        .output()
        .is_err()
    {
        rows.push(skipped(
            "HTTP on loopback",
            "wrk not found: apt-get install -y wrk",
        ));
        return;
    }
    let script = std::env::temp_dir().join(format!("idempotency-bench-{}.lua", std::process::id()));
    std::fs::write(&script, http_load::WRK_SCRIPT).expect("write the wrk script");
    let server_bin = sibling("bench-server");
    let threads = o.server_threads.to_string();

    if !o.peer.exists() {
        rows.push(skipped(
            "HTTP, idempotent crate (peer)",
            format!(
                "{} not built (cargo build --release --ignore-rust-version in benches/peer-idempotent)",
                o.peer.display()
            ),
        ));
    }
    let mut start_errors = Vec::new();
    let mut servers: Vec<Server> = Vec::new();
    let mut scenarios: Vec<Scenario> = Vec::new();
    let mut start =
        |name: &str, program: &PathBuf, args: &[&str], modes: &[&'static str]| match Server::spawn(
            name, program, args,
        ) {
            Ok(server) => {
                servers.push(server);
                for mode in modes {
                    let what = match *mode {
                        "nokey" => "no key",
                        "fresh" => "first execution",
                        _ => "replay",
                    };
                    scenarios.push(Scenario {
                        label: format!("{name}, {what}"),
                        server: servers.len() - 1,
                        mode,
                    });
                }
            }
            Err(error) => start_errors.push(skipped(&format!("HTTP, {name}"), error)),
        };
    let base = ["--threads", threads.as_str()];
    start(
        "bare",
        &server_bin,
        &[&base[..], &["--mode", "bare"]].concat(),
        &["nokey"],
    );
    // The same bare app in a second process: its ratio to the first is the noise floor.
    start(
        "bare, second server",
        &server_bin,
        &[&base[..], &["--mode", "bare"]].concat(),
        &["nokey"],
    );
    start(
        "ours + memory",
        &server_bin,
        &[&base[..], &["--mode", "memory"]].concat(),
        &["nokey", "fresh", "fixed"],
    );
    if o.peer.exists() {
        start(
            "idempotent 2.0 + memory",
            &o.peer,
            &base,
            &["fresh", "fixed"],
        );
    }
    sql_servers(o, &server_bin, &base, &mut start);
    redis_servers(o, &server_bin, &base, &mut start);
    rows.append(&mut start_errors);

    if servers.first().is_none_or(|s| s.name != "bare") {
        rows.push(skipped("HTTP on loopback", "the bare server did not start"));
        return;
    }
    let fixed_key = format!("k-fixed-{}", std::process::id());
    let mut broken = vec![false; servers.len()];
    // Every layered server (those driven with replays) must execute once, then replay.
    for (i, server) in servers.iter().enumerate() {
        if !scenarios.iter().any(|s| s.server == i && s.mode == "fixed") {
            continue;
        }
        if let Err(error) = http_load::check_replays(server.addr, &fixed_key) {
            rows.push(skipped(&format!("HTTP, {}", server.name), error));
            broken[i] = true;
        }
    }
    scenarios.retain(|s| !broken[s.server]);

    let mut results: BTreeMap<(usize, usize), Samples> = BTreeMap::new();
    let mut invocation = 0u64;
    for &connections in &o.connections {
        let load = Load {
            script: &script,
            connections,
            threads: 1,
            seconds,
        };
        let mut run = |i: usize| -> Option<LoadResult> {
            let s = &scenarios[i];
            invocation += 1;
            let nonce = format!("{}-{invocation}", std::process::id());
            http_load::run_wrk(load, servers[s.server].addr, s.mode, &nonce, &fixed_key)
                .map_err(|error| eprintln!("{}: {error}", s.label))
                .ok()
        };
        for round in 0..rounds {
            eprintln!(
                "http: {connections} connections, round {}/{rounds}",
                round + 1
            );
            // bare, A, bare, B, bare, …: every subject runs between two bare runs, and
            // its ratio is taken against their mean, so slow drifts in the machine's load
            // cancel out.
            let mut order: Vec<usize> = (1..scenarios.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut before = run(0);
            if let Some(bare) = before {
                results.entry((0, connections)).or_default().runs.push(bare);
            }
            for i in order {
                let subject = run(i);
                let after = run(0);
                if let Some(bare) = after {
                    results.entry((0, connections)).or_default().runs.push(bare);
                }
                if let (Some(subject), Some(b), Some(a)) = (subject, before, after) {
                    let samples = results.entry((i, connections)).or_default();
                    samples.vs_bare.push(subject.rps / ((b.rps + a.rps) / 2.0));
                    samples.runs.push(subject);
                }
                before = after;
            }
        }
    }
    let _ = std::fs::remove_file(&script);
    // A scenario none of whose runs completed would otherwise just be missing.
    for (i, s) in scenarios.iter().enumerate() {
        for &c in &o.connections {
            if results
                .get(&(i, c))
                .is_none_or(|samples| samples.runs.is_empty())
            {
                rows.push(skipped(
                    &format!("HTTP, {}, {c} connections", s.label),
                    "no run completed (the errors are above)",
                ));
            }
        }
    }

    let mut detail = Table::new(
        format!(
            "HTTP on loopback (wrk, 1 thread; servers: {} tokio worker thread(s); {seconds} s per run, median of {rounds} round(s); each run's ratio is against the mean of the bare runs just before and after it)",
            o.server_threads
        ),
        &[
            "server, load",
            "connections",
            "req/s",
            "× bare req/s",
            "p50",
            "p99",
            "errors",
        ],
    );
    for (i, s) in scenarios.iter().enumerate() {
        for &c in &o.connections {
            let Some(samples) = results.get(&(i, c)) else {
                continue;
            };
            let errors: u64 = samples
                .runs
                .iter()
                .map(|r| r.non_2xx + r.socket_errors)
                .sum();
            detail.push(vec![
                s.label.clone(),
                c.to_string(),
                format!("{:.0}", samples.med(|r| r.rps)),
                if samples.vs_bare.is_empty() {
                    "1 (baseline)".to_owned()
                } else {
                    format!("{:.3}", median(&mut samples.vs_bare.clone()))
                },
                micros(samples.med(|r| r.p50_us)),
                micros(samples.med(|r| r.p99_us)),
                errors.to_string(),
            ]);
        }
    }
    tables.push(detail);

    // Summary rows: one per target, every concurrency level in it.
    let find = |label: &str| scenarios.iter().position(|s| s.label == label);
    let ratio_per_level = |i: usize, against: Option<usize>| -> Vec<(usize, f64)> {
        o.connections
            .iter()
            .filter_map(|&c| {
                let subject = results.get(&(i, c))?;
                let ratio = match against {
                    None => median(&mut subject.vs_bare.clone()),
                    Some(j) => {
                        let other = results.get(&(j, c))?;
                        // Each normalized by its own neighbouring bare runs.
                        let mut per_round: Vec<f64> = subject
                            .vs_bare
                            .iter()
                            .zip(&other.vs_bare)
                            .map(|(a, b)| a / b)
                            .collect();
                        median(&mut per_round)
                    }
                };
                Some((c, ratio))
            })
            .collect()
    };
    let mut summary_row = |name: &str,
                           subject: Option<usize>,
                           against: Option<usize>,
                           against_name: &str,
                           target: &str,
                           ok: Option<&dyn Fn(f64) -> bool>| {
        let Some(i) = subject else {
            return;
        };
        if against.is_none() && !against_name.starts_with("bare") {
            rows.push(skipped(name, format!("{against_name} did not run")));
            return;
        }
        let levels = ratio_per_level(i, against);
        if levels.is_empty() {
            return;
        }
        let rps = |j: usize| {
            o.connections
                .iter()
                .filter_map(|&c| Some(format!("{:.0}", results.get(&(j, c))?.med(|r| r.rps))))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        rows.push(Row {
            name: format!(
                "{name} (c = {})",
                o.connections
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" / ")
            ),
            measured: format!("{} req/s", rps(i)),
            baseline: format!("{} req/s ({against_name})", rps(against.unwrap_or(0))),
            ratio: levels
                .iter()
                .map(|(_, r)| format!("{r:.3}×"))
                .collect::<Vec<_>>()
                .join(" / "),
            target: target.to_owned(),
            verdict: match ok {
                Some(ok) => Verdict::from_bool(levels.iter().all(|(_, r)| ok(*r))),
                None => Verdict::Info,
            },
        });
    };
    summary_row(
        "HTTP noise floor: the same bare app in a second process",
        find("bare, second server, no key"),
        None,
        "bare",
        "",
        None,
    );
    let ours_nokey = find("ours + memory, no key");
    let ours_fresh = find("ours + memory, first execution");
    let ours_replay = find("ours + memory, replay");
    let peer_fresh = find("idempotent 2.0 + memory, first execution");
    let peer_replay = find("idempotent 2.0 + memory, replay");
    summary_row(
        "HTTP, no key (ours + memory)",
        ours_nokey,
        None,
        "bare",
        "costs < 1% (≥ 0.99×)",
        Some(&|r| r >= 0.99),
    );
    summary_row(
        "HTTP, first execution (ours + memory)",
        ours_fresh,
        None,
        "bare",
        "≥ 0.90×",
        Some(&|r| r >= 0.90),
    );
    summary_row(
        "HTTP, replay (ours + memory) vs the bare trivial handler",
        ours_replay,
        None,
        "bare",
        "replay faster than the handler (> 1×)",
        Some(&|r| r > 1.0),
    );
    summary_row(
        "HTTP, first execution: ours vs idempotent 2.0 (both memory)",
        ours_fresh,
        peer_fresh,
        "idempotent 2.0",
        "ahead of the peer (> 1×)",
        Some(&|r| r > 1.0),
    );
    summary_row(
        "HTTP, replay: ours vs idempotent 2.0 (both memory)",
        ours_replay,
        peer_replay,
        "idempotent 2.0",
        "ahead of the peer (> 1×)",
        Some(&|r| r > 1.0),
    );
    summary_row(
        "HTTP, first execution: ours vs idempotent 2.0 (both on one Redis)",
        find("ours + Redis, first execution"),
        find("idempotent 2.0 + Valkey store, first execution"),
        "idempotent 2.0",
        "ahead of the peer (> 1×)",
        Some(&|r| r > 1.0),
    );
    summary_row(
        "HTTP, replay: ours vs idempotent 2.0 (both on one Redis)",
        find("ours + Redis, replay"),
        find("idempotent 2.0 + Valkey store, replay"),
        "idempotent 2.0",
        "ahead of the peer (> 1×)",
        Some(&|r| r > 1.0),
    );
    for label in ["ours + SQLite", "ours + PostgreSQL", "ours + Redis"] {
        for what in ["first execution", "replay"] {
            summary_row(
                &format!("HTTP, {what} ({label})"),
                find(&format!("{label}, {what}")),
                None,
                "bare",
                "",
                None,
            );
        }
    }
    sqlite_concurrency(
        o,
        &results,
        find("ours + SQLite, first execution"),
        find(&format!("{SQLITE_RAW}, first execution")),
        rows,
        tables,
    );
    drop(servers);
}

/// The SQLite store's first executions under concurrency (targets: p99 ≤ 5× p50, and at
/// 16 connections at least the raw one-writer throughput): their p99 against their p50,
/// and their throughput against the same two statements issued raw through one writer
/// connection (`bench-server --mode sqlite-raw`) in the same run.
fn sqlite_concurrency(
    o: &Options,
    results: &BTreeMap<(usize, usize), Samples>,
    store: Option<usize>,
    raw: Option<usize>,
    rows: &mut Vec<Row>,
    tables: &mut Vec<Table>,
) {
    let Some(store) = store else {
        return;
    };
    // The median over rounds of each run's own p99 / p50.
    let tail = |samples: &Samples| {
        median(
            &mut samples
                .runs
                .iter()
                .map(|r| r.p99_us / r.p50_us)
                .collect::<Vec<_>>(),
        )
    };
    let mut table = Table::new(
        "SQLite, first execution under concurrency: the store against its two statements raw through one writer connection (`sqlite-raw`), same run (medians over rounds; p99/p50 is the median of each run's own ratio; store / raw is the median of the per-round ratios, each side against its neighbouring bare runs)",
        &[
            "connections",
            "store req/s",
            "store p50",
            "store p99",
            "store p99/p50",
            "raw req/s",
            "raw p50",
            "raw p99",
            "raw p99/p50",
            "store / raw req/s",
        ],
    );
    let mut tails = Vec::new();
    let mut versus = Vec::new();
    for &c in &o.connections {
        let Some(s) = results.get(&(store, c)) else {
            continue;
        };
        let r = raw.and_then(|raw| results.get(&(raw, c)));
        let ratio = r.map(|r| {
            median(
                &mut s
                    .vs_bare
                    .iter()
                    .zip(&r.vs_bare)
                    .map(|(a, b)| a / b)
                    .collect::<Vec<_>>(),
            )
        });
        tails.push((c, tail(s), s.med(|x| x.p50_us), s.med(|x| x.p99_us)));
        if let (Some(ratio), Some(r)) = (ratio, r) {
            versus.push((c, ratio, s.med(|x| x.rps), r.med(|x| x.rps)));
        }
        let na = || "–".to_owned();
        table.push(vec![
            c.to_string(),
            format!("{:.0}", s.med(|x| x.rps)),
            micros(s.med(|x| x.p50_us)),
            micros(s.med(|x| x.p99_us)),
            format!("{:.1}×", tail(s)),
            r.map_or_else(na, |r| format!("{:.0}", r.med(|x| x.rps))),
            r.map_or_else(na, |r| micros(r.med(|x| x.p50_us))),
            r.map_or_else(na, |r| micros(r.med(|x| x.p99_us))),
            r.map_or_else(na, |r| format!("{:.1}×", tail(r))),
            ratio.map_or_else(na, |x| format!("{x:.3}×")),
        ]);
    }
    tables.push(table);
    let levels = |v: &[usize]| {
        v.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let judged: Vec<_> = tails.iter().filter(|t| t.0 >= 16).collect();
    if !judged.is_empty() {
        rows.push(Row {
            name: format!(
                "HTTP, first execution (ours + SQLite): p99 within 5× its p50 (c = {})",
                levels(&judged.iter().map(|t| t.0).collect::<Vec<_>>())
            ),
            measured: judged
                .iter()
                .map(|t| format!("p99 {}", micros(t.3)))
                .collect::<Vec<_>>()
                .join(" / "),
            baseline: judged
                .iter()
                .map(|t| format!("p50 {}", micros(t.2)))
                .collect::<Vec<_>>()
                .join(" / "),
            ratio: judged
                .iter()
                .map(|t| format!("{:.1}×", t.1))
                .collect::<Vec<_>>()
                .join(" / "),
            target: "≤ 5× p50".to_owned(),
            verdict: Verdict::from_bool(judged.iter().all(|t| t.1 <= 5.0)),
        });
    }
    if versus.is_empty() {
        rows.push(skipped(
            "HTTP, first execution (ours + SQLite) vs its statements raw through one writer",
            "sqlite-raw did not run",
        ));
        return;
    }
    let at16 = versus.iter().find(|v| v.0 == 16);
    rows.push(Row {
        name: format!(
            "HTTP, first execution (ours + SQLite) vs the same 2 statements raw through one writer connection (c = {})",
            levels(&versus.iter().map(|v| v.0).collect::<Vec<_>>())
        ),
        measured: format!(
            "{} req/s",
            versus
                .iter()
                .map(|v| format!("{:.0}", v.2))
                .collect::<Vec<_>>()
                .join(" / ")
        ),
        baseline: format!(
            "{} req/s (sqlite-raw)",
            versus
                .iter()
                .map(|v| format!("{:.0}", v.3))
                .collect::<Vec<_>>()
                .join(" / ")
        ),
        ratio: versus
            .iter()
            .map(|v| format!("{:.3}×", v.1))
            .collect::<Vec<_>>()
            .join(" / "),
        target: "≥ 1× at 16 connections".to_owned(),
        verdict: at16.map_or(Verdict::Info, |v| Verdict::from_bool(v.1 >= 1.0)),
    });
}

#[cfg(feature = "sql")]
fn sql_servers(o: &Options, server_bin: &PathBuf, base: &[&str], start: &mut StartServer<'_>) {
    let sqlite_path = std::env::temp_dir().join(format!(
        "idempotency-bench-http-{}.sqlite",
        std::process::id()
    ));
    let sqlite_url = format!("sqlite://{}?mode=rwc", sqlite_path.display());
    start(
        "ours + SQLite",
        server_bin,
        &[base, &["--mode", "sqlite", "--database-url", &sqlite_url]].concat(),
        &["fresh", "fixed"],
    );
    // The SQLite store's baseline: its two statements raw through one writer connection,
    // on a file of its own with the same pragmas.
    let raw_path = std::env::temp_dir().join(format!(
        "idempotency-bench-http-raw-{}.sqlite",
        std::process::id()
    ));
    let raw_url = format!("sqlite://{}?mode=rwc", raw_path.display());
    start(
        SQLITE_RAW,
        server_bin,
        &[base, &["--mode", "sqlite-raw", "--database-url", &raw_url]].concat(),
        &["fresh"],
    );
    start(
        "ours + PostgreSQL",
        server_bin,
        &[
            base,
            &["--mode", "postgres", "--database-url", &o.postgres_url],
        ]
        .concat(),
        &["fresh", "fixed"],
    );
}

/// The name of the `sqlite-raw` server in the HTTP tables.
const SQLITE_RAW: &str = "SQLite raw, one writer connection";

#[cfg(not(feature = "sql"))]
fn sql_servers(_: &Options, _: &PathBuf, _: &[&str], _: &mut StartServer<'_>) {}

#[cfg(feature = "redis")]
fn redis_servers(o: &Options, server_bin: &PathBuf, base: &[&str], start: &mut StartServer<'_>) {
    let Some(url) = o.redis_url.as_deref() else {
        return;
    };
    start(
        "ours + Redis",
        server_bin,
        &[base, &["--mode", "redis", "--database-url", url]].concat(),
        &["fresh", "fixed"],
    );
    if o.peer.exists() {
        start(
            "idempotent 2.0 + Valkey store",
            &o.peer,
            // A port of its own: the memory peer already holds the default one.
            &[base, &["--valkey", url, "--listen", "127.0.0.1:0"]].concat(),
            &["fresh", "fixed"],
        );
    }
}

#[cfg(not(feature = "redis"))]
fn redis_servers(_: &Options, _: &PathBuf, _: &[&str], _: &mut StartServer<'_>) {}

#[cfg(feature = "redis")]
fn redis_section(o: &Options, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    let settings = o.mode.pick(
        benches::redis_store::Settings::full(),
        benches::redis_store::Settings::quick(),
        benches::redis_store::Settings::smoke(),
    );
    match o.redis_url.as_deref() {
        Some(url) => benches::redis_store::run(settings, url, rows, tables),
        None => rows.push(skipped("Redis store", "no Redis to run against")),
    }
}

#[cfg(not(feature = "redis"))]
fn redis_section(_: &Options, rows: &mut Vec<Row>, _: &mut Vec<Table>) {
    rows.push(skipped(
        "Redis store",
        "built without the `redis` feature (benches/run.sh turns it on)",
    ));
}

#[cfg(feature = "redis")]
fn redis_acks_section(o: &Options, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    let settings = benches::redis_acks::Settings {
        connections: o.connections.clone(),
        seconds: o.seconds.unwrap_or(o.mode.pick(2, 2, 1)),
        rounds: o.rounds.unwrap_or(o.mode.pick(5, 1, 1)),
        server_threads: o.server_threads,
    };
    benches::redis_acks::run(&settings, &sibling("bench-server"), rows, tables);
}

#[cfg(not(feature = "redis"))]
fn redis_acks_section(_: &Options, rows: &mut Vec<Row>, _: &mut Vec<Table>) {
    rows.push(skipped(
        "Redis replica_acks",
        "built without the `redis` feature (benches/run.sh turns it on)",
    ));
}

#[cfg(feature = "sql")]
fn sql_section(o: &Options, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    benches::sql::run(
        sql_settings(o.mode),
        &o.postgres_url,
        &o.mysql_url,
        rows,
        tables,
    );
}

#[cfg(feature = "sql")]
fn sql_settings(mode: Mode) -> benches::sql::Settings {
    mode.pick(
        benches::sql::Settings::full(),
        benches::sql::Settings::quick(),
        benches::sql::Settings::smoke(),
    )
}

#[cfg(not(feature = "sql"))]
fn sql_section(_: &Options, rows: &mut Vec<Row>, _: &mut Vec<Table>) {
    rows.push(skipped(
        "SQL stores",
        "built without the `sql` feature (benches/run.sh turns it on)",
    ));
}

/// One gRPC run: what the load generator measured, and the server's CPU time per call.
#[derive(Clone, Copy)]
struct GrpcRun {
    load: LoadResult,
    /// Server CPU time (all its threads) per completed call, in microseconds; NaN where
    /// it cannot be read.
    cpu_us: f64,
}

/// Results of one gRPC scenario at one concurrency level: its runs, and per run its
/// throughput and CPU per call against the bare server's runs just before and after it.
#[derive(Default)]
struct GrpcSamples {
    runs: Vec<GrpcRun>,
    vs_bare: Vec<f64>,
    cpu_vs_bare: Vec<f64>,
}

impl GrpcSamples {
    fn med(&self, f: impl Fn(&GrpcRun) -> f64) -> f64 {
        median(&mut self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

/// One concurrency level of a gRPC summary row (medians over rounds).
struct GrpcLevel {
    rps: f64,
    bare_rps: f64,
    /// Calls/s against the neighbouring bare runs.
    ratio: f64,
    /// Server CPU per call against the neighbouring bare runs.
    cpu_ratio: f64,
}

fn grpc_section(o: &Options, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    use benches::grpc::{self, KeyMode, LoadSettings};
    let seconds = o.seconds.unwrap_or(o.mode.pick(2, 2, 1));
    let rounds = o.rounds.unwrap_or(o.mode.pick(5, 1, 1));
    let server_bin = sibling("grpc-server");
    let load_bin = sibling("grpc-load");
    let threads = o.server_threads.to_string();
    let spawn = |name: &str, mode: &str| {
        Server::spawn(
            name,
            &server_bin,
            &["--threads", threads.as_str(), "--mode", mode],
        )
    };
    // 0: bare tonic; 1: the same again (the noise floor); 2: the layer + memory store.
    let servers = match (
        spawn("bare tonic", "bare"),
        spawn("bare tonic, second server", "bare"),
        spawn("ours + memory", "memory"),
    ) {
        (Ok(a), Ok(b), Ok(c)) => [a, b, c],
        (a, b, c) => {
            for error in [a.err(), b.err(), c.err()].into_iter().flatten() {
                rows.push(skipped("gRPC on loopback", error));
            }
            return;
        }
    };
    let fixed_key = format!("k-fixed-{}", std::process::id());
    for (i, server) in servers.iter().enumerate() {
        if let Err(error) = grpc::check_replays(server.addr, &fixed_key, i == 2) {
            rows.push(skipped(&format!("gRPC, {}", server.name), error));
            return;
        }
    }
    // Every subject is compared with the bare server driven by the same load: the same
    // calls, the same metadata (bare tonic ignores `idempotency-key`), so that the ratio
    // is the layer's cost alone.
    let scenarios: [(&str, usize, KeyMode); 4] = [
        ("bare tonic, second server, no key", 1, KeyMode::None),
        ("ours + memory, no key", 2, KeyMode::None),
        ("ours + memory, first execution", 2, KeyMode::Fresh),
        ("ours + memory, replay", 2, KeyMode::Fixed),
    ];
    let modes = [KeyMode::None, KeyMode::Fresh, KeyMode::Fixed];
    let mode_index = |mode: KeyMode| modes.iter().position(|m| *m == mode).expect("a mode");
    let mode_name = |mode: KeyMode| match mode {
        KeyMode::None => "no key",
        KeyMode::Fresh => "fresh keys",
        KeyMode::Fixed => "one key",
    };

    // Keys: (scenario, concurrency) for subjects; (100 + mode, concurrency) for bare.
    let mut results: BTreeMap<(usize, usize), GrpcSamples> = BTreeMap::new();
    let mut invocation = 0u64;
    for &concurrency in &o.connections {
        let connections = o
            .grpc_connections
            .unwrap_or(concurrency.div_ceil(16))
            .clamp(1, concurrency.max(1));
        let mut run = |server: &Server, mode: KeyMode| -> Option<GrpcRun> {
            invocation += 1;
            let settings = LoadSettings {
                concurrency,
                connections,
                duration: std::time::Duration::from_secs(seconds),
                mode,
                nonce: format!("{}-{invocation}", std::process::id()),
                fixed_key: fixed_key.clone(),
            };
            let cpu_before = grpc::cpu_ns(server.pid());
            let load = grpc::run_load(&load_bin, server.addr, &settings)
                .map_err(|error| eprintln!("gRPC, {}: {error}", server.name))
                .ok()?;
            let cpu_us = match (cpu_before, grpc::cpu_ns(server.pid())) {
                (Some(a), Some(b)) => (b - a) as f64 / 1e3 / load.requests.max(1) as f64,
                _ => f64::NAN,
            };
            Some(GrpcRun { load, cpu_us })
        };
        for round in 0..rounds {
            eprintln!(
                "grpc: {concurrency} calls in flight over {connections} connection(s), round {}/{rounds}",
                round + 1
            );
            // bare, A, bare, B, …, the bare runs in the load of the subject next to them;
            // every subject's ratio is against the mean of the bare runs just before and
            // after it.
            let mut order: Vec<usize> = (0..scenarios.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut before: Option<(KeyMode, GrpcRun)> = None;
            for i in order {
                let (_, server, mode) = scenarios[i];
                let b = match before {
                    Some((m, run)) if m == mode => Some(run),
                    _ => {
                        let bare = run(&servers[0], mode);
                        if let Some(bare) = bare {
                            let key = (100 + mode_index(mode), concurrency);
                            results.entry(key).or_default().runs.push(bare);
                        }
                        bare
                    }
                };
                let subject = run(&servers[server], mode);
                let after = run(&servers[0], mode);
                if let Some(bare) = after {
                    let key = (100 + mode_index(mode), concurrency);
                    results.entry(key).or_default().runs.push(bare);
                }
                if let (Some(subject), Some(b), Some(a)) = (subject, b, after) {
                    let samples = results.entry((i, concurrency)).or_default();
                    samples
                        .vs_bare
                        .push(subject.load.rps / ((b.load.rps + a.load.rps) / 2.0));
                    samples
                        .cpu_vs_bare
                        .push(subject.cpu_us / ((b.cpu_us + a.cpu_us) / 2.0));
                    samples.runs.push(subject);
                }
                before = after.map(|bare| (mode, bare));
            }
        }
    }
    drop(servers);
    // A scenario none of whose runs completed would otherwise just be missing.
    for &c in &o.connections {
        let subjects = scenarios
            .iter()
            .enumerate()
            .map(|(i, (label, _, _))| ((*label).to_owned(), i));
        let bare = modes.iter().map(|m| {
            (
                format!("bare tonic, {}", mode_name(*m)),
                100 + mode_index(*m),
            )
        });
        for (label, i) in subjects.chain(bare) {
            if results
                .get(&(i, c))
                .is_none_or(|samples| samples.runs.is_empty())
            {
                rows.push(skipped(
                    &format!("gRPC, {label}, {c} calls in flight"),
                    "no run completed (the errors are above)",
                ));
            }
        }
    }

    let mut detail = Table::new(
        format!(
            "gRPC on loopback (tonic; grpc-load, 1 thread; servers: {} tokio worker thread(s); {seconds} s per run, median of {rounds} round(s); each run's ratios are against the mean of the bare runs, same load, just before and after it)",
            o.server_threads
        ),
        &[
            "server, load",
            "calls in flight (connections)",
            "calls/s",
            "× bare calls/s",
            "server CPU/call",
            "× bare CPU/call",
            "p50",
            "p99",
            "errors",
        ],
    );
    let connections_of = |c: usize| {
        o.grpc_connections
            .unwrap_or(c.div_ceil(16))
            .clamp(1, c.max(1))
    };
    let mut push = |label: String, c: usize, samples: &GrpcSamples| {
        let errors: u64 = samples.runs.iter().map(|r| r.load.non_2xx).sum();
        let ratio = |v: &[f64]| {
            if v.is_empty() {
                "1 (baseline)".to_owned()
            } else {
                format!("{:.3}", median(&mut v.to_vec()))
            }
        };
        detail.push(vec![
            label,
            format!("{c} ({})", connections_of(c)),
            format!("{:.0}", samples.med(|r| r.load.rps)),
            ratio(&samples.vs_bare),
            micros(samples.med(|r| r.cpu_us)),
            ratio(&samples.cpu_vs_bare),
            micros(samples.med(|r| r.load.p50_us)),
            micros(samples.med(|r| r.load.p99_us)),
            errors.to_string(),
        ]);
    };
    for (m, mode) in modes.iter().enumerate() {
        for &c in &o.connections {
            if let Some(samples) = results.get(&(100 + m, c)) {
                push(format!("bare tonic, {}", mode_name(*mode)), c, samples);
            }
        }
    }
    for (i, (label, _, _)) in scenarios.iter().enumerate() {
        for &c in &o.connections {
            if let Some(samples) = results.get(&(i, c)) {
                push((*label).to_owned(), c, samples);
            }
        }
    }
    tables.push(detail);

    let levels = o
        .connections
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" / ");
    let mut summary_row = |name: &str, i: usize, target: &str, ok: Option<&dyn Fn(f64) -> bool>| {
        let mode = scenarios[i].2;
        let per_level: Vec<GrpcLevel> = o
            .connections
            .iter()
            .filter_map(|&c| {
                let subject = results.get(&(i, c))?;
                let bare = results.get(&(100 + mode_index(mode), c))?;
                Some(GrpcLevel {
                    rps: subject.med(|r| r.load.rps),
                    bare_rps: bare.med(|r| r.load.rps),
                    ratio: median(&mut subject.vs_bare.clone()),
                    cpu_ratio: median(&mut subject.cpu_vs_bare.clone()),
                })
            })
            .collect();
        if per_level.is_empty() {
            return;
        }
        let join = |f: &dyn Fn(&GrpcLevel) -> String| {
            per_level.iter().map(f).collect::<Vec<_>>().join(" / ")
        };
        rows.push(Row {
            name: format!("{name} (calls in flight = {levels})"),
            measured: format!("{} calls/s", join(&|l| format!("{:.0}", l.rps))),
            baseline: format!(
                "{} calls/s (bare tonic, {})",
                join(&|l| format!("{:.0}", l.bare_rps)),
                mode_name(mode)
            ),
            ratio: format!(
                "{} (server CPU per call: {} bare's)",
                join(&|l| format!("{:.3}×", l.ratio)),
                join(&|l| format!("{:.2}×", l.cpu_ratio))
            ),
            target: target.to_owned(),
            verdict: match ok {
                Some(ok) => Verdict::from_bool(per_level.iter().all(|l| ok(l.ratio))),
                None => Verdict::Info,
            },
        });
    };
    summary_row(
        "gRPC noise floor: the same bare tonic server in a second process",
        0,
        "",
        None,
    );
    summary_row(
        "gRPC, no key (ours + memory)",
        1,
        "costs < 1% (≥ 0.99×)",
        Some(&|r| r >= 0.99),
    );
    summary_row(
        "gRPC, keyed unary call, first execution (ours + memory)",
        2,
        "≥ 0.90×",
        Some(&|r| r >= 0.90),
    );
    summary_row(
        "gRPC, keyed unary call, replay (ours + memory)",
        3,
        "≥ 0.90×",
        Some(&|r| r >= 0.90),
    );
}

fn date() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn main() {
    // Only the Redis part sets the URL of the Redis it starts.
    #[cfg_attr(not(feature = "redis"), allow(unused_mut))]
    let mut o = options();
    let mut rows = Vec::new();
    let mut tables = Vec::new();
    let wants = |o: &Options, s: &str| o.sections.iter().any(|x| x == s);
    // One Redis for both sides of every Redis comparison: ours and the peer's, same run.
    #[cfg(feature = "redis")]
    let _own_redis = if o.redis_url.is_none() && (wants(&o, "http") || wants(&o, "redis")) {
        match benches::redis_store::BenchRedis::start() {
            Ok(redis) => {
                o.redis_url = Some(redis.url.clone());
                Some(redis)
            }
            Err(error) => {
                rows.push(skipped("Redis", error));
                None
            }
        }
    } else {
        None
    };
    let o = o;
    let wants = |s: &str| wants(&o, s);
    // What each section added, for the smoke check.
    let mut ran: Vec<Ran> = Vec::new();
    let mut section = |name: &'static str,
                       rows: &mut Vec<Row>,
                       tables: &mut Vec<Table>,
                       run: &mut dyn FnMut(&mut Vec<Row>, &mut Vec<Table>)| {
        let (r, t) = (rows.len(), tables.len());
        run(rows, tables);
        ran.push(Ran {
            section: name,
            rows: r..rows.len(),
            tables: t..tables.len(),
        });
    };
    if wants("inprocess") {
        eprintln!("in-process layer overhead…");
        let settings = o.mode.pick(
            inprocess::Settings::full(),
            inprocess::Settings::quick(),
            inprocess::Settings::smoke(),
        );
        section("inprocess", &mut rows, &mut tables, &mut |rows, _| {
            rows.extend(inprocess::run(settings))
        });
    }
    if wants("http") {
        eprintln!("HTTP on loopback…");
        section("http", &mut rows, &mut tables, &mut |rows, tables| {
            http_section(&o, rows, tables)
        });
    }
    if wants("grpc") {
        eprintln!("gRPC on loopback…");
        section("grpc", &mut rows, &mut tables, &mut |rows, tables| {
            grpc_section(&o, rows, tables)
        });
    }
    if wants("sql") {
        eprintln!("SQL stores…");
        section("sql", &mut rows, &mut tables, &mut |rows, tables| {
            sql_section(&o, rows, tables)
        });
    }
    if wants("redis") {
        eprintln!("Redis store…");
        section("redis", &mut rows, &mut tables, &mut |rows, tables| {
            redis_section(&o, rows, tables)
        });
    }
    if wants("redis-acks") {
        eprintln!("Redis store with replica acknowledgements…");
        section("redis-acks", &mut rows, &mut tables, &mut |rows, tables| {
            redis_acks_section(&o, rows, tables)
        });
    }
    if wants("scale") {
        eprintln!("memory store scale…");
        let records = o.mode.pick(1_000_000, 1_000_000, 10_000);
        let requests = o.mode.pick(10_000, 10_000, 1_000);
        section("scale", &mut rows, &mut tables, &mut |rows, _| {
            rows.extend(scale::run(&sibling("mem-scale"), records, requests))
        });
    }
    if wants("client") {
        eprintln!("client layer…");
        section("client", &mut rows, &mut tables, &mut |rows, _| {
            client_section(&o, rows)
        });
    }
    if wants("scale") || wants("purge") {
        eprintln!("purge of expired PostgreSQL rows…");
        section("purge", &mut rows, &mut tables, &mut |_rows, _| {
            #[cfg(feature = "sql")]
            _rows.extend(benches::sql::purge_scale(
                &o.postgres_url,
                sql_settings(o.mode),
                wants("scale"),
            ));
        });
    }

    let mut out = format!(
        "## Results ({}, {} mode, {} cores)\n\n",
        date(),
        o.mode.name(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    out.push_str(&report::summary("Summary against the targets", &rows).to_markdown());
    for table in &tables {
        out.push('\n');
        out.push_str(&table.to_markdown());
    }
    println!("{out}");
    if let Some(path) = &o.out {
        std::fs::write(path, &out).expect("write --out");
    }
    if o.mode == Mode::Smoke {
        let problems = smoke_problems(&ran, &rows, &tables);
        if !problems.is_empty() {
            eprintln!("\nsmoke: {} problem(s):", problems.len());
            for problem in &problems {
                eprintln!("  - {problem}");
            }
            std::process::exit(1);
        }
        eprintln!(
            "smoke: ok ({} sections, {} rows, {} tables; every figure present and finite)",
            ran.len(),
            rows.len(),
            tables.len()
        );
    }
}

/// What one section added to the rows and tables.
struct Ran {
    section: &'static str,
    rows: std::ops::Range<usize>,
    tables: std::ops::Range<usize>,
}

/// The tables each section produces, by the start of their titles.
fn expected_tables(section: &str) -> &'static [&'static str] {
    match section {
        "http" => &[
            "HTTP on loopback",
            "SQLite, first execution under concurrency",
        ],
        "grpc" => &["gRPC on loopback"],
        "sql" => &["SQL stores: one operation at a time"],
        "redis" => &["Redis store: one operation at a time"],
        "redis-acks" => &["Redis store on a primary with one replica"],
        _ => &[],
    }
}

/// Whether every number written in `text` is finite (Rust writes `NaN` and `inf`).
fn finite(text: &str) -> bool {
    !text
        .split(|c: char| !c.is_alphanumeric())
        .any(|word| word == "NaN" || word == "inf")
}

/// What `--smoke` fails on: a section that produced nothing or lacks one of its tables,
/// a skipped row (a service, a binary or a run that failed), a figure that is missing or
/// not finite, a table without rows, and a load run that saw errors.
fn smoke_problems(ran: &[Ran], rows: &[Row], tables: &[Table]) -> Vec<String> {
    let mut problems = Vec::new();
    for r in ran {
        if r.rows.is_empty() && r.tables.is_empty() {
            problems.push(format!("{}: no rows and no tables", r.section));
        }
        for title in expected_tables(r.section) {
            if !tables[r.tables.clone()]
                .iter()
                .any(|t| t.title.starts_with(title))
            {
                problems.push(format!("{}: no table \"{title}…\"", r.section));
            }
        }
    }
    for row in rows {
        if row.verdict == Verdict::Skipped {
            problems.push(format!("skipped: {}: {}", row.name, row.measured));
        } else if row.measured.is_empty() {
            problems.push(format!("{}: no figure", row.name));
        } else if ![&row.measured, &row.baseline, &row.ratio]
            .iter()
            .all(|figure| finite(figure))
        {
            problems.push(format!(
                "{}: a figure is not finite: {} | {} | {}",
                row.name, row.measured, row.baseline, row.ratio
            ));
        }
    }
    for table in tables {
        if table.rows.is_empty() {
            problems.push(format!("table \"{}\": no rows", table.title));
        }
        let errors = table.columns.iter().position(|c| c == "errors");
        for cells in &table.rows {
            let bad: Vec<&String> = cells
                .iter()
                .filter(|cell| cell.is_empty() || *cell == "–" || !finite(cell))
                .collect();
            if cells.len() != table.columns.len() || !bad.is_empty() {
                problems.push(format!(
                    "table \"{}\": a figure is missing or not finite: {}",
                    table.title,
                    cells.join(" | ")
                ));
            }
            if let Some(i) = errors
                && cells.get(i).is_some_and(|errors| errors != "0")
            {
                problems.push(format!(
                    "table \"{}\": runs with errors: {}",
                    table.title,
                    cells.join(" | ")
                ));
            }
        }
    }
    problems
}
