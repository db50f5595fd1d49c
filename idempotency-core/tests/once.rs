//! `AtMostOnce`: work run at most once per (scope, key), on the layer's request path,
//! over the memory store. Each rule of the function API, as a caller meets it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_core::{AtMostOnce, IdempotencyLayer, Outcome, RejectionKind, RunError, WorkError};
use idempotency_store_memory::MemoryStore;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Receipt {
    run: usize,
}

#[derive(Serialize)]
struct Charge {
    cents: u64,
}

fn once(layer: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer) -> AtMostOnce {
    AtMostOnce::new(layer(IdempotencyLayer::new(MemoryStore::new())))
}

/// What [`counted`] runs.
type Work = std::pin::Pin<Box<dyn Future<Output = Result<Receipt, WorkError<String>>> + Send>>;

/// Work that counts its runs, takes `takes`, and answers with its run's number.
fn counted(runs: &Arc<AtomicUsize>, takes: Duration) -> impl FnOnce() -> Work + Send + 'static {
    let runs = runs.clone();
    move || {
        Box::pin(async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(takes).await;
            Ok(Receipt { run })
        })
    }
}

/// `counted` work, instant, for a charge of one cent under `key` in scope `tenant`.
async fn run_counted(
    once: &AtMostOnce,
    key: &str,
    runs: &Arc<AtomicUsize>,
) -> Result<Receipt, RunError<String>> {
    once.run(
        "tenant",
        key,
        &Charge { cents: 1 },
        counted(runs, Duration::ZERO),
    )
    .await
}

#[tokio::test]
async fn a_retry_gets_the_first_result_and_runs_nothing() {
    let once = once(|layer| layer);
    let runs = Arc::new(AtomicUsize::new(0));
    let charge = Charge { cents: 100 };
    for _ in 0..3 {
        let receipt = once
            .run("tenant", "k1", &charge, counted(&runs, Duration::ZERO))
            .await
            .unwrap();
        assert_eq!(receipt, Receipt { run: 1 });
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_while_it_runs_waits_and_gets_its_result() {
    let once = once(|layer| layer.with_in_flight_wait(Duration::from_secs(5)));
    let runs = Arc::new(AtomicUsize::new(0));
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let (once, work) = (once.clone(), counted(&runs, Duration::from_millis(300)));
            tokio::spawn(async move { once.run("tenant", "k", &Charge { cents: 1 }, work).await })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), Receipt { run: 1 });
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_same_key_with_another_fingerprint_is_refused() {
    let once = once(|layer| layer);
    let runs = Arc::new(AtomicUsize::new(0));
    run_counted(&once, "k", &runs).await.unwrap();
    let reused = once
        .run(
            "tenant",
            "k",
            &Charge { cents: 2 },
            counted(&runs, Duration::ZERO),
        )
        .await;
    assert!(matches!(reused, Err(RunError::KeyReused)), "{reused:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn scopes_never_share_a_key() {
    let once = once(|layer| layer);
    let runs = Arc::new(AtomicUsize::new(0));
    for (scope, run) in [("a", 1), ("b", 2), ("a", 1)] {
        let receipt = once
            .run(
                scope,
                "k",
                &Charge { cents: 1 },
                counted(&runs, Duration::ZERO),
            )
            .await
            .unwrap();
        assert_eq!(receipt, Receipt { run }, "scope {scope}");
    }
}

#[tokio::test]
async fn a_retryable_failure_releases_the_key() {
    let once = once(|layer| layer);
    let failed = once
        .run("tenant", "k", &Charge { cents: 1 }, || async {
            Err::<Receipt, _>(WorkError::Retryable("the bank timed out".to_owned()))
        })
        .await;
    assert!(
        matches!(&failed, Err(RunError::Failed(message)) if message == "the bank timed out"),
        "{failed:?}"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let receipt = run_counted(&once, "k", &runs).await.unwrap();
    assert_eq!(receipt, Receipt { run: 1 }, "the retry runs the work again");
}

#[tokio::test]
async fn an_unknown_outcome_holds_the_key_until_it_expires() {
    let lifetime = Duration::from_millis(400);
    let once = once(|layer| {
        layer
            .with_lifetime(lifetime)
            .with_in_flight_wait(Duration::ZERO)
    });
    let unknown = once
        .run("tenant", "k", &Charge { cents: 1 }, || async {
            Err::<Receipt, _>(WorkError::OutcomeUnknown("COMMIT's answer was lost"))
        })
        .await;
    assert!(
        matches!(unknown, Err(RunError::OutcomeUnknown(_))),
        "{unknown:?}"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let held = run_counted(&once, "k", &runs).await;
    assert!(matches!(held, Err(RunError::InFlight)), "{held:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    tokio::time::sleep(lifetime + Duration::from_millis(200)).await;
    let receipt = run_counted(&once, "k", &runs).await.unwrap();
    assert_eq!(
        receipt,
        Receipt { run: 1 },
        "the key runs again once it expired"
    );
}

/// Work that runs for several leases keeps its key: its lease is renewed, and a
/// duplicate waits instead of taking it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_renewed_while_the_work_runs() {
    let once = once(|layer| {
        layer
            .with_lease(Duration::from_millis(150))
            .with_in_flight_wait(Duration::from_secs(5))
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (once, work) = (once.clone(), counted(&runs, Duration::from_millis(900)));
        async move { once.run("tenant", "k", &Charge { cents: 1 }, work).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let duplicate = run_counted(&once, "k", &runs).await.unwrap();
    assert_eq!(duplicate, Receipt { run: 1 });
    assert_eq!(first.await.unwrap().unwrap(), Receipt { run: 1 });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A failure retries must not fix is a value of the result type: stored and replayed.
#[tokio::test]
async fn a_result_that_is_an_error_is_stored_and_replayed() {
    let once = once(|layer| layer);
    let runs = Arc::new(AtomicUsize::new(0));
    for _ in 0..2 {
        let runs = runs.clone();
        let declined: Result<Receipt, String> = once
            .run("tenant", "k", &Charge { cents: 1 }, move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, WorkError<()>>(Err("card declined".to_owned()))
            })
            .await
            .unwrap();
        assert_eq!(declined, Err("card declined".to_owned()));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_invalid_key_runs_nothing_and_says_why() {
    let once = once(|layer| layer);
    let runs = Arc::new(AtomicUsize::new(0));
    for key in ["", "a\nb", &"k".repeat(10_000)] {
        let refused = once
            .run(
                "tenant",
                key,
                &Charge { cents: 1 },
                counted(&runs, Duration::ZERO),
            )
            .await;
        match refused {
            Err(RunError::Refused {
                outcome: Some(Outcome::Rejected(RejectionKind::InvalidKey)),
                status,
                message,
            }) => {
                assert_eq!(status, 400);
                assert!(message.contains("key"), "{message}");
            }
            other => panic!("key {key:?}: {other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Work that panics releases its key, and its caller gets the panic (as a handler's
/// panic reaches the server); the next call runs.
#[tokio::test]
async fn a_panicking_run_releases_its_key() {
    let once = once(|layer| layer);
    let panicked = tokio::spawn({
        let once = once.clone();
        async move {
            once.run("tenant", "k", &Charge { cents: 1 }, || async {
                if true {
                    panic!("the work panicked");
                }
                Ok::<Receipt, WorkError<()>>(Receipt { run: 0 })
            })
            .await
        }
    })
    .await;
    assert!(
        panicked.is_err_and(|error| error.is_panic()),
        "the caller gets the panic"
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let receipt = run_counted(&once, "k", &runs).await.unwrap();
    assert_eq!(receipt, Receipt { run: 1 });
}
