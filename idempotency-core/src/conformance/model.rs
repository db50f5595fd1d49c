//! Model-based checking: random sequences of store operations from several owners,
//! each answer compared with what a simple reference model says it must be.
//!
//! Time is made deterministic by using only two lengths for leases and lifetimes: zero
//! (lapsed or expired at once, by any clock: `now >= deadline` is lapsed) and an hour
//! (never within a run). The model follows the rules of the
//! [store trait](crate::IdempotencyStore#the-rules-every-store-keeps): a reservation under a live
//! lease does not expire, and fencing is by token alone.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::store::{
    Binding, FencingToken, Ownership, PurgeExpired, RecordId, RecordState, Reservation,
    StoredResponse,
};

const HOUR: Duration = Duration::from_secs(3600);

/// One step of a sequence.
#[derive(Clone, Debug)]
pub enum Step {
    /// `owner` reserves `key`; `lease_lapsed` / `expired` pick zero-length durations.
    Reserve {
        /// Which key (index into a few keys).
        key: usize,
        /// Which owner acts.
        owner: usize,
        /// Reserve with a zero lease.
        lease_lapsed: bool,
        /// Reserve with a zero lifetime.
        expired: bool,
    },
    /// `owner` finalizes `key` with its last token for that key.
    Finalize {
        /// Which key.
        key: usize,
        /// Which owner acts.
        owner: usize,
    },
    /// `owner` releases `key`.
    Release {
        /// Which key.
        key: usize,
        /// Which owner acts.
        owner: usize,
    },
    /// `owner` renews its lease on `key`, to zero or to an hour.
    Renew {
        /// Which key.
        key: usize,
        /// Which owner acts.
        owner: usize,
        /// Renew with a zero lease.
        lease_lapsed: bool,
    },
    /// `owner` tries to take over `key` from the token it last saw there.
    TakeOver {
        /// Which key.
        key: usize,
        /// Which owner acts.
        owner: usize,
    },
    /// Load `key` and compare it with the model.
    Load {
        /// Which key.
        key: usize,
    },
    /// Purge expired records.
    Purge,
}

#[derive(Clone, Debug, PartialEq)]
enum Model {
    InFlight {
        owner: usize,
        lease_lapsed: bool,
        expired: bool,
    },
    Completed {
        body: String,
        expired: bool,
    },
}

impl Model {
    fn live(&self) -> bool {
        !matches!(
            self,
            Model::InFlight { expired: true, .. } | Model::Completed { expired: true, .. }
        )
    }
}

/// A small deterministic generator (SplitMix64), so that a failing seed can be replayed.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> usize {
        (self.next() % n) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// A random sequence of `len` steps over 3 keys and 3 owners, from `seed`.
pub fn random_steps(seed: u64, len: usize) -> Vec<Step> {
    let mut random = Random(seed);
    (0..len)
        .map(|_| {
            let key = random.below(3);
            let owner = random.below(3);
            match random.below(7) {
                0 => Step::Reserve {
                    key,
                    owner,
                    lease_lapsed: random.chance(25),
                    expired: random.chance(15),
                },
                1 => Step::Finalize { key, owner },
                2 => Step::Release { key, owner },
                3 => Step::Renew {
                    key,
                    owner,
                    lease_lapsed: random.chance(40),
                },
                4 => Step::TakeOver { key, owner },
                5 => Step::Load { key },
                _ => Step::Purge,
            }
        })
        .collect()
}

fn binding() -> Binding {
    Binding {
        method: "POST".to_owned(),
        path: "/model".to_owned(),
        body_sha256: [7; 32],
    }
}

/// Runs `steps` against `store` and against the model, panicking at the first answer
/// that differs, with the step number and the whole sequence so far.
pub async fn check_steps<S: PurgeExpired + ?Sized>(store: &Arc<S>, steps: &[Step]) {
    let store = store.as_ref();
    let scope = format!("model-{}", uuid::Uuid::new_v4());
    let ids: Vec<RecordId> = (0..3)
        .map(|k| RecordId::new(scope.clone(), format!("key-{k}")))
        .collect();
    let mut model: HashMap<usize, Model> = HashMap::new();
    // The last token each owner got (or saw) for each key.
    let mut tokens: HashMap<(usize, usize), FencingToken> = HashMap::new();
    let mut bodies = 0;

    for (n, step) in steps.iter().enumerate() {
        let context = || format!("step {n} ({step:?}) of {:#?}", &steps[..=n]);
        match *step {
            Step::Reserve {
                key,
                owner,
                lease_lapsed,
                expired,
            } => {
                let lease = if lease_lapsed { Duration::ZERO } else { HOUR };
                let lifetime = if expired { Duration::ZERO } else { HOUR };
                let answer = store
                    .reserve(&ids[key], &binding(), lease, lifetime)
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                let existing = model.get(&key).filter(|m| m.live()).cloned();
                match (answer, existing) {
                    (Reservation::Reserved(token), None) => {
                        tokens.insert((key, owner), token);
                        model.insert(
                            key,
                            Model::InFlight {
                                owner,
                                lease_lapsed,
                                // A record under a live lease never expires.
                                expired: expired && lease_lapsed,
                            },
                        );
                    }
                    (Reservation::Exists(record), Some(expected)) => {
                        assert_state(&record.state, &expected, &context);
                        if let RecordState::InFlight { token, .. } = record.state {
                            tokens.insert((key, owner), token);
                        }
                    }
                    (answer, expected) => {
                        panic!(
                            "store answered {answer:?}, model has {expected:?} at {}",
                            context()
                        )
                    }
                }
            }
            Step::Finalize { key, owner } => {
                bodies += 1;
                let body = format!("body-{bodies}");
                let Some(token) = tokens.get(&(key, owner)).copied() else {
                    continue;
                };
                let response = StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: body.clone().into(),
                    trailers: vec![],
                };
                let answer = store
                    .finalize(&ids[key], token, &response)
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                let owns = owns(&model, key, &tokens, token);
                assert_eq!(answer == Ownership::Held, owns, "finalize at {}", context());
                if owns {
                    model.insert(
                        key,
                        Model::Completed {
                            body,
                            expired: false,
                        },
                    );
                }
            }
            Step::Release { key, owner } => {
                let Some(token) = tokens.get(&(key, owner)).copied() else {
                    continue;
                };
                let answer = store
                    .release(&ids[key], token)
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                let owns = owns(&model, key, &tokens, token);
                assert_eq!(answer == Ownership::Held, owns, "release at {}", context());
                if owns {
                    model.remove(&key);
                }
            }
            Step::Renew {
                key,
                owner,
                lease_lapsed,
            } => {
                let Some(token) = tokens.get(&(key, owner)).copied() else {
                    continue;
                };
                let lease = if lease_lapsed { Duration::ZERO } else { HOUR };
                let answer = store
                    .renew(&ids[key], token, lease)
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                let owns = owns(&model, key, &tokens, token);
                assert_eq!(answer == Ownership::Held, owns, "renew at {}", context());
                if let (
                    true,
                    Some(Model::InFlight {
                        lease_lapsed: lapsed,
                        ..
                    }),
                ) = (owns, model.get_mut(&key))
                {
                    *lapsed = lease_lapsed;
                }
            }
            Step::TakeOver { key, owner } => {
                let Some(seen) = tokens.get(&(key, owner)).copied() else {
                    continue;
                };
                let answer = store
                    .take_over(&ids[key], seen, HOUR)
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                // Allowed when the token seen is the live in-flight record's, lapsed.
                let current_owner = match model.get(&key) {
                    Some(Model::InFlight {
                        owner: current,
                        lease_lapsed: true,
                        expired: false,
                    }) => Some(*current),
                    _ => None,
                };
                let allowed =
                    current_owner.is_some_and(|current| tokens.get(&(key, current)) == Some(&seen));
                match (answer, allowed) {
                    (Some(token), true) => {
                        tokens.insert((key, owner), token);
                        model.insert(
                            key,
                            Model::InFlight {
                                owner,
                                lease_lapsed: false,
                                expired: false,
                            },
                        );
                    }
                    (None, false) => {}
                    (answer, allowed) => panic!(
                        "take_over answered {answer:?}, model allowed it: {allowed} at {}",
                        context()
                    ),
                }
            }
            Step::Load { key } => {
                let record = store
                    .load(&ids[key])
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                match (record, model.get(&key).filter(|m| m.live())) {
                    (None, None) => {}
                    (Some(record), Some(expected)) => {
                        assert_state(&record.state, expected, &context)
                    }
                    (record, expected) => {
                        panic!(
                            "load gave {record:?}, model has {expected:?} at {}",
                            context()
                        )
                    }
                }
            }
            Step::Purge => {
                crate::purge::purge_all_expired(store, 2)
                    .await
                    .unwrap_or_else(|e| panic!("{e} at {}", context()));
                model.retain(|_, m| m.live());
            }
        }
    }
}

/// Whether `token` owns the live in-flight record of `key` in the model. Fencing is by
/// token alone: an owner holding a token it saw acts with the rights of that token.
fn owns(
    model: &HashMap<usize, Model>,
    key: usize,
    tokens: &HashMap<(usize, usize), FencingToken>,
    token: FencingToken,
) -> bool {
    match model.get(&key) {
        Some(Model::InFlight {
            owner: current,
            expired: false,
            ..
        }) => tokens.get(&(key, *current)) == Some(&token),
        _ => false,
    }
}

fn assert_state(actual: &RecordState, expected: &Model, context: &dyn Fn() -> String) {
    match (actual, expected) {
        (
            RecordState::InFlight { lease_lapsed, .. },
            Model::InFlight {
                lease_lapsed: expected,
                ..
            },
        ) => assert_eq!(lease_lapsed, expected, "lease state at {}", context()),
        (RecordState::Completed(response), Model::Completed { body, .. }) => {
            assert_eq!(
                response.body,
                body.as_bytes(),
                "stored body at {}",
                context()
            )
        }
        (actual, expected) => panic!(
            "store has {actual:?}, model has {expected:?} at {}",
            context()
        ),
    }
}

/// Runs `runs` random sequences of `len` steps, seeds `first_seed..`, against `store`.
pub async fn check_random_sequences<S: PurgeExpired + ?Sized>(
    store: &Arc<S>,
    first_seed: u64,
    runs: u64,
    len: usize,
) {
    for seed in first_seed..first_seed + runs {
        check_steps(store, &random_steps(seed, len)).await;
    }
}
