//! What `replica_acks` costs a keyed request over HTTP: the Redis store on a primary with
//! one replica (two `redis-server` processes of the benchmark's own on loopback), driven
//! by `wrk` with a fresh key per request, without acknowledgements and with
//! `replica-acks=1&replica-ack-timeout=250ms` in the store's URL, in alternating runs.
//!
//! Both servers talk to the same primary, which replicates to the same replica either
//! way; the only difference is the `WAIT` after each write. Each run with
//! acknowledgements is compared with the mean of the runs without just before and after
//! it, and the ratio reported is the median over rounds. Beside requests per second it
//! reads the CPU time the server, the primary and the replica spent per request
//! (`/proc/PID/task/*/schedstat`), the steadier figure on a shared machine.

use std::path::Path;

use crate::grpc::cpu_ns;
use crate::harness::median;
use crate::http_load::{self, Load, LoadResult, Server};
use crate::redis_store::BenchRedis;
use crate::report::{Row, Table, Verdict, micros};

/// The store URL's parameters for the acknowledged side (`BENCH_REDIS_ACKS` replaces
/// them, e.g. to try another `replica-ack-connections`).
pub const ACKS: &str = "replica-acks=1&replica-ack-timeout=250ms";

fn acks() -> String {
    std::env::var("BENCH_REDIS_ACKS").unwrap_or_else(|_| ACKS.to_owned())
}

/// How long and how hard the comparison runs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// HTTP connections (`wrk -c`), one level after the other.
    pub connections: Vec<usize>,
    /// Length of each `wrk` run.
    pub seconds: u64,
    /// Rounds per level; each round runs the acknowledged server once, between two runs
    /// of the other.
    pub rounds: usize,
    /// Tokio worker threads of each server.
    pub server_threads: usize,
}

/// The runs of one server at one level.
#[derive(Default)]
struct Runs {
    runs: Vec<LoadResult>,
    /// CPU time of the server, the primary and the replica per request, in µs.
    cpu_us: Vec<f64>,
    /// Acknowledged only: its throughput over the mean of its neighbours'.
    ratios: Vec<f64>,
    /// Acknowledged only: its CPU per request over the mean of its neighbours'.
    cpu_ratios: Vec<f64>,
}

impl Runs {
    fn med(&self, f: impl Fn(&LoadResult) -> f64) -> f64 {
        median(&mut self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

/// One concurrency level: both servers' runs, and the `WAIT`s the primary ran per
/// acknowledged request.
struct Level {
    connections: usize,
    runs: [Runs; 2],
    waits_per_request: f64,
}

fn skipped(why: impl Into<String>) -> Row {
    Row {
        name: "Redis replica_acks: keyed throughput".to_owned(),
        measured: why.into(),
        baseline: String::new(),
        ratio: String::new(),
        target: String::new(),
        verdict: Verdict::Skipped,
    }
}

/// `calls=` of `cmdstat_wait` in the primary's `INFO commandstats`: how many `WAIT`s it
/// has run.
fn waits_run(primary: &BenchRedis) -> u64 {
    std::process::Command::new("redis-cli")
        .args(["-p", &primary.port.to_string(), "INFO", "commandstats"])
        .output()
        .ok()
        .and_then(|output| {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .find_map(|line| {
                    line.strip_prefix("cmdstat_wait:calls=")?
                        .split(',')
                        .next()?
                        .parse()
                        .ok()
                })
        })
        .unwrap_or(0)
}

/// Runs the comparison with `server_bin` (`bench-server`) and adds its rows and table.
pub fn run(settings: &Settings, server_bin: &Path, rows: &mut Vec<Row>, tables: &mut Vec<Table>) {
    if std::process::Command::new("wrk")
        .arg("--version")
        .output()
        .is_err()
    {
        rows.push(skipped("wrk not found: apt-get install -y wrk"));
        return;
    }
    let (primary, replica) = match BenchRedis::start()
        .and_then(|primary| Ok((BenchRedis::start_replica_of(&primary)?, primary)))
    {
        Ok((replica, primary)) => (primary, replica),
        Err(error) => {
            rows.push(skipped(error));
            return;
        }
    };
    let threads = settings.server_threads.to_string();
    let acks = acks();
    let acked_url = format!("{}?{acks}", primary.url);
    let spawn = |name: &str, url: &str| {
        Server::spawn(
            name,
            server_bin,
            &[
                "--threads",
                &threads,
                "--mode",
                "redis",
                "--database-url",
                url,
            ],
        )
    };
    let servers = match spawn("asynchronous", &primary.url)
        .and_then(|plain| Ok([plain, spawn("replica-acks=1", &acked_url)?]))
    {
        Ok(servers) => servers,
        Err(error) => {
            rows.push(skipped(error));
            return;
        }
    };
    // Both answer a keyed request, and only the acknowledged one makes the primary WAIT.
    // A write the replica did not acknowledge in time is answered 503 (fail closed): on a
    // loaded machine the first ones may be, so a few keys are tried.
    for (server, waits) in servers.iter().zip([false, true]) {
        let before = waits_run(&primary);
        let mut last = String::new();
        let answered = (0..5).any(|attempt| {
            let key = format!("k-acks-check-{}-{waits}-{attempt}", std::process::id());
            match http_load::post_once(server.addr, Some(&key)) {
                Ok(answer) if answer.status == 201 => true,
                Ok(answer) => {
                    last = format!("{} answered {}", server.name, answer.status);
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    false
                }
                Err(error) => {
                    last = error;
                    false
                }
            }
        });
        if !answered {
            rows.push(skipped(last));
            return;
        }
        let ran = waits_run(&primary) - before;
        if (ran > 0) != waits {
            rows.push(skipped(format!(
                "{}: keyed requests made the primary run {ran} WAIT(s)",
                server.name
            )));
            return;
        }
    }

    let script =
        std::env::temp_dir().join(format!("idempotency-bench-acks-{}.lua", std::process::id()));
    std::fs::write(&script, http_load::WRK_SCRIPT).expect("write the wrk script");
    let mut results: Vec<Level> = Vec::new();
    let mut invocation = 0u64;
    for &connections in &settings.connections {
        let load = Load {
            script: &script,
            connections,
            threads: 1,
            seconds: settings.seconds,
        };
        let pids = |server: &Server| [server.pid(), primary.pid(), replica.pid()];
        let cpu = |pids: [u32; 3]| -> Option<u64> {
            pids.iter().map(|pid| cpu_ns(*pid)).sum::<Option<u64>>()
        };
        let mut run = |server: &Server| -> Option<(LoadResult, f64)> {
            invocation += 1;
            let nonce = format!("acks-{}-{invocation}", std::process::id());
            let before = cpu(pids(server));
            let load = http_load::run_wrk(load, server.addr, "fresh", &nonce, "unused")
                .map_err(|error| eprintln!("{}: {error}", server.name))
                .ok()?;
            let spent = cpu(pids(server))
                .zip(before)
                .map_or(f64::NAN, |(after, before)| (after - before) as f64 / 1e3);
            Some((load, spent / load.requests.max(1) as f64))
        };
        let mut level = [Runs::default(), Runs::default()];
        let record = |runs: &mut Runs, (load, cpu_us): (LoadResult, f64)| {
            runs.runs.push(load);
            runs.cpu_us.push(cpu_us);
        };
        let waits_before = waits_run(&primary);
        let mut before = run(&servers[0]);
        if let Some(b) = before {
            record(&mut level[0], b);
        }
        for round in 0..settings.rounds {
            eprintln!(
                "redis-acks: {connections} connections, round {}/{}",
                round + 1,
                settings.rounds
            );
            let acked = run(&servers[1]);
            let after = run(&servers[0]);
            if let Some(a) = after {
                record(&mut level[0], a);
            }
            if let (Some(acked), Some(b), Some(a)) = (acked, before, after) {
                level[1]
                    .ratios
                    .push(acked.0.rps / ((b.0.rps + a.0.rps) / 2.0));
                level[1].cpu_ratios.push(acked.1 / ((b.1 + a.1) / 2.0));
                record(&mut level[1], acked);
            }
            before = after;
        }
        let acked_requests: u64 = level[1].runs.iter().map(|r| r.requests).sum();
        let waits_per_request =
            (waits_run(&primary) - waits_before) as f64 / acked_requests.max(1) as f64;
        results.push(Level {
            connections,
            runs: level,
            waits_per_request,
        });
    }
    let _ = std::fs::remove_file(&script);
    drop(servers);
    drop(replica);
    drop(primary);

    let mut table = Table::new(
        format!(
            "Redis store on a primary with one replica, keyed first executions over HTTP \
             (wrk, 1 thread, a fresh key per request; servers: {} tokio worker thread(s); {} s \
             per run, {} round(s), each run with acknowledgements between two without)",
            settings.server_threads, settings.seconds, settings.rounds
        ),
        &[
            "store URL",
            "connections",
            "req/s",
            "× asynchronous",
            "p50",
            "p99",
            "CPU per request",
            "× asynchronous CPU",
            "errors",
            "WAITs per request",
        ],
    );
    for Level {
        connections,
        runs: level,
        waits_per_request: waits,
    } in &results
    {
        for (i, runs) in level.iter().enumerate() {
            if runs.runs.is_empty() {
                continue;
            }
            let errors: u64 = runs.runs.iter().map(|r| r.non_2xx + r.socket_errors).sum();
            table.push(vec![
                if i == 0 {
                    "redis://…".to_owned()
                } else {
                    format!("redis://…?{acks}")
                },
                connections.to_string(),
                format!("{:.0}", runs.med(|r| r.rps)),
                if i == 0 {
                    "1 (baseline)".to_owned()
                } else {
                    format!("{:.3}", median(&mut runs.ratios.clone()))
                },
                micros(runs.med(|r| r.p50_us)),
                micros(runs.med(|r| r.p99_us)),
                micros(median(&mut runs.cpu_us.clone())),
                if i == 0 {
                    "1 (baseline)".to_owned()
                } else {
                    format!("{:.3}", median(&mut runs.cpu_ratios.clone()))
                },
                errors.to_string(),
                if i == 0 {
                    "0".to_owned()
                } else {
                    format!("{waits:.2}")
                },
            ]);
        }
    }
    tables.push(table);

    let measured: Vec<&Level> = results
        .iter()
        .filter(|level| !level.runs[1].ratios.is_empty())
        .collect();
    if measured.is_empty() {
        rows.push(skipped("no run completed"));
        return;
    }
    let join = |f: &dyn Fn(&Level) -> String| {
        measured
            .iter()
            .map(|l| f(l))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let ratio = |level: &[Runs; 2]| median(&mut level[1].ratios.clone());
    rows.push(Row {
        name: format!(
            "Redis store URL with {acks}, keyed first executions over HTTP (c = {})",
            join(&|level| level.connections.to_string())
        ),
        measured: format!(
            "{} req/s",
            join(&|level| format!("{:.0}", level.runs[1].med(|r| r.rps)))
        ),
        baseline: format!(
            "{} req/s (the same store without acknowledgements)",
            join(&|level| format!("{:.0}", level.runs[0].med(|r| r.rps)))
        ),
        ratio: format!(
            "{} (CPU per request: {} the asynchronous store's)",
            join(&|level| format!("{:.3}×", ratio(&level.runs))),
            join(&|level| format!("{:.2}×", median(&mut level.runs[1].cpu_ratios.clone())))
        ),
        target: "≥ 0.8× at 16 and 64 connections".to_owned(),
        verdict: Verdict::from_bool(
            measured
                .iter()
                .filter(|level| level.connections >= 16)
                .all(|level| ratio(&level.runs) >= 0.8),
        ),
    });
}
