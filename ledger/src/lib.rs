//! A merchant ledger built only on idem's public API — the proof that a Rust service gets idem's
//! guarantees for **its own tables**, in its own transaction:
//!
//! - `POST /accounts/{account}/credits` is an idempotent HTTP command: [`IdempotencyLayer`] claims the
//!   `Idempotency-Key` in a transaction, the handler writes the ledger's rows with its own `sqlx::query!`
//!   on that transaction ([`PgUnitOfWork::of`] → [`PgUnitOfWork::connection`]) and announces the credit
//!   through idem's outbox; record, rows and announcement commit together or not at all.
//! - [`RevenueHandler`] is a deduplicating Kafka handler: idem's consumer runner records the event as
//!   processed in the transaction in which the handler credits the merchant's revenue account.
//! - [`MIGRATOR`] holds the ledger's migration; [`PgStore::migrate_with`] installs idem's tables and the
//!   ledger's in the same database.

#![warn(missing_docs)]

use std::sync::Arc;

use async_trait::async_trait;
use axum::extract::{Extension, Path};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router, middleware};
use idem::domain::{Amount, TtlPolicy};
use idem::http::{ApiKeys, IdempotencyConfig, IdempotencyLayer, Merchant, Problem, ProblemJson, ProblemKind, Tx};
use idem::ports::{
    Clock, EventHandler, HandlerError, IdGenerator, InboundEvent, NewOutboxMessage, StoreError, SystemClock,
    TransactionManager, UnitOfWork, UuidV7Generator,
};
#[cfg(doc)]
use idem::postgres::PgStore;
use idem::postgres::PgUnitOfWork;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

/// The ledger's own migrations (`ledger/migrations/`), to apply with [`PgStore::migrate_with`].
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Topic the ledger announces credits on (through idem's outbox).
pub const LEDGER_TOPIC: &str = "ledger";

/// Body of `POST /accounts/{account}/credits`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreditRequest {
    /// A positive decimal string.
    pub amount: String,
    /// Where the money comes from (free text).
    pub source: String,
}

/// Answer of a credit.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Credit {
    /// The new ledger entry.
    pub entry_id: Uuid,
    /// The credited account.
    pub account: String,
    /// The amount credited.
    pub amount: String,
    /// The account's balance after it.
    pub balance: String,
}

/// The ledger's HTTP API: authentication by idem's API keys, the idempotency layer on the command.
pub fn router(tm: Arc<dyn TransactionManager>, keys: Arc<ApiKeys>, ttl: TtlPolicy) -> Router {
    let layer =
        IdempotencyLayer::new(tm, Arc::new(SystemClock), IdempotencyConfig::new(ttl, idem::http::merchant_scope()));
    Router::new()
        .route("/accounts/{account}/credits", post(credit))
        .route_layer(layer)
        .layer(middleware::from_fn_with_state(keys, idem::http::auth::authenticate))
}

fn problem(kind: ProblemKind, status: StatusCode, detail: impl Into<String>) -> Response {
    Problem::new(kind, status).detail(detail).into_response()
}

fn store_failure(e: &StoreError) -> Response {
    let status = if e.is_transient() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::INTERNAL_SERVER_ERROR };
    problem(ProblemKind::StoreUnavailable, status, "the ledger could not be written")
}

/// Writes one credit — the entry, the balance, the announcement — in the unit of work `uow`.
pub async fn write_credit(
    uow: &mut dyn UnitOfWork,
    merchant: &str,
    account: &str,
    amount: Decimal,
    source: &str,
) -> Result<Credit, StoreError> {
    let (entry_id, now) = (UuidV7Generator.new_id(), SystemClock.now());
    let pg = PgUnitOfWork::of(uow)?;
    sqlx::query!(
        "INSERT INTO ledger_entry (id, merchant, account, amount, source, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
        entry_id,
        merchant,
        account,
        amount,
        source,
        now,
    )
    .execute(pg.connection())
    .await
    .map_err(idem::postgres::map_sqlx_error)?;
    let balance = sqlx::query_scalar!(
        r#"INSERT INTO ledger_balance (merchant, account, balance) VALUES ($1, $2, $3)
           ON CONFLICT (merchant, account) DO UPDATE SET balance = ledger_balance.balance + EXCLUDED.balance
           RETURNING balance"#,
        merchant,
        account,
        amount,
    )
    .fetch_one(pg.connection())
    .await
    .map_err(idem::postgres::map_sqlx_error)?;
    uow.outbox()
        .enqueue(
            &NewOutboxMessage::new(
                &UuidV7Generator,
                &SystemClock,
                LEDGER_TOPIC,
                format!("{merchant}/{account}"),
                "LedgerCredited",
                json!({ "entry_id": entry_id, "merchant": merchant, "account": account, "amount": amount.normalize().to_string() }),
            )
            .aggregate_type("ledger_account"),
        )
        .await?;
    Ok(Credit {
        entry_id,
        account: account.to_owned(),
        amount: amount.normalize().to_string(),
        balance: balance.normalize().to_string(),
    })
}

/// `POST /accounts/{account}/credits`
async fn credit(
    Extension(merchant): Extension<Merchant>,
    Path(account): Path<String>,
    mut tx: Tx,
    ProblemJson(body): ProblemJson<CreditRequest>,
) -> Response {
    let amount = match Amount::parse(&body.amount) {
        Ok(a) => a.value(),
        Err(e) => {
            // a refusal rolls back: the key stays free for the corrected request
            return Problem::new(ProblemKind::InvalidField, StatusCode::UNPROCESSABLE_ENTITY)
                .field("amount")
                .detail(e.to_string())
                .into_response();
        }
    };
    match write_credit(tx.uow(), &merchant.0, &account, amount, &body.source).await {
        Ok(credit) => (StatusCode::CREATED, Json(credit)).into_response(),
        Err(e) => store_failure(&e),
    }
}

/// Credits each merchant's `revenue:<currency>` account with every captured payment announced by the
/// payment service (its `PaymentCaptured` events); other events are ignored. Runs under idem's consumer
/// runner, which records each event as processed in the same transaction.
#[derive(Debug, Clone)]
pub struct RevenueHandler {
    /// The merchant credited (the payment events of one payment service belong to one merchant here).
    pub merchant: String,
}

#[async_trait]
impl EventHandler for RevenueHandler {
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        let body: serde_json::Value =
            serde_json::from_slice(&event.payload).map_err(|e| HandlerError::Malformed(format!("not JSON: {e}")))?;
        if body["type"] != "PaymentCaptured" {
            return Ok(());
        }
        let (Some(amount), Some(currency), Some(payment)) =
            (body["amount"].as_str(), body["currency"].as_str(), body["payment_id"].as_str())
        else {
            return Err(HandlerError::Malformed("PaymentCaptured without amount, currency or payment_id".into()));
        };
        let amount = Amount::parse(amount).map_err(|e| HandlerError::Malformed(format!("amount: {e}")))?;
        let account = format!("revenue:{currency}");
        write_credit(uow, &self.merchant, &account, amount.value(), &format!("payment:{payment}")).await?;
        Ok(())
    }
}

/// The README's "Use idem in your own service" example, compiled as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExample;
