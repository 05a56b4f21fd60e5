//! The README's "Use idem in your own service" example, as a crate of its own.

use std::{sync::Arc, time::Duration};

use axum::{Router, extract::Path, http::StatusCode, routing::post};
use idem::http::{IdempotencyConfig, IdempotencyLayer, Problem, ProblemKind};
use idem::kafka::consumer::RunnerSettings;
use idem::kafka::relay::{Relay, RelaySettings};
use idem::postgres::cleanup::{Cleaner, CleanupSettings};
use idem::postgres::{PgStore, PgUnitOfWork, PoolSettings, map_sqlx_error};
use idem::{
    Background, HandlerError, InboundEvent, NewOutboxMessage, PgEventHandler, PgTx, StoreError, SystemClock,
    TtlPolicy, UuidV7Generator, pg_runner,
};

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
struct Restocked;

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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (kafka, clock) = ("127.0.0.1:9092", Arc::new(SystemClock));
    let store = PgStore::connect("postgres://postgres@127.0.0.1/app", &PoolSettings::default()).await?;
    // idem's tables beside yours: both migration sets in the same _sqlx_migrations table
    store.migrate_with(Some(&sqlx::migrate!("./migrations"))).await?;
    let ttl = TtlPolicy::new(Duration::from_secs(48 * 3600))?;
    let scope = Arc::new(|_: &axum::http::request::Parts| Some("my-tenant".to_owned()));
    let layer = IdempotencyLayer::new(Arc::new(store.clone()), clock.clone(), IdempotencyConfig::new(ttl, scope));
    let app: Router = Router::new().route("/stock/{sku}/reservations", post(reserve)).route_layer(layer);

    // relay (with its wake-ups and the outbox vacuum), cleaner, topics and consumers: one call, one token
    let restocks = RunnerSettings::new(kafka, "inventory", "restocks", ttl);
    let consumer = pg_runner(restocks, store.clone(), clock.clone(), Restocked);
    let mut tasks = Background::new(store.clone(), kafka)
        .relay(Relay::new(RelaySettings::new(kafka), Arc::new(store.clone()), clock))
        .cleaner(Cleaner::new(store.clone(), CleanupSettings::default()), Duration::from_secs(6 * 3600))
        .topics(&["restocks", "restocks.dlq", "stock"], 6, idem::kafka::admin::Replication::Auto)
        .consumer(consumer)
        .start()
        .await?;
    let (listener, token) = (tokio::net::TcpListener::bind("127.0.0.1:8081").await?, tasks.token());
    tasks.spawn("http", async move {
        Ok(idem::http::server::serve(listener, app, Default::default(), token).await?)
    });
    tasks.wait(Duration::from_secs(20)).await?;
    Ok(())
}
