//! Operational endpoints: liveness, readiness, Prometheus metrics.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use idem_kafka::probe::BrokerProbe;
use idem_ports::TransactionManager;
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
    pub outbox_backlog: Gauge,
    pub cleanup: Arc<CleanupStats>,
}

/// What the public listener serves besides the API: liveness only.
pub fn public_router() -> Router {
    Router::new().route("/healthz", get(|| async { "ok" }))
}

impl Ops {
    /// Refreshes the database-backed gauges every `every` until `shutdown`: a scrape only encodes.
    pub async fn refresh_until(&self, shutdown: tokio_util::sync::CancellationToken, every: Duration) {
        loop {
            let refresh = async {
                if let Ok(mut uow) = self.store.begin().await
                    && let Ok(n) = uow.outbox().backlog().await
                {
                    self.outbox_backlog.set(n);
                }
                let _ = refresh_dead_tuples(&self.store, &self.cleanup).await;
            };
            let _ = tokio::time::timeout(Duration::from_secs(5), refresh).await;
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
