//! A store of your own: the skeleton of a store over a `HashMap`, and the public
//! conformance suite run against it. Copy it, keep the rules, and put your
//! backend where the map is; the suite tells you whether you kept them.
//!
//! ```text
//! cargo run -p idempotency-core --features conformance --example custom_store
//! ```
//!
//! Everything comes from `idempotency-core` alone (it re-exports `async_trait` and
//! `Bytes`). A store implements three traits, one for each caller: [`IdempotencyStore`]
//! (the request path: what the layer calls), [`RecordAdmin`] (operators: inspect, evict)
//! and [`PurgeExpired`] (maintenance: delete expired records); a type with all three is a
//! [`FullStore`](idempotency_core::FullStore), which is what the suite runs against. The
//! rules are written on the [`IdempotencyStore`] trait: one clock, a record in flight
//! under a live lease never expires, tokens are never reused, the fenced operations act
//! only for the token that owns the record; and on [`RecordAdmin`] for the operators'
//! two.
//!
//! A service configured from properties opens the store its
//! `idempotency-store-type` names: the store reads its own `idempotency-*` keys from
//! the configuration's store properties, and refuses any key it does not take
//! (`MapStore::from_config` below).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idempotency_core::config::{ConfigError, IdempotencyConfig};
use idempotency_core::{
    Binding, EvictInFlight, Eviction, FencingToken, FullStore, IdempotencyRecord, IdempotencyStore,
    InspectedRecord, InspectedState, Ownership, PurgeExpired, Purged, RecordAdmin, RecordId,
    RecordState, Reservation, StoreError, StoredResponse, async_trait, conformance::Suite,
};
use tokio::time::Instant;

/// The store. A real one would hold a client for its database instead of the map.
#[derive(Default)]
struct MapStore {
    records: Mutex<HashMap<RecordId, Record>>,
    // Tokens are never reused for a key: a counter for the whole store does it here; a
    // shared database would use random 64-bit tokens or a sequence.
    last_token: AtomicI64,
    // The most live records the map holds (no bound by default): a reservation past it
    // fails with `StoreError::Full`, which the layer answers with 503.
    max_records: Option<usize>,
}

/// The store's name in `idempotency-store-type`: lowercase, one word.
const STORE_TYPE: &str = "custom";
/// The store's own key, `idempotency-<store type>-…` by convention: a positive integer.
const MAX_RECORDS: &str = "idempotency-custom-max-records";
/// Every key the store takes, besides the ones every store shares (which the core
/// reads: `idempotency_core::config::KEYS`).
const KEYS: [&str; 1] = [MAX_RECORDS];

impl MapStore {
    /// The store a properties configuration names (`idempotency-store-type=custom`).
    fn from_config(config: &IdempotencyConfig) -> Result<Self, ConfigError> {
        // One call checks that the configuration names this store and that every store
        // property is one of ours: a misspelt key, or another store's
        // (`idempotency-max-entries` is the memory store's), is refused with an error that
        // names it and our keys, instead of being silently ignored.
        let properties = config.store_properties_for(STORE_TYPE, &KEYS)?;
        Ok(Self {
            // The helpers name the key, the value and what is expected when it is bad.
            max_records: properties.positive_integer(MAX_RECORDS)?,
            ..Self::default()
        })
    }
}

struct Record {
    binding: Binding,
    in_flight: Option<(FencingToken, Instant)>, // the owner and its lease's end
    response: Option<StoredResponse>,           // set once finalized
    created_at: Instant,                        // kept by a takeover; for inspection
    expires_at: Instant,
}

impl Record {
    fn is_live(&self, now: Instant) -> bool {
        now < self.expires_at
    }

    fn owned_by(&self, token: FencingToken, now: Instant) -> bool {
        self.is_live(now) && matches!(self.in_flight, Some((owner, _)) if owner == token)
    }

    /// Leases the record to `token`; a record in flight under a live lease never expires.
    fn lease(&mut self, token: FencingToken, until: Instant) {
        self.in_flight = Some((token, until));
        self.expires_at = self.expires_at.max(until);
    }

    fn view(&self, now: Instant) -> IdempotencyRecord {
        let state = match (&self.response, self.in_flight) {
            (Some(response), _) => RecordState::Completed(response.clone()),
            (None, Some((token, lease_until))) => RecordState::InFlight {
                token,
                lease_lapsed: now >= lease_until,
            },
            (None, None) => unreachable!("a record is in flight or completed"),
        };
        IdempotencyRecord {
            binding: self.binding.clone(),
            state,
        }
    }

    /// The record as an operator sees it: never the stored response's headers or body.
    /// The map keeps tokio instants; an inspection shows them as wall-clock times (a
    /// database would select its timestamp columns and its own "now").
    fn inspect(&self, now: Instant) -> InspectedRecord {
        let wall_now = SystemTime::now();
        let wall = |at: Instant| {
            if at >= now {
                wall_now + (at - now)
            } else {
                wall_now - (now - at)
            }
        };
        let state = match (&self.response, self.in_flight) {
            (Some(response), _) => InspectedState::Completed {
                status: response.status,
            },
            (None, Some((_, lease_until))) => InspectedState::InFlight {
                lease_lapsed: now >= lease_until,
                lease_expires_at: Some(wall(lease_until)),
            },
            (None, None) => unreachable!("a record is in flight or completed"),
        };
        InspectedRecord {
            binding: self.binding.clone(),
            state,
            created_at: Some(wall(self.created_at)),
            expires_at: Some(wall(self.expires_at)),
            inspected_at: Some(wall_now),
        }
    }
}

impl MapStore {
    fn new_token(&self) -> FencingToken {
        FencingToken(self.last_token.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn records(&self) -> std::sync::MutexGuard<'_, HashMap<RecordId, Record>> {
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl IdempotencyStore for MapStore {
    async fn reserve(
        &self,
        id: &RecordId,
        binding: &Binding,
        lease: Duration,
        lifetime: Duration,
    ) -> Result<Reservation, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        if let Some(record) = records.get(id).filter(|r| r.is_live(now)) {
            return Ok(Reservation::Exists(record.view(now)));
        }
        let live = |records: &HashMap<RecordId, Record>| {
            records.values().filter(|r| r.is_live(now)).count()
        };
        if let Some(bound) = self.max_records.filter(|bound| live(&records) >= *bound) {
            return Err(StoreError::Full {
                bound: format!("{bound} records"),
                retry_after: None,
            });
        }
        let token = self.new_token();
        let mut record = Record {
            binding: binding.clone(),
            in_flight: None,
            response: None,
            created_at: now,
            expires_at: now + lifetime,
        };
        record.lease(token, now + lease);
        records.insert(id.clone(), record);
        Ok(Reservation::Reserved(token))
    }

    async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
        let now = Instant::now();
        Ok(self
            .records()
            .get(id)
            .filter(|r| r.is_live(now))
            .map(|r| r.view(now)))
    }

    async fn renew(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        match self.records().get_mut(id) {
            Some(record) if record.owned_by(token, now) => {
                record.lease(token, now + lease);
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
    }

    async fn finalize(
        &self,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        match self.records().get_mut(id) {
            Some(record) if record.owned_by(token, now) => {
                record.in_flight = None;
                record.response = Some(response.clone());
                Ok(Ownership::Held)
            }
            _ => Ok(Ownership::Lost),
        }
    }

    async fn release(&self, id: &RecordId, token: FencingToken) -> Result<Ownership, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        if records.get(id).is_some_and(|r| r.owned_by(token, now)) {
            records.remove(id);
            return Ok(Ownership::Held);
        }
        Ok(Ownership::Lost)
    }

    async fn take_over(
        &self,
        id: &RecordId,
        lapsed: FencingToken,
        lease: Duration,
    ) -> Result<Option<FencingToken>, StoreError> {
        let now = Instant::now();
        match self.records().get_mut(id) {
            Some(record)
                if record.is_live(now)
                    && matches!(record.in_flight, Some((owner, until)) if owner == lapsed && now >= until) =>
            {
                let token = self.new_token();
                record.lease(token, now + lease);
                Ok(Some(token))
            }
            _ => Ok(None),
        }
    }
    // `wait` keeps its default, which polls `load`; a store that can notify waiters
    // (LISTEN/NOTIFY, keyspace events) should override it.
}

#[async_trait]
impl RecordAdmin for MapStore {
    // For operators: read a record without its answer, and delete one on their order.
    async fn inspect(&self, id: &RecordId) -> Result<Option<InspectedRecord>, StoreError> {
        let now = Instant::now();
        Ok(self
            .records()
            .get(id)
            .filter(|r| r.is_live(now))
            .map(|r| r.inspect(now)))
    }

    async fn evict(&self, id: &RecordId, in_flight: EvictInFlight) -> Result<Eviction, StoreError> {
        let now = Instant::now();
        // One lock for the look and the delete, so the verdict is on the record as it
        // stands (a database deletes only the row version it read, and reads again if
        // that found nothing).
        let mut records = self.records();
        let Some(record) = records.get(id).filter(|r| r.is_live(now)) else {
            return Ok(Eviction::NotFound);
        };
        let inspected = record.inspect(now);
        if inspected.is_in_flight() && in_flight == EvictInFlight::Refuse {
            return Ok(Eviction::InFlight(inspected));
        }
        records.remove(id);
        Ok(Eviction::Evicted(inspected))
    }
}

#[async_trait]
impl PurgeExpired for MapStore {
    async fn purge_expired(&self, batch_size: usize) -> Result<Purged, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        let expired: Vec<RecordId> = records
            .iter()
            .filter(|(_, record)| !record.is_live(now))
            .map(|(id, _)| id.clone())
            .take(batch_size)
            .collect();
        for id in &expired {
            records.remove(id);
        }
        Ok(Purged::Deleted(expired.len() as u64))
    }
}

async fn check() {
    // Opened as a service configured from properties opens it.
    let config = IdempotencyConfig::from_properties([("idempotency-store-type", STORE_TYPE)])
        .expect("the configuration is valid");
    let store = MapStore::from_config(&config).unwrap_or_else(|error| panic!("{error}"));
    let store: Arc<dyn FullStore> = Arc::new(store);
    // Every check that applies to a store with all three traits; a store with the
    // request path alone runs `Suite::new(store)`, which skips the operators' and the
    // purge checks and says so.
    // A store shared by several processes also gives the suite a second handle on its
    // backend, for the multi-node checks; a second handle on one map stands in here.
    let report = Suite::full(store.clone())
        .with_second_node(store)
        .run()
        .await;
    assert!(report.skipped.is_empty(), "{report}");
}

#[tokio::main]
async fn main() {
    check().await;
    println!("MapStore passes the conformance suite");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_skeleton_store_passes_the_conformance_suite() {
        super::check().await;
    }

    #[tokio::test]
    async fn the_store_reads_its_own_keys_and_refuses_the_others() {
        let config = IdempotencyConfig::from_properties([
            ("idempotency-enabled", "true"),
            ("idempotency-store-type", "custom"),
            ("idempotency-custom-max-records", "1"),
        ])
        .unwrap();
        let store = MapStore::from_config(&config).unwrap();
        assert_eq!(store.max_records, Some(1));
        let binding = Binding {
            method: "POST".into(),
            path: "/x".into(),
            body_sha256: [0; 32],
        };
        let long = Duration::from_secs(60);
        let (a, b) = (RecordId::new("", "a"), RecordId::new("", "b"));
        let first = store.reserve(&a, &binding, long, long).await;
        assert!(matches!(first, Ok(Reservation::Reserved(_))));
        let second = store.reserve(&b, &binding, long, long).await;
        assert!(matches!(second, Err(StoreError::Full { .. })));

        let refused = |pairs: &[(&str, &str)]| match MapStore::from_config(
            &IdempotencyConfig::from_properties(pairs.iter().copied()).unwrap(),
        ) {
            Ok(_) => panic!("{pairs:?} was accepted"),
            Err(error) => error.to_string(),
        };
        // A misspelt key, and another store's.
        for key in ["idempotency-custom-max-record", "idempotency-max-entries"] {
            let message = refused(&[("idempotency-store-type", "custom"), (key, "10")]);
            assert!(message.contains(&format!("`{key}`")), "{message}");
            assert!(
                message.contains("idempotency-store-type=custom"),
                "{message}"
            );
            assert!(message.contains(MAX_RECORDS), "{message}");
        }
        let message = refused(&[
            ("idempotency-store-type", "custom"),
            ("idempotency-custom-max-records", "none"),
        ]);
        assert!(message.contains("positive integer"), "{message}");
        // Another store type (the default is `memory`) is not this store's.
        let message = refused(&[]);
        assert!(message.contains("`idempotency-store-type`"), "{message}");
    }

    /// A store that implements the request path alone runs the checks that apply to it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_request_path_store_runs_the_checks_that_apply() {
        let report = Suite::new(Arc::new(MapStore::default())).run().await;
        assert!(report.ran.contains(&"finalize_then_replay"), "{report}");
        assert!(
            report
                .ran
                .contains(&"through_layer::a_waiting_retry_never_gets_another_requests_answer"),
            "{report}"
        );
        let skipped: Vec<_> = report.skipped.iter().map(|(check, _)| *check).collect();
        assert!(skipped.contains(&"evict_wakes_waiters"), "{report}");
        assert!(
            skipped.contains(&"purge_removes_expired_in_batches"),
            "{report}"
        );
    }

    /// `MapStore`'s request path with the operators' trait at its defaults (`inspect`
    /// tells no times, `evict` answers `Unsupported`), and, if `keeps_released_keys`, a
    /// `release` that answers `Held` without letting the key go.
    #[derive(Default)]
    struct DefaultAdmin {
        store: MapStore,
        keeps_released_keys: bool,
    }

    #[async_trait]
    impl IdempotencyStore for DefaultAdmin {
        async fn reserve(
            &self,
            id: &RecordId,
            binding: &Binding,
            lease: Duration,
            lifetime: Duration,
        ) -> Result<Reservation, StoreError> {
            self.store.reserve(id, binding, lease, lifetime).await
        }

        async fn load(&self, id: &RecordId) -> Result<Option<IdempotencyRecord>, StoreError> {
            self.store.load(id).await
        }

        async fn renew(
            &self,
            id: &RecordId,
            token: FencingToken,
            lease: Duration,
        ) -> Result<Ownership, StoreError> {
            self.store.renew(id, token, lease).await
        }

        async fn finalize(
            &self,
            id: &RecordId,
            token: FencingToken,
            response: &StoredResponse,
        ) -> Result<Ownership, StoreError> {
            self.store.finalize(id, token, response).await
        }

        async fn release(
            &self,
            id: &RecordId,
            token: FencingToken,
        ) -> Result<Ownership, StoreError> {
            if self.keeps_released_keys {
                return Ok(Ownership::Held);
            }
            self.store.release(id, token).await
        }

        async fn take_over(
            &self,
            id: &RecordId,
            lapsed: FencingToken,
            lease: Duration,
        ) -> Result<Option<FencingToken>, StoreError> {
            self.store.take_over(id, lapsed, lease).await
        }
    }

    impl RecordAdmin for DefaultAdmin {}

    /// A store whose `RecordAdmin` keeps the trait's defaults is found out, and still
    /// gets every other check, the operators' checks it can pass included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_store_without_eviction_or_timed_inspection_runs_everything_else() {
        let store = Arc::new(DefaultAdmin::default());
        let report = Suite::new(store.clone()).with_admin(store).run().await;
        let skipped: Vec<_> = report.skipped.iter().map(|(check, _)| *check).collect();
        assert_eq!(
            skipped,
            [
                "purge_removes_expired_in_batches",
                "in_flight_record_outlives_its_lifetime_under_a_live_lease",
                "check_random_sequences",
                "inspect_shows_state_and_times_without_the_body",
                "evict_deletes_a_completed_record_and_the_key_runs_again",
                "evict_refuses_an_in_flight_record_unless_forced",
                "evict_of_an_absent_or_expired_record_finds_nothing",
                "evict_wakes_waiters",
                "evict_never_acts_on_a_stale_verdict",
                "two_nodes_race_one_winner",
                "takeover_across_nodes",
                "concurrent_purges",
            ],
            "{report}"
        );
        assert!(report.ran.contains(&"finalize_then_replay"), "{report}");
        assert!(
            report.ran.contains(&"nothing_outlives_its_request"),
            "{report}"
        );
    }

    /// A failing check says which check, on which store, and at which step.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_failure_names_the_check_the_store_and_the_step() {
        let store = Arc::new(DefaultAdmin {
            keeps_released_keys: true,
            ..DefaultAdmin::default()
        });
        let suite = Suite::new(store)
            .with_store_name("a store that keeps released keys")
            .only("release_frees_the_key");
        let failure = tokio::spawn(suite.run())
            .await
            .expect_err("the check fails")
            .into_panic();
        let message = failure
            .downcast_ref::<String>()
            .expect("a formatted message");
        assert!(
            message.starts_with(
                "conformance: check `release_frees_the_key` failed on a store that keeps \
                 released keys: "
            ),
            "{message}"
        );
        assert!(message.contains("release"), "the step: {message}");
    }

    /// One check runs alone by its name; a name the suite does not know is refused with
    /// the names it knows.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_check_runs_by_its_name() {
        let store = Arc::new(MapStore::default());
        let report = Suite::full(store.clone())
            .only("evict_wakes_waiters")
            .run()
            .await;
        assert_eq!(report.ran, ["evict_wakes_waiters"]);
        assert!(report.skipped.is_empty(), "{report}");
        let unknown = tokio::spawn(Suite::full(store).only("no_such_check").run())
            .await
            .expect_err("an unknown check's name fails the run");
        let message = unknown.into_panic();
        let message = message
            .downcast_ref::<String>()
            .expect("a formatted message");
        assert!(message.contains("\"no_such_check\""), "{message}");
        assert!(message.contains("finalize_is_fenced"), "{message}");
    }
}
