//! The metrics the layer records, through the [`metrics`](https://docs.rs/metrics) facade.
//!
//! The layer records to whatever recorder the application installed (a Prometheus or
//! OpenTelemetry exporter, say), and to nothing when none is: without a recorder each
//! record costs one look-up of the recorder and a call into the facade's no-op one, with
//! no allocation (every metric key the layer uses is a `static`).
//!
//! | name | kind, unit | labels | what it counts |
//! |---|---|---|---|
//! | [`idempotency.requests`](REQUESTS) | counter | [`idempotency.outcome`](OUTCOME), and [`idempotency.rejection`](REJECTION) on refusals | keyed requests, by what the layer did with them |
//! | [`idempotency.store.duration`](STORE_DURATION) | histogram, seconds | [`idempotency.operation`](OPERATION), [`idempotency.store.result`](STORE_RESULT) | each store call the layer (and [`purge_all_expired`](crate::purge_all_expired)) makes |
//! | [`idempotency.wait.duration`](WAIT_DURATION) | histogram, seconds | none | how long duplicates waited for an in-flight owner |
//! | [`idempotency.records.purged`](RECORDS_PURGED) | counter | none | expired records deleted by [`purge_all_expired`](crate::purge_all_expired) (and so by the purge task) |
//!
//! The label values are the stable names the logs use too: [`Outcome::as_str`]
//! (`executed`, `took-over`, `released`, `executed-not-stored`, `replayed`,
//! `ran-unprotected`, `rejected`) and [`RejectionKind::as_str`] (`key-reused`, `in-flight`,
//! `store-unavailable`, …). The usual names for these outcomes map onto them:
//! *conflict* is `rejected` with `in-flight`, *taken_over* is `took-over`, *fail_open* is
//! `ran-unprotected`. No label ever carries a key, a scope, a path or a tenant: they
//! would leak one caller's data to whoever reads the dashboards, and give every key a
//! time series of its own.
//!
//! Exporters rewrite the dotted names to their own conventions. Prometheus' naming
//! conventions, as an OpenTelemetry-to-Prometheus exporter writes them (and
//! `metrics-exporter-prometheus` with `with_recommended_naming(true)`): counters end in
//! `_total` and durations carry their unit, so `idempotency_requests_total`,
//! `idempotency_store_duration_seconds`, `idempotency_wait_duration_seconds` and
//! `idempotency_records_purged_total`, with labels such as `idempotency_outcome`.
//!
//! ```
//! // After installing a recorder, give the metrics their descriptions and units:
//! idempotency_core::metrics::describe();
//! ```
//!
//! A layer built with [`with_metrics(false)`](crate::IdempotencyLayer::with_metrics)
//! records no metric at all and reads no clock for them.

use std::future::Future;
use std::time::{Duration, Instant};

use ::metrics::{Key, Label, Level, Metadata, Unit};

use crate::outcome::Outcome;
use crate::rejection::RejectionKind;
use crate::settings::Settings;
use crate::store::StoreError;

/// Counter: keyed requests, by [`OUTCOME`] (and [`REJECTION`] when refused).
pub const REQUESTS: &str = "idempotency.requests";
/// Histogram (seconds): store calls, by [`OPERATION`] and [`STORE_RESULT`].
pub const STORE_DURATION: &str = "idempotency.store.duration";
/// Histogram (seconds): how long a duplicate waited for the key's in-flight owner.
pub const WAIT_DURATION: &str = "idempotency.wait.duration";
/// Counter: expired records deleted by [`purge_all_expired`](crate::purge_all_expired).
pub const RECORDS_PURGED: &str = "idempotency.records.purged";

/// Label of [`REQUESTS`]: [`Outcome::as_str`].
pub const OUTCOME: &str = "idempotency.outcome";
/// Label of [`REQUESTS`] when the outcome is `rejected`: [`RejectionKind::as_str`].
pub const REJECTION: &str = "idempotency.rejection";
/// Label of [`STORE_DURATION`]: `reserve`, `renew`, `hold`, `finalize`, `release`, `take-over`
/// or `purge`.
pub const OPERATION: &str = "idempotency.operation";
/// Label of [`STORE_DURATION`]: `ok`, or `error` when the store returned an error.
pub const STORE_RESULT: &str = "idempotency.store.result";

/// Gives the layer's metrics their descriptions and units in the installed recorder (a
/// Prometheus exporter prints them as `# HELP` lines). Call it after installing the
/// recorder; without one it does nothing. Each [`IdempotencyLayer`](crate::IdempotencyLayer)
/// calls it when it is made, too.
pub fn describe() {
    ::metrics::describe_counter!(
        REQUESTS,
        Unit::Count,
        "Keyed requests the idempotency layer took part in, by what it did \
         (idempotency.outcome) and, for refusals, why (idempotency.rejection)"
    );
    ::metrics::describe_histogram!(
        STORE_DURATION,
        Unit::Seconds,
        "Idempotency store calls, by operation and result"
    );
    ::metrics::describe_histogram!(
        WAIT_DURATION,
        Unit::Seconds,
        "How long a duplicate request waited for the in-flight owner of its key"
    );
    ::metrics::describe_counter!(
        RECORDS_PURGED,
        Unit::Count,
        "Expired idempotency records deleted by the purge"
    );
}

/// A store call the layer times.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StoreCall {
    Reserve,
    Renew,
    Hold,
    Finalize,
    Release,
    TakeOver,
    Purge,
}

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// A `&'static Key` with static labels: built at compile time, so recording one never
/// allocates.
macro_rules! key {
    ($name:expr $(, $label:expr => $value:expr)*) => {{
        static LABELS: &[Label] = &[$(Label::from_static_parts($label, $value)),*];
        static KEY: Key = Key::from_static_parts($name, LABELS);
        &KEY
    }};
}

fn request_key(outcome: Outcome) -> &'static Key {
    macro_rules! rejected {
        ($kind:literal) => {
            key!(REQUESTS, OUTCOME => "rejected", REJECTION => $kind)
        };
    }
    match outcome {
        Outcome::Executed => key!(REQUESTS, OUTCOME => "executed"),
        Outcome::TookOver => key!(REQUESTS, OUTCOME => "took-over"),
        Outcome::Released => key!(REQUESTS, OUTCOME => "released"),
        Outcome::Unsettled => key!(REQUESTS, OUTCOME => "unsettled"),
        Outcome::Unknown => key!(REQUESTS, OUTCOME => "unknown"),
        Outcome::ExecutedNotStored => key!(REQUESTS, OUTCOME => "executed-not-stored"),
        Outcome::Replayed => key!(REQUESTS, OUTCOME => "replayed"),
        Outcome::RanUnprotected => key!(REQUESTS, OUTCOME => "ran-unprotected"),
        Outcome::Rejected(kind) => match kind {
            RejectionKind::MissingKey => rejected!("missing-key"),
            RejectionKind::InvalidKey => rejected!("invalid-key"),
            RejectionKind::DuplicateKeyHeader => rejected!("duplicate-key-header"),
            RejectionKind::NoScope => rejected!("no-scope"),
            RejectionKind::KeyReused => rejected!("key-reused"),
            RejectionKind::BodyTooLarge => rejected!("body-too-large"),
            RejectionKind::UnreadableBody => rejected!("unreadable-body"),
            RejectionKind::BodyTimeout => rejected!("body-timeout"),
            RejectionKind::OverBudget => rejected!("over-budget"),
            RejectionKind::InFlight => rejected!("in-flight"),
            RejectionKind::StoreUnavailable => rejected!("store-unavailable"),
            RejectionKind::StoreFull => rejected!("store-full"),
            RejectionKind::QuotaExceeded => rejected!("quota-exceeded"),
            RejectionKind::ResponseNotStored => rejected!("response-not-stored"),
            RejectionKind::ResponseFailed => rejected!("response-failed"),
        },
    }
}

fn store_key(call: StoreCall, ok: bool) -> &'static Key {
    macro_rules! by_result {
        ($operation:literal) => {
            if ok {
                key!(STORE_DURATION, OPERATION => $operation, STORE_RESULT => "ok")
            } else {
                key!(STORE_DURATION, OPERATION => $operation, STORE_RESULT => "error")
            }
        };
    }
    match call {
        StoreCall::Reserve => by_result!("reserve"),
        StoreCall::Renew => by_result!("renew"),
        StoreCall::Hold => by_result!("hold"),
        StoreCall::Finalize => by_result!("finalize"),
        StoreCall::Release => by_result!("release"),
        StoreCall::TakeOver => by_result!("take-over"),
        StoreCall::Purge => by_result!("purge"),
    }
}

/// What the layer did with a keyed request: recorded on the request's span (`outcome`)
/// and counted.
pub(crate) fn outcome(settings: &Settings, outcome: Outcome) {
    // The span exists only when a subscriber wants INFO (see `keyed::begin`).
    if tracing::level_enabled!(tracing::Level::INFO) {
        tracing::Span::current().record("outcome", tracing::field::display(outcome));
    }
    if settings.metrics {
        count_request(outcome);
    }
}

/// Counts an outcome decided outside the request's span (a bad key header is refused
/// before there is a key to make one for).
pub(crate) fn count(settings: &Settings, outcome: Outcome) {
    if settings.metrics {
        count_request(outcome);
    }
}

fn count_request(outcome: Outcome) {
    ::metrics::with_recorder(|recorder| {
        recorder
            .register_counter(request_key(outcome), &METADATA)
            .increment(1);
    });
}

/// Runs one store call, timing it as [`STORE_DURATION`] when the layer records metrics.
pub(crate) async fn store_call<T>(
    settings: &Settings,
    call: StoreCall,
    operation: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    if !settings.metrics {
        return operation.await;
    }
    let started = Instant::now();
    let result = operation.await;
    store_duration(call, result.is_ok(), started.elapsed());
    result
}

/// [`store_call`] for a store that answers at once ([`IdempotencyStore::reserve_now`]
/// and the like): `None`, and nothing recorded, when the store has to be awaited.
///
/// [`IdempotencyStore::reserve_now`]: crate::IdempotencyStore::reserve_now
pub(crate) fn store_call_now<T>(
    settings: &Settings,
    call: StoreCall,
    operation: impl FnOnce() -> Option<Result<T, StoreError>>,
) -> Option<Result<T, StoreError>> {
    if !settings.metrics {
        return operation();
    }
    let started = Instant::now();
    let result = operation()?;
    store_duration(call, result.is_ok(), started.elapsed());
    Some(result)
}

pub(crate) fn store_duration(call: StoreCall, ok: bool, took: Duration) {
    ::metrics::with_recorder(|recorder| {
        recorder
            .register_histogram(store_key(call, ok), &METADATA)
            .record(took.as_secs_f64());
    });
}

pub(crate) fn wait_duration(settings: &Settings, waited: Duration) {
    if settings.metrics {
        ::metrics::with_recorder(|recorder| {
            recorder
                .register_histogram(key!(WAIT_DURATION), &METADATA)
                .record(waited.as_secs_f64());
        });
    }
}

pub(crate) fn records_purged(deleted: u64) {
    ::metrics::with_recorder(|recorder| {
        recorder
            .register_counter(key!(RECORDS_PURGED), &METADATA)
            .increment(deleted);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The static keys carry exactly the stable names of `Outcome::as_str` and
    /// `RejectionKind::as_str`, so logs and metrics speak one vocabulary.
    #[test]
    fn request_labels_are_the_outcome_and_rejection_names() {
        let kinds = [
            RejectionKind::MissingKey,
            RejectionKind::InvalidKey,
            RejectionKind::DuplicateKeyHeader,
            RejectionKind::NoScope,
            RejectionKind::KeyReused,
            RejectionKind::BodyTooLarge,
            RejectionKind::UnreadableBody,
            RejectionKind::BodyTimeout,
            RejectionKind::OverBudget,
            RejectionKind::InFlight,
            RejectionKind::StoreUnavailable,
            RejectionKind::StoreFull,
            RejectionKind::QuotaExceeded,
            RejectionKind::ResponseNotStored,
            RejectionKind::ResponseFailed,
        ];
        let outcomes = [
            Outcome::Executed,
            Outcome::TookOver,
            Outcome::Released,
            Outcome::Unsettled,
            Outcome::Unknown,
            Outcome::ExecutedNotStored,
            Outcome::Replayed,
            Outcome::RanUnprotected,
        ]
        .into_iter()
        .chain(kinds.into_iter().map(Outcome::Rejected));
        for outcome in outcomes {
            let key = request_key(outcome);
            assert_eq!(key.name(), REQUESTS);
            let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
            let mut expected = vec![(OUTCOME, outcome.as_str())];
            if let Outcome::Rejected(kind) = outcome {
                expected.push((REJECTION, kind.as_str()));
            }
            assert_eq!(labels, expected, "{outcome}");
        }
    }
}
