//! A small timing harness that measures a subject against a baseline in the same run.
//!
//! Rounds alternate between the two (baseline first in even rounds, subject first in odd
//! ones) so that a burst of noise from another process hits both about equally. Each round
//! yields one ratio; the reported ratio is the median of those per-round ratios, which is
//! robust against the odd round spoiled by a neighbour.

use std::time::Duration;

/// What one paired measurement found.
#[derive(Clone, Copy, Debug)]
pub struct Paired {
    /// Median time per iteration of the baseline, in nanoseconds.
    pub baseline_ns: f64,
    /// Median time per iteration of the subject, in nanoseconds.
    pub subject_ns: f64,
    /// Median over rounds of (baseline time / subject time): the subject's throughput as a
    /// fraction of the baseline's (1.0 = as fast, 0.9 = 10% slower, 2.0 = twice as fast).
    pub throughput_ratio: f64,
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
    Paired {
        baseline_ns: median(&mut base),
        subject_ns: median(&mut subj),
        throughput_ratio: median(&mut ratios),
        ratio_range: (low, high),
    }
}
