//! The workload of one run, drawn from its seed: which client sends what, when, and
//! what the handler does with it.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::faults::Faults;

/// The shape of a run: how many clients, keys and requests, the layer's times, and the
/// faults between the layer and the store.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Clients sending at once.
    pub clients: usize,
    /// Requests each client sends, one after the other.
    pub requests_per_client: usize,
    /// Scopes (callers) the keys are spread over.
    pub scopes: usize,
    /// Keys per scope: few, so that requests meet on them.
    pub keys: usize,
    /// The layer's key lifetime (no grace period).
    pub lifetime: Duration,
    /// The layer's lease.
    pub lease: Duration,
    /// How long a duplicate waits for the owner.
    pub in_flight_wait: Duration,
    /// The longest pause of a client between two requests.
    pub max_think: Duration,
    /// The longest a quick handler runs.
    pub max_handler_time: Duration,
    /// Faults between the layer and the store.
    pub faults: Faults,
    /// How far apart the store's clock and the simulation's may be (zero on the memory
    /// store under a paused clock; a database's clock and its round trips need some).
    pub clock_tolerance: Duration,
    /// Whether requests carry their key in a JSON body (`{"key": …, "body": …}`, read by
    /// a `JsonPointerKey` bound to `/body`) instead of the `Idempotency-Key` header.
    pub keys_in_body: bool,
}

impl Settings {
    /// A short run for one seed: about three lifetimes of traffic.
    pub fn quick() -> Self {
        Self {
            clients: 6,
            requests_per_client: 8,
            scopes: 2,
            keys: 2,
            lifetime: Duration::from_millis(1_500),
            lease: Duration::from_millis(200),
            in_flight_wait: Duration::from_millis(150),
            max_think: Duration::from_millis(400),
            max_handler_time: Duration::from_millis(120),
            faults: Faults {
                error_before: 0.03,
                answer_lost: 0.03,
                slow: 0.2,
                max_latency: Duration::from_millis(30),
                stall: 0.02,
                stall_for: Duration::from_millis(200),
            },
            clock_tolerance: Duration::ZERO,
            keys_in_body: false,
        }
    }
}

/// What the handler does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// 201: stored and replayed.
    Created,
    /// 400: a deterministic client error, stored and replayed.
    BadRequest,
    /// 500: released, never stored.
    ServerError,
    /// 401: says nothing about the operation; released.
    Unauthorized,
    /// 500 marked `OutcomeUnknown`: the key is held until it expires.
    Unknown,
    /// The handler panics.
    Panics,
    /// The service fails (its `Err`).
    Fails,
    /// Runs three leases long (renewing meanwhile), then 201.
    Slow,
}

impl Behaviour {
    /// The header value the handler reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::BadRequest => "bad-request",
            Self::ServerError => "server-error",
            Self::Unauthorized => "unauthorized",
            Self::Unknown => "unknown",
            Self::Panics => "panics",
            Self::Fails => "fails",
            Self::Slow => "slow",
        }
    }

    /// The behaviour a header names.
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Created,
            Self::BadRequest,
            Self::ServerError,
            Self::Unauthorized,
            Self::Unknown,
            Self::Panics,
            Self::Fails,
            Self::Slow,
        ]
        .into_iter()
        .find(|behaviour| behaviour.name() == name)
    }

    /// Whether the layer stores this behaviour's answer (and may replay it).
    pub fn is_stored(self) -> bool {
        matches!(self, Self::Created | Self::BadRequest | Self::Slow)
    }

    fn draw(rng: &mut StdRng) -> Self {
        match rng.random_range(0..100) {
            0..50 => Self::Created,
            50..58 => Self::BadRequest,
            58..66 => Self::ServerError,
            66..71 => Self::Unauthorized,
            71..78 => Self::Unknown,
            78..83 => Self::Panics,
            83..88 => Self::Fails,
            _ => Self::Slow,
        }
    }
}

/// One request a client sends.
#[derive(Clone, Debug)]
pub struct Step {
    /// How long the client pauses before sending it.
    pub think: Duration,
    /// Which scope (0-based).
    pub scope: usize,
    /// Which key within the scope (0-based).
    pub key: usize,
    /// The body: "a" mostly (retries that replay), "b" sometimes (a reused key).
    pub body: &'static str,
    /// What the handler does.
    pub behaviour: Behaviour,
    /// How long the handler runs before it answers.
    pub handler_time: Duration,
    /// When the client stops waiting for the answer, if it does.
    pub gives_up_after: Option<Duration>,
}

/// Every client's requests for one seed.
pub fn plan(seed: u64, settings: &Settings) -> Vec<Vec<Step>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..settings.clients)
        .map(|_| {
            (0..settings.requests_per_client)
                .map(|_| {
                    let behaviour = Behaviour::draw(&mut rng);
                    let handler_time = if behaviour == Behaviour::Slow {
                        settings.lease * 3
                    } else {
                        settings.max_handler_time.mul_f64(rng.random())
                    };
                    Step {
                        think: settings.max_think.mul_f64(rng.random()),
                        scope: rng.random_range(0..settings.scopes),
                        key: rng.random_range(0..settings.keys),
                        body: if rng.random_bool(0.85) { "a" } else { "b" },
                        behaviour,
                        handler_time,
                        gives_up_after: rng
                            .random_bool(0.1)
                            .then(|| handler_time.mul_f64(rng.random())),
                    }
                })
                .collect()
        })
        .collect()
}
