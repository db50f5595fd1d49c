//! The retry-storm program end to end: with the layer no mutation runs twice, without
//! it some do.

use std::process::Command;

#[test]
fn the_layer_stops_every_double_execution_in_a_retry_storm() {
    let output = Command::new(env!("CARGO_BIN_EXE_retry-storm"))
        .args([
            "--operations",
            "200",
            "--drop-percent",
            "30",
            "--concurrency",
            "8",
        ])
        .output()
        .expect("retry-storm did not start");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "retry-storm failed: {report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let row = |name: &str| -> Vec<u64> {
        let line = report
            .lines()
            .find(|line| line.starts_with(&format!("| {name}")))
            .unwrap_or_else(|| panic!("no row for {name} in {report}"));
        line.split('|')
            .skip(2)
            .filter_map(|cell| cell.trim().parse().ok())
            .collect()
    };
    let (with, without) = (row("with the layer"), row("without it"));
    assert_eq!(with[0], 200, "every mutation ran: {report}");
    assert_eq!(
        with[1], 0,
        "no mutation ran twice behind the layer: {report}"
    );
    assert!(with[2] > 0, "lost answers were replayed: {report}");
    assert!(
        without[1] > 0,
        "without the layer, lost answers cause double runs: {report}"
    );
}
