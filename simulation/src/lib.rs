//! A seeded simulation of the Idempotency-Key layer over every store, judged by a
//! history checker.
//!
//! Example-based tests look at the orders someone thought of; the bugs that matter sit
//! where several requests, a store and time interleave. Each run here drives the real
//! [`IdempotencyLayer`](idempotency_core::IdempotencyLayer) over a real store with
//! several clients sending requests on a few keys at once, handlers that answer 2xx,
//! 4xx, 5xx, 401, an unknown outcome, panic, fail, run three leases long, or lose their
//! client mid-request; faults between the layer and the store (a call that fails before
//! it reaches the store, a store answer lost after the store did the work, latency); and
//! time (leases lapsing, keys expiring mid-run, a purge running every third of a
//! lifetime). Then every client stops, faults stop, every record expires, and one more
//! request per key must run.
//!
//! Everything a run does comes from its seed: the workload ([`plan`]) and the faults.
//! On the memory store under a paused tokio clock on one thread, the same seed replays
//! the same schedule exactly (`tests/memory.rs` checks it); on real servers the seed
//! fixes the workload and the faults, and the schedule is whatever the servers make of
//! it. A failing run panics with its seed and the history of the keys involved;
//! `SIM_SEED=n` runs that seed alone, `SIM_RUNS=n` runs more seeds (see `TESTING.md`).
//!
//! # The rules the checker judges a run by
//!
//! From what the clients got, what the handler ran (each execution knows its request and
//! the token the layer reserved it under) and what the store answered (recorded by the
//! wrapper, before a fault replaced the answer):
//!
//! - **Every request ends**: an answer, a failure (the handler panicked or failed), or
//!   its client gave up.
//! - **Own answer or a replay**: an answer that is not marked as a replay is the
//!   request's own execution.
//! - **Never another binding's answer**: a replay is the answer of an execution of the
//!   same scope, key and body.
//! - **Replays are byte-identical**: status, body and kept headers equal the first
//!   answer.
//! - **Only stored answers replay**: a replayed answer is one the store finalized (or
//!   may have: a finalize that failed as the server dropped its connection may have
//!   committed), and never a 5xx, a 401 or an unknown outcome.
//! - **At most one execution per key and lifetime**: once an execution's answer is
//!   stored (or its change committed with its record), or its key held for an unknown
//!   outcome, no execution of that scope and key
//!   starts before the record can have expired (the reservation it descends from was
//!   asked for, plus the lifetime).
//! - **One execution at a time**: a second execution of a key starts while one runs only
//!   once every lease the store granted the first one (reserve, takeover, renew) has
//!   ended; an uncommitted reservation, which has no lease, never shares its key while
//!   its transaction lasts (the server ends it when it drops the connection: a restart,
//!   a cut; an execution whose change committed kept it to the end).
//! - **A lease is taken over only once it lapsed**, by the same measure.
//! - **A fenced owner changes nothing**: after a takeover or a release, the store accepts
//!   no renew, hold, finalize or release of the old token.
//! - **A released record is gone**: once a store answered a release `Held`, no later
//!   answer shows that reservation again.
//! - **A duplicate waits no longer than the in-flight wait** (plus the store calls'
//!   injected latency) before it is answered 409 or 503.
//! - **Nothing outlives its request**: once quiet, the store holds no transaction, lock
//!   or connection (for stores whose test supplies a
//!   [`Leftovers`](idempotency_core::conformance::Leftovers)).
//! - **The database holds exactly the committed changes** (targets whose handler writes
//!   through a transaction, [`Effects`]): every change the handler saw commit is in the
//!   database, and every change there was committed or lost its `COMMIT`'s answer.
//!   Where the record commits with the change (the one-commit store), a change in the
//!   database keeps its key as a stored answer does, under the rule above.
//! - **Every key frees once its records expired**: after the quiet phase, a request on
//!   each key runs (nothing released is still stored, nothing held is held for ever).
//!
//! # What it finds
//!
//! See `TESTING.md` for the bugs planted to show that the checker catches them, each with
//! the seed that caught it.

#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]

mod check;
mod faults;
mod history;
mod plan;
pub mod proxy;
mod run;

pub use check::Violation;
pub use faults::Faults;
pub use history::{Answer, Change, Ending, Event, Fault, History, KeyOf, StoreCall, StoreResult};
pub use plan::{Behaviour, Settings, Step, plan};
pub use run::{Effects, OwnFaults, Run, Target, simulate};

/// The seeds a test runs: `SIM_SEED` alone if set, else `SIM_RUNS` seeds (default
/// `default_runs`) from `SIM_FIRST_SEED` (default 1, so that CI runs the same seeds every
/// time; a soak picks its own first seed).
pub fn seeds(default_runs: u64) -> Vec<u64> {
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|value| value.parse().ok())
    };
    if let Some(seed) = var("SIM_SEED") {
        return vec![seed];
    }
    let runs = var("SIM_RUNS").unwrap_or(default_runs);
    let first = var("SIM_FIRST_SEED").unwrap_or(1);
    (first..first + runs).collect()
}
