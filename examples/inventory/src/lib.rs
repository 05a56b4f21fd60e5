//! The README's "Use idem in your own service" example as a crate of its own: the service's parts here,
//! the wiring in `main.rs`, and its tests (`tests/`) on `idem::testing`.

use std::sync::Arc;

use axum::{Router, extract::Path, http::StatusCode, routing::post};
use idem::http::{IdempotencyConfig, IdempotencyLayer, Problem, ProblemKind};
use idem::postgres::{PgUnitOfWork, map_sqlx_error};
use idem::{
    Clock, HandlerError, InboundEvent, NewOutboxMessage, PgEventHandler, PgTx, StoreError, SystemClock,
    TransactionManager, TtlPolicy, UuidV7Generator,
};

/// The service's own tables, installed beside idem's (`PgStore::migrate_with`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The HTTP API behind the idempotency layer, on units of work of `tm` (the `PgStore`).
pub fn api(tm: Arc<dyn TransactionManager>, clock: Arc<dyn Clock>, ttl: TtlPolicy) -> Router {
    let scope = Arc::new(|_: &axum::http::request::Parts| Some("my-tenant".to_owned()));
    let layer = IdempotencyLayer::new(tm, clock, IdempotencyConfig::new(ttl, scope));
    Router::new().route("/stock/{sku}/reservations", post(reserve)).route_layer(layer)
}

/// Behind the idempotency layer: runs once per Idempotency-Key; a retry gets the stored answer.
async fn reserve(Path(sku): Path<String>, mut tx: PgTx) -> Result<StatusCode, Problem> {
    let unavailable = |e: StoreError| {
        Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE).detail(e.to_string())
    };
    // your table, in the transaction that holds the key's idempotency record
    let reserved = sqlx::query("UPDATE stock SET reserved = reserved + 1 WHERE sku = $1 AND reserved < on_hand")
        .bind(&sku)
        .execute(tx.connection())
        .await
        .map_err(|e| unavailable(map_sqlx_error(e)))?
        .rows_affected();
    if reserved == 0 {
        // a refusal of your own: rolled back with everything written before it, so the retry after a
        // restock executes (`.commit()` would store it as this key's answer instead)
        return Err(Problem::custom("https://example.com/problems/out-of-stock", "Out of stock", StatusCode::CONFLICT));
    }
    // an announcement through idem's outbox, published by the relay after the commit; its id (UUID v7) is
    // the event_id every receiver dedups by
    let announcement = NewOutboxMessage::new(
        &UuidV7Generator,
        &SystemClock,
        "stock",
        &sku,
        "StockReserved",
        serde_json::json!({ "sku": sku }),
    );
    tx.uow().outbox().enqueue(&announcement).await.map_err(unavailable)?;
    Ok(StatusCode::CREATED)
}

/// A deduplicating Kafka handler: the runner records each event_id as processed in the same transaction.
pub struct Restocked;

#[idem::async_trait]
impl PgEventHandler for Restocked {
    async fn handle(&self, tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        let sku = String::from_utf8_lossy(&event.payload).into_owned();
        sqlx::query("UPDATE stock SET on_hand = on_hand + 1 WHERE sku = $1")
            .bind(&sku)
            .execute(tx.connection())
            .await
            .map_err(map_sqlx_error)?;
        Ok(())
    }
}
