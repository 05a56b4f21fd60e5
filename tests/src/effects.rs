//! Counting effects, not survivors: the kit's application log ([`idem::testing::effects`]), and what
//! the reference service needs beside it.
//!
//! The reference order handler is idempotent on its own (the projection only moves forward by version,
//! `UNIQUE (provider, external_payment_id)` stops a second payment), so counting payments cannot see an
//! event applied twice. These count **applications**:
//!
//! - [`CountingHandler`] and [`create_application_log`]: the kit's;
//! - [`log_order_applications`]: for tests that drive the real `idem` binary (its order handler), a
//!   `BEFORE INSERT` row trigger on `order_projection` logs every proposed projection row — each
//!   application of an order event proposes one, even when the upsert then changes nothing — in the same
//!   transaction;
//! - [`log_payment_attempts`]: every payment insert the charge use case proposes.

pub use idem::testing::ShiftedClock;
pub use idem::testing::effects::{CountingHandler, applications_of_event, create_application_log};
use uuid::Uuid;

use crate::TestDb;

/// Logs every application of an order event by the real order handler (see the module docs).
pub async fn log_order_applications(db: &TestDb) -> anyhow::Result<()> {
    create_application_log(db).await?;
    sqlx::raw_sql(
        "ALTER TABLE test_application ADD COLUMN order_id uuid, ADD COLUMN version bigint;
         CREATE FUNCTION test_application_log() RETURNS trigger LANGUAGE plpgsql AS $$
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
    log_payment_attempts_in(db.pool()).await
}

/// [`log_payment_attempts`] in the database of `pool` (a cluster the test did not create).
pub async fn log_payment_attempts_in(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE test_payment_attempt (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, external_payment_id text);
         CREATE FUNCTION test_payment_attempt_log() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO test_payment_attempt (external_payment_id) VALUES (NEW.external_payment_id); RETURN NEW; END $$;
         CREATE TRIGGER test_payment_attempt_log BEFORE INSERT ON payment
             FOR EACH ROW EXECUTE FUNCTION test_payment_attempt_log();",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Provider payment ids whose charge was executed (committed) more than once, with their counts.
pub async fn charges_executed_twice(db: &TestDb) -> anyhow::Result<Vec<(String, i64)>> {
    charges_executed_twice_in(db.pool()).await
}

/// [`charges_executed_twice`] in the database of `pool`.
pub async fn charges_executed_twice_in(pool: &sqlx::PgPool) -> anyhow::Result<Vec<(String, i64)>> {
    // a payment charged through a provider is written pending without its provider id (the provider's charge
    // id comes with its answer): counted by the provider's own charges instead
    Ok(sqlx::query_as(
        "SELECT external_payment_id, count(*) FROM test_payment_attempt WHERE external_payment_id IS NOT NULL
         GROUP BY 1 HAVING count(*) > 1",
    )
    .fetch_all(pool)
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
