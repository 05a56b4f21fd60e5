//! Operational endpoints: liveness, readiness, Prometheus metrics.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use idem_kafka::probe::BrokerProbe;
use idem_postgres::PgStore;
use idem_postgres::cleanup::{CleanupStats, refresh_dead_tuples};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What the operational endpoints read.
#[derive(Clone)]
pub struct Ops {
    pub store: PgStore,
    pub broker: BrokerProbe,
    pub registry: Arc<Registry>,
    pub gauges: Gauges,
    pub cleanup: Arc<CleanupStats>,
}

/// Gauges refreshed in the background (the alert rules in `ops/prometheus/` read them).
#[derive(Clone, Default)]
pub struct Gauges {
    pub outbox_backlog: Gauge,
    pub outbox_oldest_unpublished: Gauge<f64, AtomicU64>,
    pub outbox_quarantined_rows: Gauge,
    pub oldest_in_flight_claim: Gauge<f64, AtomicU64>,
    pub broker_up: Gauge,
    pub database_up: Gauge,
}

impl Gauges {
    pub fn register(&self, registry: &mut Registry) {
        registry.register("idem_outbox_backlog", "Unpublished outbox rows", self.outbox_backlog.clone());
        registry.register(
            "idem_outbox_oldest_unpublished_seconds",
            "Age of the oldest unpublished, not quarantined, outbox row (0 when none)",
            self.outbox_oldest_unpublished.clone(),
        );
        registry.register(
            "idem_outbox_quarantined_rows",
            "Outbox rows quarantined and waiting for an operator (idem outbox list --quarantined)",
            self.outbox_quarantined_rows.clone(),
        );
        registry.register(
            "idem_idempotency_oldest_in_flight_seconds",
            "Age of the oldest open transaction holding idempotency claims: a key in flight that long",
            self.oldest_in_flight_claim.clone(),
        );
        registry.register("idem_broker_up", "1 when the Kafka broker answered the last probe", self.broker_up.clone());
        registry.register("idem_database_up", "1 when the database answered the last probe", self.database_up.clone());
    }
}

/// What the public listener serves besides the API: liveness only.
pub fn public_router() -> Router {
    Router::new().route("/healthz", get(|| async { "ok" }))
}

impl Ops {
    /// Refreshes the database-backed gauges every `every` until `shutdown`: a scrape only encodes.
    pub async fn refresh_until(&self, shutdown: tokio_util::sync::CancellationToken, every: Duration) {
        loop {
            let g = &self.gauges;
            let database = async {
                let health = self.store.health().await?;
                g.outbox_backlog.set(health.outbox_backlog);
                g.outbox_oldest_unpublished.set(health.oldest_unpublished_seconds);
                g.outbox_quarantined_rows.set(health.quarantined_rows);
                g.oldest_in_flight_claim.set(health.oldest_in_flight_claim_seconds);
                refresh_dead_tuples(&self.store, &self.cleanup).await
            };
            let ok = matches!(tokio::time::timeout(Duration::from_secs(5), database).await, Ok(Ok(())));
            g.database_up.set(i64::from(ok));
            g.broker_up.set(i64::from(self.broker.check(Duration::from_secs(2)).await.is_ok()));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }
}

/// The admin listener's routes.
pub fn router(ops: Ops) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(ops)
}

async fn ready(State(ops): State<Ops>) -> impl IntoResponse {
    let db = tokio::time::timeout(Duration::from_secs(2), ops.store.ping()).await;
    let db = match db {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".to_owned()),
    };
    let broker = ops.broker.check(Duration::from_secs(2)).await;
    let body = serde_json::json!({
        "database": db.as_ref().map(|_| "ok").unwrap_or("unreachable"),
        "broker": broker.as_ref().map(|_| "ok").unwrap_or("unreachable"),
    });
    let status = if db.is_ok() && broker.is_ok() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    if let Err(e) = &db {
        tracing::warn!(error = %e, "readiness: database unreachable");
    }
    if let Err(e) = &broker {
        tracing::warn!(error = %e, "readiness: broker unreachable");
    }
    (status, axum::Json(body))
}

async fn metrics(State(ops): State<Ops>) -> impl IntoResponse {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &ops.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
