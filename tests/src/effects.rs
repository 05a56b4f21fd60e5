//! Counting effects, not survivors.
//!
//! The reference order handler is idempotent on its own (the projection only moves forward by version,
//! `UNIQUE (provider, external_payment_id)` stops a second payment), so counting payments cannot see an
//! event applied twice. These helpers count **applications**:
//!
//! - [`CountingHandler`]: an `EventHandler` that inserts one row per application into `test_application`
//!   (no key, nothing deduplicated), in the runner's transaction: a rolled-back application leaves no row;
//! - [`log_order_applications`]: for tests that drive the real `idem` binary (its order handler), a
//!   `BEFORE INSERT` row trigger on `order_projection` logs every proposed projection row — each
//!   application of an order event proposes one, even when the upsert then changes nothing — in the same
//!   transaction;
//! - [`ShiftedClock`]: a clock that can be moved, for the age rules.

#![allow(clippy::disallowed_methods)] // the test harness reads the clock

use std::sync::Mutex;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{Clock, EventHandler, HandlerError, InboundEvent, UnitOfWork};
use idem_postgres::{PgUnitOfWork, map_sqlx_error};
use uuid::Uuid;

use crate::TestDb;

/// Creates `test_application`, the log of applications (see the module docs).
pub async fn create_application_log(db: &TestDb) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS test_application (
             n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             event_id uuid, order_id uuid, version bigint, topic text, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Logs every application of an order event by the real order handler (see the module docs).
pub async fn log_order_applications(db: &TestDb) -> anyhow::Result<()> {
    create_application_log(db).await?;
    sqlx::raw_sql(
        "CREATE FUNCTION test_application_log() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO test_application (order_id, version) VALUES (NEW.order_id, NEW.version); RETURN NEW; END $$;
         CREATE TRIGGER test_application_log BEFORE INSERT ON order_projection
             FOR EACH ROW EXECUTE FUNCTION test_application_log();",
    )
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Logs every payment insert the charge use case proposes (`test_payment_attempt`), in its transaction: a
/// charge executed twice proposes twice even when `UNIQUE (provider, external_payment_id)` then keeps one
/// payment, so this counts executions of the HTTP handler and of order events, not surviving rows.
pub async fn log_payment_attempts(db: &TestDb) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE test_payment_attempt (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, external_payment_id text NOT NULL);
         CREATE FUNCTION test_payment_attempt_log() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO test_payment_attempt (external_payment_id) VALUES (NEW.external_payment_id); RETURN NEW; END $$;
         CREATE TRIGGER test_payment_attempt_log BEFORE INSERT ON payment
             FOR EACH ROW EXECUTE FUNCTION test_payment_attempt_log();",
    )
    .execute(db.pool())
    .await?;
    Ok(())
}

/// Provider payment ids whose charge was executed (committed) more than once, with their counts.
pub async fn charges_executed_twice(db: &TestDb) -> anyhow::Result<Vec<(String, i64)>> {
    Ok(sqlx::query_as("SELECT external_payment_id, count(*) FROM test_payment_attempt GROUP BY 1 HAVING count(*) > 1")
        .fetch_all(db.pool())
        .await?)
}

/// How many times the event `event_id` was applied by a [`CountingHandler`].
pub async fn applications_of_event(db: &TestDb, event_id: Uuid) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM test_application WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(db.pool())
        .await?)
}

/// How many times an event of `order_id` (any version) was applied by the order handler.
pub async fn applications_of_order(db: &TestDb, order_id: Uuid) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM test_application WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(db.pool())
        .await?)
}

/// `(order_id, version)` pairs applied more than once by the order handler, with their counts.
pub async fn orders_applied_twice(db: &TestDb) -> anyhow::Result<Vec<(Uuid, i64, i64)>> {
    Ok(sqlx::query_as(
        "SELECT order_id, version, count(*) FROM test_application WHERE order_id IS NOT NULL
         GROUP BY order_id, version HAVING count(*) > 1",
    )
    .fetch_all(db.pool())
    .await?)
}

/// Every application is one row in `test_application`: not idempotent at all, so a second application of
/// an event is a second row. Create the table first ([`create_application_log`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingHandler;

#[async_trait]
impl EventHandler for CountingHandler {
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        let pg = PgUnitOfWork::of(uow)?;
        sqlx::query("INSERT INTO test_application (event_id, topic) VALUES ($1, $2)")
            .bind(event.event_id)
            .bind(&event.topic)
            .execute(pg.connection())
            .await
            .map_err(|e| HandlerError::Store(map_sqlx_error(e)))?;
        Ok(())
    }
}

/// The system clock moved by an offset that tests change while the code under test runs.
#[derive(Debug, Default)]
pub struct ShiftedClock {
    offset: Mutex<chrono::Duration>,
}

impl ShiftedClock {
    /// The system clock, not shifted yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock `by` further (negative: back).
    pub fn advance(&self, by: chrono::Duration) {
        *self.offset.lock().unwrap_or_else(|p| p.into_inner()) += by;
    }
}

impl Clock for ShiftedClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now() + *self.offset.lock().unwrap_or_else(|p| p.into_inner())
    }
}
