//! [`Settings`]: everything a layer was configured with, shared by every service it
//! makes and read by every stage of a keyed request. It sits below the layer (which
//! builds it) and the service (which reads it), so that nothing imports upward.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Response, StatusCode};
use tokio_util::task::TaskTracker;

use crate::budget::MemoryBudget;
use crate::decisions::{Advertise, ClassifyAnswer, KeepAnswer, ReplayAnswer, RouteFilter};
use crate::key::KeyFormat;
use crate::payload_key::PayloadKey;
use crate::policy::ScopeExtractor;
use crate::rejection::{ErrorRenderer, Rejection};
use crate::store::{IdempotencyStore, LogHash, RecordId};

/// How long a record is kept, from its first submission, by default: 30 minutes.
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(30 * 60);
/// How long an owner's lease lasts between renewals, by default: 20 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(20);
/// How long a duplicate waits for an in-flight owner, by default: 10 seconds.
pub const DEFAULT_IN_FLIGHT_WAIT: Duration = Duration::from_secs(10);
/// The largest request body buffered (and fingerprinted), by default: 8 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 8 * 1024 * 1024;
/// The largest response body stored for replay, by default: 8 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 8 * 1024 * 1024;
/// All the bytes of bodies the layer holds at once, by default: 256 MiB.
pub const DEFAULT_MEMORY_BUDGET: usize = 256 * 1024 * 1024;
/// How long a keyed request's body may take to arrive, by default: 30 seconds.
pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything the service needs, shared by every clone of it.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    // The protocol's decisions, one slot each (see `profile`).
    pub(crate) routes: Arc<dyn RouteFilter>,
    pub(crate) key_format: Arc<dyn KeyFormat>,
    pub(crate) classifier: Arc<dyn ClassifyAnswer>,
    pub(crate) keeper: Arc<dyn KeepAnswer>,
    pub(crate) replayer: Arc<dyn ReplayAnswer>,
    pub(crate) renderer: Arc<dyn ErrorRenderer>,
    pub(crate) advertiser: Option<Arc<dyn Advertise>>,
    pub(crate) payload_key: Option<Arc<dyn PayloadKey>>,
    pub(crate) scope: Arc<dyn ScopeExtractor>,
    /// Whether the user chose the scope (`with_scope`), which decides how a request
    /// without one is explained.
    pub(crate) scope_chosen: bool,
    /// A request without a scope is a misconfiguration, logged once per layer.
    pub(crate) no_scope_logged: Arc<std::sync::Once>,
    pub(crate) lifetime: Duration,
    pub(crate) grace_period: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight_wait: Duration,
    pub(crate) in_flight_status: StatusCode,
    pub(crate) key_reused_status: StatusCode,
    pub(crate) not_stored_status: StatusCode,
    pub(crate) retry_after: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) request_body_timeout: Duration,
    pub(crate) memory: Arc<MemoryBudget>,
    pub(crate) max_response_body: usize,
    pub(crate) release_statuses: Vec<StatusCode>,
    pub(crate) replayed_headers: Vec<HeaderName>,
    pub(crate) require_key: bool,
    pub(crate) forward_key: bool,
    pub(crate) fail_open: bool,
    pub(crate) finalize_retry_for: Duration,
    pub(crate) max_run_time: Option<Duration>,
    pub(crate) in_flight: TaskTracker,
    /// Whether outcomes, store calls and waits are recorded as [metrics](crate::metrics).
    pub(crate) metrics: bool,
}

impl Settings {
    pub(crate) fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        self.renderer.render(rejection)
    }

    /// How long a record is kept: the lifetime plus the grace period.
    pub(crate) fn kept_for(&self) -> Duration {
        self.lifetime + self.grace_period
    }

    /// A key as logs show it: a short hash of scope and key, never the key itself (a key
    /// is what collects a response, and a client-chosen string must not forge log fields).
    pub(crate) fn log_key<'a>(&self, id: &'a RecordId) -> LogHash<'a> {
        LogHash(id)
    }

    /// The lease the owner holds: never longer than the time a record is kept, so that a
    /// record lives its lifetime and no longer (a store keeps a record at least until the
    /// lease it granted ends).
    pub(crate) fn lease(&self) -> Duration {
        self.lease.min(self.kept_for()).max(MIN_LEASE)
    }
}

/// The shortest lease: shorter ones would be renewed more often than a store can answer.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(30);
