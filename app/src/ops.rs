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
    /// The last readiness probe's result (`None` before the first): `/readyz` serves it, so a caller of an
    /// exposed admin listener never makes the service ping its database or fetch broker metadata.
    pub readiness: Arc<std::sync::Mutex<Option<Readiness>>>,
}

/// What the last readiness probe found: each dependency's error, if any.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    pub database: Option<String>,
    pub broker: Option<String>,
}

/// How often readiness is probed in the background.
pub const READINESS_EVERY: Duration = Duration::from_secs(1);

/// Gauges refreshed in the background (the alert rules in `ops/prometheus/` read them).
#[derive(Clone, Default)]
pub struct Gauges {
    pub outbox_backlog: Gauge,
    pub outbox_oldest_unpublished: Gauge<f64, AtomicU64>,
    pub outbox_quarantined_rows: Gauge,
    pub oldest_in_flight_claim: Gauge<f64, AtomicU64>,
    pub broker_up: Gauge,
    pub database_up: Gauge,
    pub held_records: Gauge,
    pub lapsed_records: Gauge,
    pub oldest_held: Gauge<f64, AtomicU64>,
    pub parked_records: Gauge,
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
        registry.register(
            "idem_idempotency_held_records",
            "Records held between the phases of a foreign call (a call to another system in progress)",
            self.held_records.clone(),
        );
        registry.register(
            "idem_idempotency_lapsed_records",
            "Held records whose lease lapsed: their attempt died; a retry with the key takes them over",
            self.lapsed_records.clone(),
        );
        registry.register(
            "idem_idempotency_oldest_held_seconds",
            "Age of the oldest record held between phases (0 when none)",
            self.oldest_held.clone(),
        );
        registry.register(
            "idem_idempotency_parked_records",
            "Held records the completer parked for an operator (idem keys held --parked): never finished on their own",
            self.parked_records.clone(),
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
    /// Probes the database and the broker every `every` until `shutdown`, for `/readyz`; a change is logged
    /// once, not on every probe.
    pub async fn probe_readiness_until(&self, shutdown: tokio_util::sync::CancellationToken, every: Duration) {
        loop {
            let was = self.readiness.lock().map(|r| r.clone()).unwrap_or_default().unwrap_or_default();
            let now = self.probe_once().await;
            if now.database.is_some() != was.database.is_some() {
                match &now.database {
                    Some(e) => tracing::warn!(error = %e, "readiness: database unreachable"),
                    None => tracing::info!("readiness: database reachable"),
                }
            }
            if now.broker.is_some() != was.broker.is_some() {
                match &now.broker {
                    Some(e) => tracing::warn!(error = %e, "readiness: broker unreachable"),
                    None => tracing::info!("readiness: broker reachable"),
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// One probe of the database and the broker (each bounded by 2 s), stored for `/readyz`.
    async fn probe_once(&self) -> Readiness {
        let database = match tokio::time::timeout(Duration::from_secs(2), self.store.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("timed out".to_owned()),
        };
        let broker = self.broker.check(Duration::from_secs(2)).await.err().map(|e| e.to_string());
        // the broker gauge follows this probe: one metadata fetch serves both
        self.gauges.broker_up.set(i64::from(broker.is_none()));
        let now = Readiness { database, broker };
        if let Ok(mut last) = self.readiness.lock() {
            *last = Some(now.clone());
        }
        now
    }

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
                g.held_records.set(health.held_records);
                g.lapsed_records.set(health.lapsed_records);
                g.oldest_held.set(health.oldest_held_seconds);
                g.parked_records.set(health.parked_records);
                refresh_dead_tuples(&self.store, &self.cleanup).await
            };
            let ok = matches!(tokio::time::timeout(Duration::from_secs(5), database).await, Ok(Ok(())));
            g.database_up.set(i64::from(ok));
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

/// The last probe's result (see [`Ops::probe_readiness_until`]).
async fn ready(State(ops): State<Ops>) -> impl IntoResponse {
    let cached = ops.readiness.lock().map(|r| r.clone()).unwrap_or_default();
    let last = match cached {
        Some(last) => last,
        None => ops.probe_once().await, // before the first background probe: once, then cached
    };
    let word = |e: &Option<String>| if e.is_none() { "ok" } else { "unreachable" };
    let body = serde_json::json!({ "database": word(&last.database), "broker": word(&last.broker) });
    let ok = last.database.is_none() && last.broker.is_none();
    (if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, axum::Json(body))
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
