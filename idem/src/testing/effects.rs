//! Counting effects, not survivors.
//!
//! A handler that is idempotent on its own (an upsert, a version check, a unique key) hides a second
//! application of an event: the rows look the same. The application log counts **applications**: one row
//! in `test_application` per call of the handler, written in the handler's own transaction, so a rolled-back
//! application leaves no row and a committed second one leaves a second row.

use async_trait::async_trait;
use idem_ports::{EventHandler, HandlerError, InboundEvent, UnitOfWork};
use idem_postgres::{PgUnitOfWork, map_sqlx_error};
use uuid::Uuid;

use super::TestDb;
use crate::PgEventHandler;

/// Creates `test_application`, the log of applications.
pub async fn create_application_log(db: &TestDb) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS test_application (
             n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             event_id uuid, topic text, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(db.pool())
    .await?;
    Ok(())
}

/// How many times the event `event_id` was applied (committed).
pub async fn applications_of_event(db: &TestDb, event_id: Uuid) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM test_application WHERE event_id = $1")
        .bind(event_id)
        .fetch_one(db.pool())
        .await?)
}

/// Events applied more than once, with their counts.
pub async fn applied_twice(db: &TestDb) -> anyhow::Result<Vec<(Uuid, i64)>> {
    Ok(sqlx::query_as(
        "SELECT event_id, count(*) FROM test_application WHERE event_id IS NOT NULL
         GROUP BY event_id HAVING count(*) > 1",
    )
    .fetch_all(db.pool())
    .await?)
}

async fn log(tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO test_application (event_id, topic) VALUES ($1, $2)")
        .bind(event.event_id)
        .bind(&event.topic)
        .execute(tx.connection())
        .await
        .map_err(|e| HandlerError::Store(map_sqlx_error(e)))?;
    Ok(())
}

/// Your handler, logging each of its applications first, in its transaction (create the log first:
/// [`create_application_log`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counted<H>(pub H);

#[async_trait]
impl<H: PgEventHandler> PgEventHandler for Counted<H> {
    async fn handle(&self, tx: &mut PgUnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        log(tx, event).await?;
        self.0.handle(tx, event).await
    }
}

/// A handler that does nothing but log its applications: not idempotent at all, so a second application
/// of an event is a second row. Create the log first ([`create_application_log`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingHandler;

#[async_trait]
impl EventHandler for CountingHandler {
    async fn handle(&self, uow: &mut dyn UnitOfWork, event: &InboundEvent) -> Result<(), HandlerError> {
        log(PgUnitOfWork::of(uow)?, event).await
    }
}
