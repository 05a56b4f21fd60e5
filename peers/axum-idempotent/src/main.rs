//! The HTTP peer of `scripts/bench.sh peers`: `POST /payments` behind `axum-idempotent` (key from the
//! `Idempotency-Key` header, responses kept 48 h in ruts' PostgreSQL session store), executing the same
//! business write as idem's charge: the payment row (with `UNIQUE (provider, external_payment_id)`) and its
//! outbox row in one transaction. The crate caches only for a request that carries a session, so a client
//! first calls `POST /session` and sends the cookie it gets.
//!
//! Settings: DATABASE_URL (a database with idem's reference schema: `payment`, `outbox_message`), PORT,
//! POOL (connections, default 32).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::Ttl;
use ruts::store::postgres::{PostgresStore, PostgresStoreBuilder};
use ruts::{CookieOptions, Session, SessionLayer};
use serde::Deserialize;
use sqlx::PgPool;
use tower_cookies::CookieManagerLayer;
use uuid::Uuid;

#[derive(Deserialize)]
struct Charge {
    order_id: Uuid,
    customer_id: Uuid,
    provider: String,
    external_payment_id: String,
    amount: String,
    currency: String,
}

/// Opens the session the idempotency layer needs (its cookie names the scope of the client's keys).
async fn open_session(session: Session<PostgresStore>) -> Response {
    let ttl = Ttl::new(48 * 3600).expect("a valid TTL");
    match session.set("client", &true, ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The business write: payment + outbox row in one transaction; 409 when the provider's payment exists.
async fn charge(State(pool): State<PgPool>, Json(c): Json<Charge>) -> Response {
    match write(&pool, &c).await {
        Ok(Some(body)) => (StatusCode::CREATED, Json(body)).into_response(),
        Ok(None) => (StatusCode::CONFLICT, "payment exists for this provider payment id").into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn write(pool: &PgPool, c: &Charge) -> Result<Option<serde_json::Value>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let id = Uuid::now_v7();
    let row: Option<(Uuid, String)> = sqlx::query_as(
        "INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                              currency, status, created_at, updated_at)
         VALUES ($1, 'peer', $2, $3, $4, $5, $6::numeric, $7, 'captured', now(), now())
         ON CONFLICT (provider, external_payment_id) DO NOTHING
         RETURNING id, amount::text",
    )
    .bind(id)
    .bind(c.order_id)
    .bind(c.customer_id)
    .bind(&c.provider)
    .bind(&c.external_payment_id)
    .bind(&c.amount)
    .bind(&c.currency)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((id, amount)) = row else { return Ok(None) };
    let payload = serde_json::json!({"type": "PaymentCaptured", "amount": amount, "currency": c.currency,
                                     "provider": c.provider});
    sqlx::query(
        "INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, saga_id,
                                     created_at)
         VALUES ($1, 'payments', 'payment', $2, 'PaymentCaptured', $3, '{}', NULL, now())",
    )
    .bind(Uuid::now_v7())
    .bind(c.order_id.to_string())
    .bind(payload)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(serde_json::json!({"id": id, "status": "captured", "amount": amount, "currency": c.currency})))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?;
    let port: u16 = std::env::var("PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(18090);
    let size: u32 = std::env::var("POOL").ok().and_then(|p| p.parse().ok()).unwrap_or(32);
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(size).connect(&url).await?;
    let store = Arc::new(PostgresStoreBuilder::new(pool.clone()).create_table(true).build().await?);
    let options =
        IdempotentOptions::default().use_idempotency_key_header(Some("Idempotency-Key"), true).expire_after(48 * 3600);
    let app = Router::new()
        .route("/payments", post(charge))
        .layer(IdempotentLayer::<PostgresStore>::new(options))
        .route("/session", post(open_session))
        .layer(SessionLayer::new(store).with_cookie_options(CookieOptions::build().name("session")))
        .layer(CookieManagerLayer::new())
        .with_state(pool);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on 127.0.0.1:{port}");
    axum::serve(listener, app).await?;
    Ok(())
}
