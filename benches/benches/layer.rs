//! `cargo bench -p benches --bench layer [-- --quick]`: the in-process layer overhead.

use benches::{inprocess, report};

fn main() {
    let quick = std::env::args().any(|arg| arg == "--quick");
    let settings = if quick {
        inprocess::Settings::quick()
    } else {
        inprocess::Settings::full()
    };
    let rows = inprocess::run(settings);
    println!(
        "{}",
        report::summary("In-process layer overhead", &rows).to_markdown()
    );
}
