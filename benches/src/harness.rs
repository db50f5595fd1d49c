//! A small timing harness that measures a subject against a baseline in the same run.
//!
//! Rounds alternate between the two (baseline first in even rounds, subject first in odd
//! ones) so that a burst of noise from another process hits both about equally. The
//! reported times are each side's fastest round: on a shared machine noise only ever adds
//! time, so the minimum over many short rounds is the least disturbed estimate of what the
//! code costs. The spread of the per-round ratios is reported beside it.

use std::time::Duration;

/// What one paired measurement found.
#[derive(Clone, Copy, Debug)]
pub struct Paired {
    /// Time per iteration of the baseline in its fastest round, in nanoseconds.
    pub baseline_ns: f64,
    /// Time per iteration of the subject in its fastest round, in nanoseconds.
    pub subject_ns: f64,
    /// `baseline_ns / subject_ns`: the subject's throughput as a fraction of the
    /// baseline's (1.0 = as fast, 0.9 = 10% slower, 2.0 = twice as fast).
    pub throughput_ratio: f64,
    /// The median of the per-round ratios, as a cross-check of the above.
    pub median_ratio: f64,
    /// The smallest and largest per-round ratio, to show the spread.
    pub ratio_range: (f64, f64),
}

/// The median of `values` (which it sorts).
pub fn median(values: &mut [f64]) -> f64 {
    assert!(!values.is_empty(), "median of nothing");
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The `q`-quantile (0..=1) of sorted `values`, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    assert!(!sorted.is_empty(), "quantile of nothing");
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Runs one warm-up batch of each, then `rounds` interleaved rounds of `iters` iterations.
/// `baseline` and `subject` run `iters` iterations and return the time they took.
pub fn paired(
    rounds: usize,
    iters: u64,
    mut baseline: impl FnMut(u64) -> Duration,
    mut subject: impl FnMut(u64) -> Duration,
) -> Paired {
    let per_iter = |d: Duration| d.as_nanos() as f64 / iters as f64;
    baseline(iters.div_ceil(4));
    subject(iters.div_ceil(4));
    let mut base = Vec::with_capacity(rounds);
    let mut subj = Vec::with_capacity(rounds);
    let mut ratios = Vec::with_capacity(rounds);
    for round in 0..rounds.max(1) {
        let (b, s) = if round % 2 == 0 {
            let b = baseline(iters);
            (b, subject(iters))
        } else {
            let s = subject(iters);
            (baseline(iters), s)
        };
        let (b, s) = (per_iter(b), per_iter(s));
        base.push(b);
        subj.push(s);
        ratios.push(b / s);
    }
    let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let high = ratios.iter().copied().fold(0.0, f64::max);
    let fastest = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (baseline_ns, subject_ns) = (fastest(&base), fastest(&subj));
    Paired {
        baseline_ns,
        subject_ns,
        throughput_ratio: baseline_ns / subject_ns,
        median_ratio: median(&mut ratios),
        ratio_range: (low, high),
    }
}
