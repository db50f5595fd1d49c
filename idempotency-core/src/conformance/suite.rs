//! [`Suite`]: every check that applies to a store, in one call.

use std::fmt;
use std::sync::Arc;

use super::model::check_random_sequences;
use super::*;
use futures_util::FutureExt;

use crate::store::{EvictInFlight, Eviction};

/// The checks that apply to a store, run one after another: the one way a store runs the
/// contract, so that a check added, split or renamed in a new release reaches every
/// store that runs the suite, with no edit of its tests.
///
/// Built from the capabilities the store has: the request path always
/// ([`Suite::new`]), [`RecordAdmin`] and [`PurgeExpired`] when given
/// ([`with_admin`](Self::with_admin), [`with_purge`](Self::with_purge), or all three with
/// [`Suite::full`]). What a store does not do is found out, never assumed, and the
/// checks that need it are skipped by name, with the reason, in the [`Report`]:
///
/// - whether its reservations have a lease, from its first reservation: one that a
///   duplicate's reserve sees as a record has one; one that it is answered
///   [`Busy`](Reservation::Busy) about is held unseen (in the owner's transaction), and
///   is not asked to lapse or be taken over, nor to be shown to anyone;
/// - whether it can evict (the trait's default `evict` answers
///   [`StoreError::Unsupported`](crate::StoreError::Unsupported));
/// - whether its `inspect` tells times (the trait's default leaves them `None`).
///
/// A failing check panics with a message that names the check, the store
/// ([`with_store_name`](Self::with_store_name)) and the step that failed. To run one
/// check alone while debugging, name it with [`only`](Self::only).
///
/// ```
/// # #[tokio::main(flavor = "multi_thread")]
/// # async fn main() {
/// use std::sync::Arc;
/// use idempotency_core::conformance::Suite;
/// use idempotency_store_memory::MemoryStore;
///
/// let store = Arc::new(MemoryStore::new());
/// // A store shared by replicas also names a second handle on its backend.
/// let report = Suite::full(store.clone()).with_second_node(store).run().await;
/// assert!(report.skipped.is_empty(), "{report}");
/// # }
/// ```
#[must_use = "a suite does nothing until it runs"]
pub struct Suite {
    store: Arc<dyn IdempotencyStore>,
    admin: Option<Arc<dyn RecordAdmin>>,
    purge: Option<Arc<dyn PurgeExpired>>,
    leftovers: Option<Arc<dyn Leftovers>>,
    second_node: Option<Arc<dyn PurgeExpired>>,
    store_name: String,
    only: Option<String>,
}

/// What a [`Suite`] ran, and what it skipped and why. Every check that ran passed (a
/// failing check panics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// The checks that ran, in order.
    pub ran: Vec<&'static str>,
    /// The checks that did not apply, with the reason.
    pub skipped: Vec<(&'static str, &'static str)>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} checks passed", self.ran.len())?;
        for (check, why) in &self.skipped {
            write!(f, "\n  skipped {check}: {why}")?;
        }
        Ok(())
    }
}

const NO_ADMIN: &str = "the store was given without RecordAdmin (Suite::with_admin)";
const NO_PURGE: &str = "the store was given without PurgeExpired (Suite::with_purge)";
const NO_LEASE: &str = "the store's reservations are held unseen until they commit: no lease to lapse or take over, and nobody else sees them";
const NO_SECOND_NODE: &str =
    "the store was given no second handle on its backend (Suite::with_second_node)";
const NO_EVICT: &str = "the store's RecordAdmin::evict answers Unsupported";
const NO_TIMES: &str =
    "the store's RecordAdmin::inspect tells no times (created_at, expires_at, inspected_at)";

impl Suite {
    /// The request-path checks, for a store that implements [`IdempotencyStore`] alone.
    pub fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            store,
            admin: None,
            purge: None,
            leftovers: None,
            second_node: None,
            store_name: "the store".to_owned(),
            only: None,
        }
    }

    /// Every check, for a store with every capability.
    pub fn full(store: Arc<dyn FullStore>) -> Self {
        Self {
            store: store.clone(),
            admin: Some(store.clone()),
            purge: Some(store),
            leftovers: None,
            second_node: None,
            store_name: "the store".to_owned(),
            only: None,
        }
    }

    /// Names the store in a failing check's message (default "the store"): useful where
    /// one test binary runs the suite on several stores or configurations.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idempotency_core::conformance::Suite;
    /// # use idempotency_store_memory::MemoryStore;
    /// let suite = Suite::full(Arc::new(MemoryStore::new())).with_store_name("memory, default settings");
    /// ```
    pub fn with_store_name(mut self, name: impl Into<String>) -> Self {
        self.store_name = name.into();
        self
    }

    /// Runs the check named `check` alone (as the [`Report`] names it), to debug it; the
    /// others are neither run nor reported. A name the suite does not know fails the run
    /// with the list of the names it knows.
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread")]
    /// # async fn main() {
    /// # use std::sync::Arc;
    /// # use idempotency_core::conformance::Suite;
    /// # use idempotency_store_memory::MemoryStore;
    /// let report = Suite::full(Arc::new(MemoryStore::new()))
    ///     .only("finalize_is_fenced")
    ///     .run()
    ///     .await;
    /// assert_eq!(report.ran, ["finalize_is_fenced"]);
    /// # }
    /// ```
    pub fn only(mut self, check: impl Into<String>) -> Self {
        self.only = Some(check.into());
        self
    }

    /// Adds the operators' checks (inspect, evict), run on `admin`: the same store.
    pub fn with_admin(mut self, admin: Arc<dyn RecordAdmin>) -> Self {
        self.admin = Some(admin);
        self
    }

    /// Adds the purge checks, run on `purge`: the same store.
    pub fn with_purge(mut self, purge: Arc<dyn PurgeExpired>) -> Self {
        self.purge = Some(purge);
        self
    }

    /// Adds a probe that sees what the store holds for requests (open transactions,
    /// pooled connections, claims): the suite then checks, after every kind of outcome a
    /// request can come to, that nothing is held once it is settled. A store that holds
    /// nothing per request (records in memory) needs none.
    pub fn with_leftovers(mut self, leftovers: Arc<dyn Leftovers>) -> Self {
        self.leftovers = Some(leftovers);
        self
    }

    /// Adds the checks for a store shared by several processes, run with `second_node` as
    /// a second replica: another handle on the same backend (its own pool or connection,
    /// the same table or key prefix), racing, taking over and purging beside the first.
    /// The concurrent purge also needs the first node's [`PurgeExpired`]
    /// ([`with_purge`](Self::with_purge) or [`Suite::full`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "multi_thread")]
    /// # async fn main() {
    /// # use std::sync::Arc;
    /// # use idempotency_core::conformance::Suite;
    /// # use idempotency_store_memory::MemoryStore;
    /// // Two handles on one map stand in for two pools on one database.
    /// let store = Arc::new(MemoryStore::new());
    /// let report = Suite::full(store.clone())
    ///     .with_second_node(store)
    ///     .only("two_nodes_race_one_winner")
    ///     .run()
    ///     .await;
    /// assert_eq!(report.ran, ["two_nodes_race_one_winner"]);
    /// # }
    /// ```
    pub fn with_second_node(mut self, second_node: Arc<dyn PurgeExpired>) -> Self {
        self.second_node = Some(second_node);
        self
    }

    /// Runs every check that applies, one after another; panics at the first that
    /// fails. The checks skipped are printed (to standard error) and reported.
    pub async fn run(self) -> Report {
        let leased = has_leases(self.store.as_ref()).await;
        let mut runner = Runner {
            report: Report::default(),
            known: Vec::new(),
            only: self.only.clone(),
            store_name: &self.store_name,
        };
        self.run_request_path(leased, &mut runner).await;
        self.run_purge(leased, &mut runner).await;
        self.run_admin(leased, &mut runner).await;
        self.run_multi_node(leased, &mut runner).await;
        let Runner {
            report,
            known,
            only,
            ..
        } = runner;
        if let Some(only) = only
            && !known.contains(&only.as_str())
        {
            panic!(
                "conformance: no check is named {only:?}; the suite's checks are: {}",
                known.join(", ")
            );
        }
        if !report.skipped.is_empty() {
            eprintln!("conformance ({}): {report}", self.store_name);
        }
        report
    }

    async fn run_request_path(&self, leased: bool, report: &mut Runner<'_>) {
        let store = &self.store;
        let always = Ok(());
        let lease = if leased { Ok(()) } else { Err(NO_LEASE) };
        macro_rules! check {
            ($applies:expr, $check:ident) => {
                report
                    .check(stringify!($check), $applies, $check(store))
                    .await
            };
        }
        check!(always, concurrent_reserves_from_tasks);
        check!(lease, reserve_then_load);
        check!(always, a_held_key_shows_its_owners_binding_or_busy);
        check!(always, concurrent_reserves_have_one_winner);
        check!(always, finalize_then_replay);
        check!(lease, finalize_is_fenced);
        check!(lease, release_frees_the_key);
        check!(lease, release_is_fenced);
        check!(lease, renew_extends_the_lease);
        check!(lease, repeated_renewals_are_held);
        check!(lease, lapsed_owner_may_finish_until_taken_over);
        check!(lease, lapsed_lease_is_taken_over_once);
        check!(lease, takeover_keeps_the_binding);
        check!(lease, live_lease_is_not_taken_over);
        check!(always, completed_record_is_not_taken_over);
        check!(always, tokens_are_never_reused);
        check!(always, expired_record_counts_as_absent);
        check!(lease, expired_reservation_fences_its_owner);
        check!(lease, renewals_keep_a_record_alive_past_its_lifetime);
        check!(always, a_held_key_stays_reserved_until_it_expires);
        check!(always, wait_returns_when_the_owner_finalizes);
        check!(always, wait_returns_when_the_owner_releases);
        check!(lease, wait_returns_when_the_lease_lapses);
        check!(always, wait_gives_up_after_the_timeout);
        check!(
            always,
            a_wait_sees_the_key_released_and_finished_by_another_request
        );
        check!(
            lease,
            a_wait_sees_the_key_released_and_left_by_another_request_whose_lease_lapses
        );
        check!(always, multi_megabyte_body_round_trips);
        check!(always, empty_response_without_headers_round_trips);
        check!(always, header_values_that_are_not_utf8_round_trip);
        check!(always, trailers_round_trip);
        check!(always, scopes_are_isolated);
        check!(always, scope_and_key_never_run_together);
        report
            .check(
                "through_layer::a_waiting_retry_never_gets_another_requests_answer",
                always,
                through_layer::a_waiting_retry_never_gets_another_requests_answer(store),
            )
            .await;
        report
            .check(
                "through_layer::work_runs_at_most_once",
                always,
                through_layer::work_runs_at_most_once(store),
            )
            .await;
        check!(always, an_unknown_outcome_frees_its_key_once_it_expires);
        report
            .check(
                "nothing_outlives_its_request",
                always,
                nothing_outlives_its_request(store, self.leftovers.as_deref()),
            )
            .await;
    }

    async fn run_purge(&self, leased: bool, report: &mut Runner<'_>) {
        let (purge, applies) = match &self.purge {
            Some(purge) => (Some(purge), Ok(())),
            None => (None, Err(NO_PURGE)),
        };
        let lease = applies.and(leased.then_some(()).ok_or(NO_LEASE));
        macro_rules! check {
            ($applies:expr, $check:ident, $($arg:expr),*) => {
                report
                    .check(stringify!($check), $applies, async {
                        $check(purge.expect("applies only with PurgeExpired"), $($arg),*).await
                    })
                    .await
            };
        }
        check!(applies, purge_removes_expired_in_batches,);
        check!(
            lease,
            in_flight_record_outlives_its_lifetime_under_a_live_lease,
        );
        check!(lease, check_random_sequences, 0, 20, 60);
    }

    async fn run_admin(&self, leased: bool, report: &mut Runner<'_>) {
        let (admin, applies) = match &self.admin {
            Some(admin) => (Some(admin), Ok(())),
            None => (None, Err(NO_ADMIN)),
        };
        let lease = applies.and(leased.then_some(()).ok_or(NO_LEASE));
        let (evicts, timed) = match admin {
            Some(admin) => (
                evicts(admin.as_ref()).await.then_some(()).ok_or(NO_EVICT),
                inspects_times(admin.as_ref())
                    .await
                    .then_some(())
                    .ok_or(NO_TIMES),
            ),
            None => (Ok(()), Ok(())),
        };
        let (applies_evicting, lease_evicting) = (applies.and(evicts), lease.and(evicts));
        macro_rules! check {
            ($applies:expr, $check:ident) => {
                report
                    .check(stringify!($check), $applies, async {
                        $check(admin.expect("applies only with RecordAdmin")).await
                    })
                    .await
            };
        }
        check!(
            lease.and(timed),
            inspect_shows_state_and_times_without_the_body
        );
        check!(
            applies_evicting,
            evict_deletes_a_completed_record_and_the_key_runs_again
        );
        check!(
            lease_evicting,
            evict_refuses_an_in_flight_record_unless_forced
        );
        check!(
            applies_evicting,
            evict_of_an_absent_or_expired_record_finds_nothing
        );
        check!(lease_evicting, evict_wakes_waiters);
        check!(lease_evicting, evict_never_acts_on_a_stale_verdict);
    }

    async fn run_multi_node(&self, leased: bool, report: &mut Runner<'_>) {
        let (second, applies) = match &self.second_node {
            Some(second) => (Some(second), Ok(())),
            None => (None, Err(NO_SECOND_NODE)),
        };
        let lease = applies.and(leased.then_some(()).ok_or(NO_LEASE));
        let purges = lease.and(self.purge.as_ref().map(|_| ()).ok_or(NO_PURGE));
        let first = &self.store;
        let second_store = second
            .cloned()
            .map(|second| second as Arc<dyn IdempotencyStore>);
        let second_store = second_store.as_ref();
        report
            .check("two_nodes_race_one_winner", applies, async {
                two_nodes_race_one_winner(first, second_store.expect("applies with a second node"))
                    .await
            })
            .await;
        report
            .check("takeover_across_nodes", lease, async {
                takeover_across_nodes(first, second_store.expect("applies with a second node"))
                    .await
            })
            .await;
        report
            .check("concurrent_purges", purges, async {
                concurrent_purges(
                    self.purge.as_ref().expect("applies only with PurgeExpired"),
                    second.expect("applies with a second node"),
                )
                .await
            })
            .await;
    }
}

/// A run in progress: the report so far, and which checks to run.
struct Runner<'a> {
    report: Report,
    /// Every check the suite has, run or not.
    known: Vec<&'static str>,
    only: Option<String>,
    store_name: &'a str,
}

impl Runner<'_> {
    /// Runs `check` if it `applies` (and is the one asked for, if one is), else notes why
    /// not.
    async fn check(
        &mut self,
        name: &'static str,
        applies: Result<(), &'static str>,
        check: impl Future<Output = ()>,
    ) {
        self.known.push(name);
        if self.only.as_deref().is_some_and(|only| only != name) {
            return;
        }
        match applies {
            Ok(()) => {
                let ran = std::panic::AssertUnwindSafe(check).catch_unwind().await;
                if let Err(failure) = ran {
                    let step = failure
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| failure.downcast_ref::<&str>().copied())
                        .unwrap_or("(a panic without a message)");
                    panic!(
                        "conformance: check `{name}` failed on {}: {step}\n\
                         (`Suite::only({name:?})` runs it alone)",
                        self.store_name
                    );
                }
                self.report.ran.push(name);
            }
            Err(why) => self.report.skipped.push((name, why)),
        }
    }
}

/// Whether `admin` evicts: the trait's default `evict` answers
/// [`Unsupported`](crate::StoreError::Unsupported).
async fn evicts<S: RecordAdmin + ?Sized>(admin: &S) -> bool {
    match admin.evict(&fresh_id(), EvictInFlight::Refuse).await {
        Err(crate::StoreError::Unsupported { .. }) => false,
        answer => {
            assert_eq!(
                answer.expect("evict failed"),
                Eviction::NotFound,
                "evicting a key nobody used"
            );
            true
        }
    }
}

/// Whether `admin`'s `inspect` tells a finished record's times (the trait's default
/// tells none).
async fn inspects_times<S: RecordAdmin + ?Sized>(admin: &S) -> bool {
    let id = fresh_id();
    let token = reserve_new(admin, &id, LONG, LONG).await;
    assert_eq!(
        admin
            .finalize(&id, token, &response(b"{}"))
            .await
            .expect("finalize failed"),
        Ownership::Held,
        "the owner of a fresh reservation could not finalize it"
    );
    let inspected = admin
        .inspect(&id)
        .await
        .expect("inspect failed")
        .expect("inspect of a finished record found nothing");
    inspected.created_at.is_some()
}

/// Whether the store's reservations are records under a lease: a duplicate's reserve
/// of a key in flight is shown the owner's record, which has a lease; one held unseen
/// (in the owner's transaction) answers [`Busy`](Reservation::Busy), and has none.
async fn has_leases<S: IdempotencyStore + ?Sized>(store: &S) -> bool {
    let id = fresh_id();
    let token = match store
        .reserve(&id, &binding(b"{}"), LONG, LONG)
        .await
        .expect("reserve failed")
    {
        Reservation::Reserved(token) => token,
        other => panic!("reserve of a key nobody holds answered {other:?}"),
    };
    let leased = match store
        .reserve(&id, &binding(b"{}"), LONG, LONG)
        .await
        .expect("a duplicate's reserve failed")
    {
        Reservation::Exists(_) => true,
        Reservation::Busy => false,
        Reservation::Reserved(_) => panic!("a key in flight was reserved a second time"),
    };
    assert_eq!(
        store.release(&id, token).await.expect("release failed"),
        Ownership::Held,
        "the owner of a fresh reservation could not release it"
    );
    leased
}
