//! Result tables, printed as Markdown so that they can go straight into `BENCHMARKS.md`.

use std::fmt::Write as _;

use crate::harness::Paired;

/// Whether a figure meets its target (the targets are listed in BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The target is met.
    Met,
    /// The target is missed.
    Missed,
    /// The figure has no target of its own (context for another one).
    Info,
    /// The benchmark could not run (a service or a binary is missing); the reason is in
    /// the row.
    Skipped,
}

impl Verdict {
    /// Met when `ok`, missed otherwise.
    pub fn from_bool(ok: bool) -> Self {
        if ok { Self::Met } else { Self::Missed }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::Met => "met",
            Self::Missed => "**missed**",
            Self::Info => "",
            Self::Skipped => "skipped",
        }
    }
}

/// One line of the summary table.
#[derive(Clone, Debug)]
pub struct Row {
    /// What is measured.
    pub name: String,
    /// The subject's figure, with its unit.
    pub measured: String,
    /// The baseline's figure from the same run, with its unit.
    pub baseline: String,
    /// The ratio the target is about, spelled out (e.g. `0.97× bare throughput`).
    pub ratio: String,
    /// The target this row checks (e.g. `≥ 0.90× bare`), if any.
    pub target: String,
    /// Whether it is met.
    pub verdict: Verdict,
}

/// A titled Markdown table.
#[derive(Clone, Debug, Default)]
pub struct Table {
    /// The heading printed above it.
    pub title: String,
    /// The column names.
    pub columns: Vec<String>,
    /// The cells, row by row.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these columns.
    pub fn new(title: impl Into<String>, columns: &[&str]) -> Self {
        Self {
            title: title.into(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn push(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Renders it as Markdown.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        if !self.title.is_empty() {
            let _ = writeln!(out, "### {}\n", self.title);
        }
        let _ = writeln!(out, "| {} |", self.columns.join(" | "));
        let _ = writeln!(
            out,
            "|{}",
            self.columns.iter().map(|_| "---|").collect::<String>()
        );
        for row in &self.rows {
            let _ = writeln!(out, "| {} |", row.join(" | "));
        }
        out
    }
}

/// The summary table of rows.
pub fn summary(title: &str, rows: &[Row]) -> Table {
    let mut table = Table::new(
        title,
        &[
            "benchmark",
            "measured",
            "baseline (same run)",
            "ratio",
            "target",
            "",
        ],
    );
    for row in rows {
        table.push(vec![
            row.name.clone(),
            row.measured.clone(),
            row.baseline.clone(),
            row.ratio.clone(),
            row.target.clone(),
            row.verdict.as_str().to_owned(),
        ]);
    }
    table
}

/// Formats nanoseconds with a readable unit.
pub fn nanos(ns: f64) -> String {
    if ns >= 1_000_000.0 {
        format!("{:.2} ms", ns / 1_000_000.0)
    } else if ns >= 1_000.0 {
        format!("{:.2} µs", ns / 1_000.0)
    } else {
        format!("{ns:.0} ns")
    }
}

/// Formats microseconds with a readable unit.
pub fn micros(us: f64) -> String {
    nanos(us * 1_000.0)
}

/// Which of a paired measurement's ratios a row reads its target by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Estimate {
    /// Each side's fastest round: in process, where noise only ever adds time.
    FastestRounds,
    /// The median of the per-round ratios: over sockets, where a round's latency swings
    /// with the scheduler (as the HTTP and gRPC sections read `wrk` and `grpc-load`).
    MedianRound,
}

impl Estimate {
    /// The ratio this estimate reads from `result`.
    pub fn of(self, result: &Paired) -> f64 {
        match self {
            Self::FastestRounds => result.throughput_ratio,
            Self::MedianRound => result.median_ratio,
        }
    }
}

/// The row of a paired measurement: per-request times (fastest rounds), and the subject's
/// throughput as a fraction of `baseline`'s by `estimate`, with the other estimate and
/// the rounds' range beside it.
pub fn paired_row(
    name: &str,
    result: Paired,
    estimate: Estimate,
    baseline: &str,
    target: &str,
    verdict: Verdict,
) -> Row {
    let (headline, other, other_name) = match estimate {
        Estimate::FastestRounds => (result.throughput_ratio, result.median_ratio, "median round"),
        Estimate::MedianRound => (
            result.median_ratio,
            result.throughput_ratio,
            "fastest rounds",
        ),
    };
    Row {
        name: name.to_owned(),
        measured: format!("{}/req", nanos(result.subject_ns)),
        baseline: format!("{}/req ({baseline})", nanos(result.baseline_ns)),
        ratio: format!(
            "{headline:.3}× {baseline} throughput ({other_name} {other:.3}, rounds {:.2}–{:.2})",
            result.ratio_range.0, result.ratio_range.1
        ),
        target: target.to_owned(),
        verdict,
    }
}
