//! `--metrics-listen ADDR`: the idempotency layer's metrics, as Prometheus text on
//! `http://ADDR/metrics`.
//!
//! The layer records through the `metrics` facade (see `idempotency_core::metrics`); this
//! module installs `metrics-exporter-prometheus` as the recorder and serves what it
//! renders, on a listener of its own so that the metrics never share a port (or an
//! access log, or the idempotency layer) with the service's clients. Names follow
//! Prometheus' conventions (`idempotency_requests_total`,
//! `idempotency_store_duration_seconds`). Durations are
//! Prometheus histograms with buckets from half a millisecond to half a minute, so that
//! `histogram_quantile` works across replicas.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::http::header;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Bucket bounds (seconds) of the duration histograms: a SQL round trip on the left, a
/// duplicate that waited out the in-flight wait on the right.
const DURATION_BUCKETS: [f64; 15] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// How often the exporter drops samples it no longer needs.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder and serves `/metrics` on `listen`; returns the
/// address it listens on (the port chosen when `listen`'s is 0).
///
/// Call it before making the idempotency layer, so that its metrics have a recorder from
/// the first request; and at most once per process: the recorder is global.
pub async fn serve(
    listen: SocketAddr,
) -> Result<SocketAddr, Box<dyn std::error::Error + Send + Sync>> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|error| format!("--metrics-listen {listen}: cannot listen there ({error})"))?;
    let address = listener.local_addr()?;
    let handle = PrometheusBuilder::new()
        // Prometheus' conventions, as an OpenTelemetry exporter writes the same
        // instruments: `_total` on counters, the unit on durations (`_seconds`).
        .with_recommended_naming(true)
        .set_buckets_for_metric(Matcher::Suffix("duration".to_owned()), &DURATION_BUCKETS)?
        .install_recorder()?;
    // The layer describes its metrics when it is made, too; this covers a recorder
    // installed after it.
    idempotency_core::metrics::describe();

    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            ticker.tick().await;
            upkeep.run_upkeep();
        }
    });
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let text = handle.render();
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    text,
                )
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the metrics listener stopped");
        }
    });
    Ok(address)
}
