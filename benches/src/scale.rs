//! Scale: memory per live and in-flight record in the memory store, and allocations per
//! request through the layer (measured by the `mem-scale` binary in a process of its own,
//! so nothing else shares its heap or its allocator's counters).

use std::path::Path;
use std::process::Command;

use crate::report::{Row, Verdict};

/// The memory budget this project states for the memory store: bytes per live completed
/// record with a small response (a 36-byte key, `POST /orders`, one stored header and a
/// 33-byte body), allocator and hash-table overhead included. 1,000,000 such records must
/// fit in 1 GB of process memory (RSS).
pub const BUDGET_BYTES_PER_RECORD: f64 = 1_000.0;

/// The resident set size of this process, from `/proc/self/status`.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The allocations a keyed request may make, by `benches::drive` mode, and the most
/// allocations it made when these were set (2026-12-07; the same mode without the layer:
/// 20 HTTP, 23 gRPC): a request path that allocates more than this has regressed.
pub const ALLOCATION_BUDGETS: [(&str, f64); 6] = [
    ("none", 20.0),
    ("fresh", 45.0),
    ("replay", 21.0),
    ("grpc-none", 23.0),
    ("grpc-fresh", 56.0),
    ("grpc-replay", 25.0),
];

/// What `mem-scale` measured.
#[derive(Clone, Debug)]
pub struct MemScale {
    /// Live records inserted.
    pub records: u64,
    /// Heap bytes allocated and still live, per record.
    pub heap_per_record: f64,
    /// Growth of the resident set, per record.
    pub rss_per_record: f64,
    /// The bytes of the record's own data (key, method, path, header, body), per record.
    pub payload_per_record: f64,
    /// Seconds to insert them all (reserve + finalize each).
    pub seconds: f64,
    /// Heap bytes per record reserved and not finalized.
    pub in_flight_heap_per_record: f64,
    /// Per kind of request sent through the layer in process.
    pub allocations: Vec<Allocations>,
}

/// What one kind of request asked of the allocator, per request.
#[derive(Clone, Debug)]
pub struct Allocations {
    /// The `benches::drive` mode (`fresh`, `grpc-replay`, …).
    pub mode: String,
    /// Allocations (and reallocations).
    pub count: f64,
    /// The bytes they asked for.
    pub bytes: f64,
    /// The heap still live once the requests were answered (a fresh key's record).
    pub live_bytes: f64,
}

/// The `name=value` field of one line of `mem-scale`'s output.
fn field(line: &str, name: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?
        .parse()
        .ok()
}

/// Parses what `mem-scale` prints: its `RESULT`, `IN_FLIGHT` and `ALLOCATIONS` lines.
pub fn parse(output: &str) -> Option<MemScale> {
    let result = output.lines().find_map(|l| l.strip_prefix("RESULT "))?;
    let in_flight = output.lines().find_map(|l| l.strip_prefix("IN_FLIGHT "))?;
    let allocations = output
        .lines()
        .filter_map(|l| l.strip_prefix("ALLOCATIONS "))
        .map(|line| {
            Some(Allocations {
                mode: line
                    .split_whitespace()
                    .find_map(|kv| kv.strip_prefix("mode="))?
                    .to_owned(),
                count: field(line, "per_request")?,
                bytes: field(line, "bytes_per_request")?,
                live_bytes: field(line, "live_bytes_per_request")?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(MemScale {
        records: field(result, "records")? as u64,
        heap_per_record: field(result, "heap_bytes_per_record")?,
        rss_per_record: field(result, "rss_bytes_per_record")?,
        payload_per_record: field(result, "payload_bytes_per_record")?,
        seconds: field(result, "seconds")?,
        in_flight_heap_per_record: field(in_flight, "heap_bytes_per_record")?,
        allocations,
    })
}

/// Runs the `mem-scale` binary next to this one and turns its answer into rows: memory
/// per live and in-flight record, then allocations per request for each mode.
pub fn run(program: &Path, records: u64, requests: u64) -> Vec<Row> {
    let name = format!("memory store, {records} live completed records");
    let output = Command::new(program)
        .args(["--records", &records.to_string()])
        .args(["--requests", &requests.to_string()])
        .output();
    let parsed = match &output {
        Ok(out) => parse(&String::from_utf8_lossy(&out.stdout)),
        Err(_) => None,
    };
    let Some(m) = parsed else {
        return vec![Row {
            name,
            measured: format!("mem-scale failed: {output:?}"),
            baseline: String::new(),
            ratio: String::new(),
            target: String::new(),
            verdict: Verdict::Skipped,
        }];
    };
    let worst = m.rss_per_record.max(m.heap_per_record);
    let mut rows = vec![
        Row {
            name,
            measured: format!(
                "{:.0} B/record RSS, {:.0} B/record heap ({:.0} MB RSS in all; inserted in {:.1} s)",
                m.rss_per_record,
                m.heap_per_record,
                m.rss_per_record * m.records as f64 / 1e6,
                m.seconds
            ),
            baseline: format!("{:.0} B/record of payload", m.payload_per_record),
            ratio: format!("{:.1}× payload", worst / m.payload_per_record),
            target: format!(
                "within the stated budget: ≤ {BUDGET_BYTES_PER_RECORD:.0} B/record (1 GB per 1M)"
            ),
            verdict: Verdict::from_bool(worst <= BUDGET_BYTES_PER_RECORD),
        },
        Row {
            name: "memory store, a record in flight (reserved, not finalized)".to_owned(),
            measured: format!("{:.0} B/record heap", m.in_flight_heap_per_record),
            baseline: String::new(),
            ratio: String::new(),
            target: format!("≤ {BUDGET_BYTES_PER_RECORD:.0} B/record"),
            verdict: Verdict::from_bool(m.in_flight_heap_per_record <= BUDGET_BYTES_PER_RECORD),
        },
    ];
    let bare = |mode: &str| {
        let bare_mode = if mode.starts_with("grpc-") {
            "grpc-bare"
        } else {
            "bare"
        };
        m.allocations.iter().find(|a| a.mode == bare_mode)
    };
    for (mode, budget) in ALLOCATION_BUDGETS {
        let (Some(a), Some(bare)) = (m.allocations.iter().find(|a| a.mode == mode), bare(mode))
        else {
            rows.push(Row {
                name: format!("allocations per request, {mode}"),
                measured: "mem-scale printed no count".to_owned(),
                baseline: String::new(),
                ratio: String::new(),
                target: String::new(),
                verdict: Verdict::Skipped,
            });
            continue;
        };
        rows.push(Row {
            name: format!("allocations per request in process, memory store, {mode}"),
            measured: format!(
                "{:.1} allocations, {:.0} B asked, {:.0} B still live",
                a.count, a.bytes, a.live_bytes
            ),
            baseline: format!("{:.1} allocations, {:.0} B without the layer", bare.count, bare.bytes),
            ratio: format!("+{:.1} allocations", a.count - bare.count),
            target: format!("≤ {budget:.0} allocations (no more than when measured first); a stored record ≤ {BUDGET_BYTES_PER_RECORD:.0} B live"),
            verdict: Verdict::from_bool(
                a.count <= budget + 0.5 && a.live_bytes <= BUDGET_BYTES_PER_RECORD,
            ),
        });
    }
    rows
}
