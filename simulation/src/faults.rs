//! The store as the layer meets it in the simulation: the real store behind a wrapper
//! that records every call in the history and, by the run's seed, makes some of them
//! slow, fail before they reach the store, or lose the store's answer after the store
//! did the work (the layer then sees an error for a change that happened).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idempotency_core::{
    FencingToken, IdempotencyRecord, IdempotencyStore, Ownership, RecordId, RecordState,
    Reservation, StoreError, StoredResponse, Waited,
};
use rand::Rng;
use rand::rngs::StdRng;

use crate::history::{Event, Fault, History, KeyOf, StoreCall, StoreResult};

/// How often the wrapper injects each fault, per store call.
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    /// The call fails before it reaches the store.
    pub error_before: f64,
    /// The store does the call and its answer is lost.
    pub answer_lost: f64,
    /// The call is delayed by up to [`max_latency`](Self::max_latency).
    pub slow: f64,
    /// The longest injected delay.
    pub max_latency: Duration,
    /// The call stalls for one to two leases (a network stall, a paused process): the
    /// owner's lease may lapse meanwhile while its handler runs on.
    pub stall: f64,
    /// How long a stall lasts at least (the layer's lease); up to twice that.
    pub stall_for: Duration,
}

impl Faults {
    /// No faults at all.
    pub const NONE: Faults = Faults {
        error_before: 0.0,
        answer_lost: 0.0,
        slow: 0.0,
        max_latency: Duration::ZERO,
        stall: 0.0,
        stall_for: Duration::ZERO,
    };
}

/// The wrapper: `inner` is the store under test.
pub(crate) struct FaultyStore {
    inner: Arc<dyn IdempotencyStore>,
    faults: Faults,
    /// Off in the quiet phase, so that the final checks see the store as it is.
    enabled: AtomicBool,
    rng: Mutex<StdRng>,
    history: Arc<History>,
    /// The store holds its reservations unseen, in a transaction of its own.
    reservations_unseen: bool,
}

impl FaultyStore {
    pub(crate) fn new(
        inner: Arc<dyn IdempotencyStore>,
        faults: Faults,
        rng: StdRng,
        history: Arc<History>,
        reservations_unseen: bool,
    ) -> Self {
        Self {
            inner,
            faults,
            enabled: AtomicBool::new(true),
            rng: Mutex::new(rng),
            history,
            reservations_unseen,
        }
    }

    pub(crate) fn disable_faults(&self) {
        self.enabled.store(false, Ordering::SeqCst);
    }

    /// Draws this call's fault and delay.
    fn draw(&self) -> (Fault, Duration) {
        if !self.enabled.load(Ordering::SeqCst) {
            return (Fault::None, Duration::ZERO);
        }
        let mut rng = self.rng.lock().expect("rng lock");
        let roll: f64 = rng.random();
        let fault = if roll < self.faults.error_before {
            Fault::ErrorBefore
        } else if roll < self.faults.error_before + self.faults.answer_lost {
            Fault::AnswerLost
        } else {
            Fault::None
        };
        let delay =
            if self.faults.max_latency > Duration::ZERO && rng.random::<f64>() < self.faults.slow {
                self.faults.max_latency.mul_f64(rng.random())
            } else {
                Duration::ZERO
            };
        let stall = if rng.random::<f64>() < self.faults.stall {
            self.faults.stall_for.mul_f64(1.0 + rng.random::<f64>())
        } else {
            Duration::ZERO
        };
        (fault, delay + stall)
    }

    /// Runs one call through the fault plan and records it. `summary` says what the
    /// store's answer was.
    async fn call<T, F>(
        &self,
        operation: &'static str,
        id: &RecordId,
        token: Option<FencingToken>,
        lease: Option<Duration>,
        call: F,
        summary: impl Fn(&T) -> StoreResult,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let (mut fault, delay) = self.draw();
        let started = self.history.now();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let (answer, result) = if fault == Fault::ErrorBefore {
            (None, StoreResult::NotCalled)
        } else {
            match call.await {
                Ok(answer) => {
                    let result = match summary(&answer) {
                        StoreResult::Reserved(token) if self.reservations_unseen => {
                            StoreResult::ReservedUncommitted(token)
                        }
                        result => result,
                    };
                    // An uncommitted reservation lives in the store's process: its answer
                    // cannot be lost on the way to the layer without the store knowing.
                    if let StoreResult::ReservedUncommitted(_) = result {
                        fault = Fault::None;
                    }
                    (Some(Ok(answer)), result)
                }
                Err(error) => (Some(Err(error)), StoreResult::Error),
            }
        };
        self.history.push(Event::Store(StoreCall {
            operation,
            key: KeyOf {
                scope: id.scope.clone(),
                key: id.key.clone(),
            },
            token: token.map(|token| token.0),
            lease,
            started,
            ended: self.history.now(),
            fault,
            delayed: delay,
            result,
        }));
        match (fault, answer) {
            (Fault::None, Some(answer)) => answer,
            _ => Err(StoreError::backend(format!(
                "injected fault ({operation}): {}",
                if fault == Fault::ErrorBefore {
                    "failed before the store"
                } else {
                    "the store's answer was lost"
                }
            ))),
        }
    }
}

fn record_result(record: &IdempotencyRecord) -> StoreResult {
    match &record.state {
        RecordState::InFlight { token, .. } => StoreResult::InFlight(token.0),
        RecordState::Completed(_) => StoreResult::Completed,
    }
}

fn ownership(answer: &Ownership) -> StoreResult {
    match answer {
        Ownership::Held => StoreResult::Held,
        Ownership::Lost => StoreResult::Lost,
    }
}

fn reservation(answer: &Reservation) -> StoreResult {
    match answer {
        Reservation::Reserved(token) => StoreResult::Reserved(token.0),
        Reservation::Exists(record) => record_result(record),
        Reservation::Busy => StoreResult::Busy,
    }
}

#[async_trait]
impl IdempotencyStore for FaultyStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &idempotency_core::Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let call = self.inner.reserve(id, binding, lease, lifetime);
        self.call("reserve", id, None, Some(lease), call, reservation)
            .await
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let call = self.inner.load(id);
        self.call("load", id, None, None, call, |record| {
            record.as_ref().map_or(StoreResult::Absent, record_result)
        })
        .await
    }

    async fn wait(&self, id: &RecordId, timeout: Duration) -> Result<Waited, StoreError> {
        let call = self.inner.wait(id, timeout);
        self.call("wait", id, None, None, call, |waited| match waited {
            Waited::Settled(record) | Waited::Running(Some(record)) => record_result(record),
            Waited::Running(None) => StoreResult::Busy,
            Waited::Gone => StoreResult::Absent,
        })
        .await
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        let call = self.inner.renew(id, token, lease);
        self.call("renew", id, Some(token), Some(lease), call, ownership)
            .await
    }

    async fn hold(
        &self,
        id: &RecordId,
        token: FencingToken,
        kept_for: Duration,
    ) -> Result<Ownership, StoreError> {
        let call = self.inner.hold(id, token, kept_for);
        self.call("hold", id, Some(token), Some(kept_for), call, ownership)
            .await
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let call = self.inner.finalize(id, token, response);
        self.call("finalize", id, Some(token), None, call, ownership)
            .await
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let call = self.inner.release(id, token);
        self.call("release", id, Some(token), None, call, ownership)
            .await
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        let call = self.inner.take_over(id, lapsed, lease);
        self.call("take_over", id, Some(lapsed), Some(lease), call, |token| {
            StoreResult::TookOver(token.map(|token| token.0))
        })
        .await
    }
    // No `reserve_now` / `finalize_now`: every call goes through the fault plan.
}
