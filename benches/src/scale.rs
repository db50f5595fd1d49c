//! Scale: memory per live record in the memory store (measured by the `mem-scale` binary in
//! a process of its own, so nothing else shares its heap).

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

/// What `mem-scale` measured.
#[derive(Clone, Copy, Debug)]
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
}

/// Parses the `RESULT` line `mem-scale` prints.
pub fn parse(line: &str) -> Option<MemScale> {
    let line = line.lines().find_map(|l| l.strip_prefix("RESULT "))?;
    let field = |name: &str| -> Option<f64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?
            .parse()
            .ok()
    };
    Some(MemScale {
        records: field("records")? as u64,
        heap_per_record: field("heap_bytes_per_record")?,
        rss_per_record: field("rss_bytes_per_record")?,
        payload_per_record: field("payload_bytes_per_record")?,
        seconds: field("seconds")?,
    })
}

/// Runs the `mem-scale` binary next to this one and turns its answer into a row.
pub fn run(program: &Path, records: u64) -> Row {
    let name = format!("memory store, {records} live completed records");
    let output = Command::new(program)
        .arg("--records")
        .arg(records.to_string())
        .output();
    let parsed = match &output {
        Ok(out) => parse(&String::from_utf8_lossy(&out.stdout)),
        Err(_) => None,
    };
    let Some(m) = parsed else {
        return Row {
            name,
            measured: format!("mem-scale failed: {output:?}"),
            baseline: String::new(),
            ratio: String::new(),
            target: String::new(),
            verdict: Verdict::Skipped,
        };
    };
    let worst = m.rss_per_record.max(m.heap_per_record);
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
    }
}
