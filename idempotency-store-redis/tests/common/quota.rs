//! Scope quota checks, run on a single server and on a cluster alike: two handles racing
//! for a scope's last places, a byte quota, expiry, renewal, release and eviction giving
//! room back (or not), the accounting keys' own expiry, and a 429 through the layer.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use idempotency_core::{
    EvictInFlight, Eviction, FencingToken, FullStore, IdempotencyLayer, IdempotencyStore, Outcome,
    RecordAdmin, RecordId, RecordState, RejectionKind, Reservation, ScopeQuota, StoreError,
};
use idempotency_store_redis::RedisStore;
use redis::AsyncCommands as _;
use tower::ServiceExt as _;

use super::{LONG, binding, checks, response};

fn scope() -> String {
    format!("quota-{}", uuid::Uuid::new_v4())
}

async fn reserve(
    store: &RedisStore,
    id: &RecordId,
    lease: Duration,
    lifetime: Duration,
) -> FencingToken {
    match store.reserve(id, &binding(), lease, lifetime).await {
        Ok(Reservation::Reserved(token)) => token,
        other => panic!("reserving a fresh key in a scope with room answered {other:?}"),
    }
}

/// Asserts that reserving `id` is refused for the quota, and returns the error's parts.
async fn refused(store: &RedisStore, id: &RecordId) -> (String, Option<Duration>) {
    match store.reserve(id, &binding(), LONG, LONG).await {
        Err(StoreError::QuotaExceeded { bound, retry_after }) => (bound, retry_after),
        other => panic!("a reservation over the quota answered {other:?}"),
    }
}

/// Whether any of the scope's accounting keys exists on the server.
async fn accounting_exists(store: &RedisStore, scope: &str) -> bool {
    let mut connection = store.connection();
    for key in store.key_prefix().scope_accounting_keys(scope) {
        let exists: bool = connection.exists(&key).await.unwrap();
        if exists {
            return true;
        }
    }
    false
}

/// The conformance check on one handle, then 40 reservations over two handles (two
/// connections, as two replicas) racing for a scope's 5 places.
pub async fn two_handles_race_for_the_last_places(a: RedisStore, b: RedisStore) {
    let quota = ScopeQuota::default().with_max_records(5);
    let (a, b) = (a.with_scope_quota(quota), b.with_scope_quota(quota));
    let one: Arc<dyn FullStore> = Arc::new(a.clone());
    idempotency_core::conformance::scope_quota_holds_under_concurrency(&one, 5).await;

    let scope = scope();
    // Three places already taken, so the race is for the last two.
    for i in 0..3 {
        reserve(
            &a,
            &RecordId::new(scope.clone(), format!("early{i}")),
            LONG,
            LONG,
        )
        .await;
    }
    let (a, b) = (Arc::new(a), Arc::new(b));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        let id = RecordId::new(scope.clone(), format!("k{i}"));
        tasks.spawn(async move { store.reserve(&id, &binding(), LONG, LONG).await });
    }
    let (mut won, mut refused) = (0, 0);
    while let Some(answer) = tasks.join_next().await {
        match answer.unwrap() {
            Ok(Reservation::Reserved(_)) => won += 1,
            Err(StoreError::QuotaExceeded { bound, retry_after }) => {
                refused += 1;
                assert_eq!(bound, "5 records");
                let after = retry_after.expect("a scope with live records knows its next expiry");
                assert!(
                    after > LONG - Duration::from_secs(10) && after <= LONG,
                    "Retry-After {after:?} is not the scope's next expiry (about {LONG:?})"
                );
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((won, refused), (2, 38), "two handles raced past the quota");
}

/// Bytes: a finalize is never refused and may take the scope over its byte quota; then
/// new keys are refused while a replay is not; another scope is not affected; an
/// eviction gives the bytes back.
pub async fn a_byte_quota_counts_answers(store: RedisStore) {
    let store = store.with_scope_quota(ScopeQuota::default().with_max_bytes(1_000));
    let scope = scope();
    let first = RecordId::new(scope.clone(), "first");
    let token = reserve(&store, &first, LONG, LONG).await;
    let second = RecordId::new(scope.clone(), "second");
    reserve(&store, &second, LONG, LONG).await;
    let mut big = response(b"");
    big.body = vec![b'x'; 2_000].into();
    assert_eq!(
        store.finalize(&first, token, &big).await.unwrap(),
        idempotency_core::Ownership::Held,
        "a finalize must never be refused for the quota"
    );
    let (bound, retry_after) = refused(&store, &RecordId::new(scope.clone(), "third")).await;
    assert_eq!(bound, "1000 bytes");
    assert!(retry_after.is_some_and(|after| after <= LONG));
    // A replay of the finalized record is never refused.
    match store.reserve(&first, &binding(), LONG, LONG).await {
        Ok(Reservation::Exists(record)) => {
            assert!(
                matches!(record.state, RecordState::Completed(answer) if answer.body.len() == 2_000)
            );
        }
        other => panic!("a replay over the quota answered {other:?}"),
    }
    // Another scope is not affected.
    reserve(
        &store,
        &RecordId::new(format!("{scope}-other"), "k"),
        LONG,
        LONG,
    )
    .await;
    // Evicting the big answer gives its bytes back (the second record, in flight, stays).
    assert!(matches!(
        store.evict(&first, EvictInFlight::Refuse).await.unwrap(),
        Eviction::Evicted(_)
    ));
    reserve(&store, &RecordId::new(scope.clone(), "third"), LONG, LONG).await;
}

/// A record that expires gives its place back, and the scope's accounting keys expire
/// with its last record; a renewed lease keeps the place taken past the first expiry.
pub async fn expiry_gives_room_back_and_renewal_keeps_it(store: RedisStore) {
    let store = store.with_scope_quota(ScopeQuota::default().with_max_records(1));
    let scope = scope();
    let short = RecordId::new(scope.clone(), "short");
    let lifetime = Duration::from_millis(400);
    reserve(&store, &short, Duration::ZERO, lifetime).await;
    let (bound, retry_after) = refused(&store, &RecordId::new(scope.clone(), "next")).await;
    assert_eq!(bound, "1 records");
    let after = retry_after.expect("the scope's next expiry");
    assert!(
        after <= lifetime,
        "Retry-After {after:?} is past the only record's expiry"
    );
    assert!(accounting_exists(&store, &scope).await);
    tokio::time::sleep(lifetime + Duration::from_millis(200)).await;
    assert!(
        !accounting_exists(&store, &scope).await,
        "a quiet scope's accounting keys must expire with its last record"
    );
    let next = RecordId::new(scope.clone(), "next");
    let token = reserve(
        &store,
        &next,
        Duration::from_millis(300),
        Duration::from_millis(300),
    )
    .await;
    // The lease moves the record's expiry out to 3 s, and its place stays taken.
    assert_eq!(
        store
            .renew(&next, token, Duration::from_secs(3))
            .await
            .unwrap(),
        idempotency_core::Ownership::Held
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, retry_after) = refused(&store, &RecordId::new(scope.clone(), "after-renewal")).await;
    assert!(
        retry_after.is_some_and(|after| after > Duration::from_secs(2)),
        "Retry-After {retry_after:?} does not follow the renewed expiry"
    );
    let mut connection = store.connection();
    let [expiries, _] = store.key_prefix().scope_accounting_keys(&scope);
    let ttl: i64 = connection.pttl(&expiries).await.unwrap();
    assert!(
        ttl > 2_000,
        "the accounting keys would expire (PTTL {ttl} ms) before the renewed record"
    );
}

/// A released record gives its place back; the scope's last release drops its
/// accounting keys at once.
pub async fn release_gives_room_back(store: RedisStore) {
    let store = store.with_scope_quota(ScopeQuota::default().with_max_records(1));
    let scope = scope();
    let first = RecordId::new(scope.clone(), "first");
    let token = reserve(&store, &first, LONG, LONG).await;
    refused(&store, &RecordId::new(scope.clone(), "second")).await;
    assert_eq!(
        store.release(&first, token).await.unwrap(),
        idempotency_core::Ownership::Held
    );
    assert!(!accounting_exists(&store, &scope).await);
    reserve(&store, &RecordId::new(scope.clone(), "second"), LONG, LONG).await;
    // A release that lost its record (a stale token) gives nothing back.
    assert_eq!(
        store.release(&first, token).await.unwrap(),
        idempotency_core::Ownership::Lost
    );
    refused(&store, &RecordId::new(scope.clone(), "third")).await;
}

/// Through the layer: a scope at its quota gets 429 with `Retry-After`; a replay of a
/// key it already holds is still answered.
pub async fn the_layer_answers_429_with_retry_after(store: RedisStore) {
    // Without a `CredentialScope` the layer puts every caller in one scope.
    let store = store.with_scope_quota(ScopeQuota::default().with_max_records(2));
    let calls = checks::Calls::default();
    let app = checks::app(calls.clone(), IdempotencyLayer::new(store));
    let keys: Vec<String> = (0..3).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    for key in &keys[..2] {
        let (status, _, outcome) = checks::send(&app, key).await;
        assert_eq!(
            (status, outcome),
            (StatusCode::CREATED, Some(Outcome::Executed))
        );
    }
    let request = Request::post("/tables")
        .header("idempotency-key", &keys[2])
        .body(Body::from(r#"{"name":"t1"}"#))
        .unwrap();
    let answer = app.clone().oneshot(request).await.unwrap();
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        answer.extensions().get::<Outcome>().copied(),
        Some(Outcome::Rejected(RejectionKind::QuotaExceeded))
    );
    let retry_after: u64 = answer
        .headers()
        .get("retry-after")
        .expect("a 429 for the quota says when to retry")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1_700..=1_800).contains(&retry_after),
        "Retry-After {retry_after} s is not when the scope's first record expires (the \
         layer's default lifetime is 30 minutes)"
    );
    let (status, _, outcome) = checks::send(&app, &keys[0]).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Replayed))
    );
    assert_eq!(calls.0.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// More expired records than one reservation prunes in its first batch (64): a byte
/// refusal is only given once every expired record's bytes are taken off.
pub async fn every_expired_record_gives_its_bytes_back(store: RedisStore) {
    let scope = scope();
    let id = |name: &str| RecordId::new(scope.clone(), name.to_owned());
    // Keys of one length, so every reservation holds the same bytes.
    let each = id("s000").reserved_bytes(&binding());
    let max = 100 * each + 10;
    let store = store.with_scope_quota(ScopeQuota::default().with_max_bytes(max));
    let long = id("long");
    let token = reserve(&store, &long, LONG, LONG).await;
    let lifetime = Duration::from_millis(500);
    for i in 1..100 {
        reserve(&store, &id(&format!("s{i:03}")), Duration::ZERO, lifetime).await;
    }
    // The long record's answer takes the scope over its bytes.
    let mut answer = response(b"");
    answer.body = vec![b'x'; (max - 20 * each) as usize].into();
    store.finalize(&long, token, &answer).await.unwrap();
    refused(&store, &id("s100")).await;
    tokio::time::sleep(lifetime + Duration::from_millis(200)).await;
    // 99 expired records: 64 pruned first would leave 35 counted, still over the bound.
    reserve(&store, &id("s100"), LONG, LONG).await;
}
