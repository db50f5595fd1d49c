//! The simulation on the memory store: a paused tokio clock on one thread, so a seed
//! replays its schedule exactly and a run of seconds takes milliseconds.

use std::sync::Arc;

use idempotency_store_memory::MemoryStore;
use simulation::{Run, Settings, Target, seeds, simulate};

fn run(seed: u64, settings: &Settings) -> Run {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime")
        .block_on(async {
            let store = Arc::new(MemoryStore::new());
            let target = Target {
                store: store.clone(),
                purge: Some(store),
                leftovers: None,
                namespace: String::new(),
                effects: None,
                own_faults: None,
                reservations_unseen: false,
            };
            simulate(&target, settings, seed).await
        })
}

#[test]
fn every_seed_keeps_every_rule() {
    let settings = Settings::quick();
    let seeds = seeds(2000);
    eprintln!(
        "memory store: seeds {}..={}",
        seeds[0],
        seeds[seeds.len() - 1]
    );
    for seed in seeds {
        run(seed, &settings).assert_passed("the memory store");
    }
}

/// The same rules with every key in the request's JSON body (`JsonPointerKey`, bound to
/// the body's `/body`), not in the header: the payload-key path is the same request path.
#[test]
fn keys_in_the_body_keep_every_rule() {
    let settings = Settings {
        keys_in_body: true,
        ..Settings::quick()
    };
    let seeds = seeds(300);
    eprintln!(
        "memory store, keys in the body: seeds {}..={}",
        seeds[0],
        seeds[seeds.len() - 1]
    );
    let mut seen = std::collections::BTreeSet::new();
    for seed in seeds {
        let run = run(seed, &settings);
        run.assert_passed("the memory store, keys in the body");
        let history = run.history.render(None);
        for (what, text) in [
            ("replay", "(replay)"),
            ("reused key", "answered 422"),
            ("takeover", "took over as"),
        ] {
            if history.contains(text) {
                seen.insert(what);
            }
        }
        assert!(
            !history.contains("invalid-key") && !history.contains("missing-key"),
            "seed {seed}: the layer refused a key in the body:\n{history}"
        );
    }
    assert_eq!(seen.len(), 3, "the keys in the body took part: {seen:?}");
}

#[test]
fn a_seed_replays_its_schedule_exactly() {
    let settings = Settings::quick();
    for seed in [7, 8, 9] {
        let first = run(seed, &settings).history.render(None);
        let second = run(seed, &settings).history.render(None);
        assert!(
            first.lines().count() > 100,
            "a run does something:\n{first}"
        );
        assert_eq!(first, second, "seed {seed} ran two different schedules");
    }
}

#[test]
fn the_workload_meets_every_case() {
    // Over the default seeds, every behaviour, fault and ending the rules speak of
    // happens: a sweep that never saw a takeover would prove nothing about takeovers.
    let settings = Settings::quick();
    let mut seen = std::collections::BTreeSet::new();
    for seed in 1..=20 {
        let history = run(seed, &settings).history.render(None);
        for (what, text) in [
            ("replay", "(replay)"),
            ("reused key", "answered 422"),
            ("in flight", "answered 409"),
            ("takeover", "took over as"),
            ("hold", "store hold"),
            ("release", "store release"),
            ("answer lost", "[fault: answer lost]"),
            ("failed before", "[fault: failed before the store]"),
            ("client gave up", "its client gave up"),
            ("no answer", "failed (no answer)"),
            ("unknown outcome", "outcome unknown"),
        ] {
            if history.contains(text) {
                seen.insert(what);
            }
        }
    }
    assert_eq!(seen.len(), 11, "the sweep saw only {seen:?}");
}
