//! `SagaStepRepository`: one claim per `(saga_id, step)`.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{SagaStepClaim, SagaStepRepository, StoreError};
use uuid::Uuid;

use crate::PgUnitOfWork;

#[async_trait]
impl SagaStepRepository for PgUnitOfWork {
    async fn claim(&mut self, saga_id: Uuid, step: &str, now: DateTime<Utc>) -> Result<SagaStepClaim, StoreError> {
        let claimed = sqlx::query_scalar!(
            r#"INSERT INTO saga_step (saga_id, step, created_at) VALUES ($1, $2, $3)
               ON CONFLICT (saga_id, step) DO NOTHING RETURNING 1 AS "one!""#,
            saga_id,
            step,
            now,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if claimed.is_some() {
            return Ok(SagaStepClaim::Claimed);
        }
        let outcome =
            sqlx::query_scalar!("SELECT outcome FROM saga_step WHERE saga_id = $1 AND step = $2", saga_id, step,)
                .fetch_one(self.db())
                .await
                .map_err(|e| self.failed(e))?;
        Ok(SagaStepClaim::Done(outcome.unwrap_or(serde_json::Value::Null)))
    }

    async fn complete(&mut self, saga_id: Uuid, step: &str, outcome: &serde_json::Value) -> Result<(), StoreError> {
        let done =
            sqlx::query!("UPDATE saga_step SET outcome = $3 WHERE saga_id = $1 AND step = $2", saga_id, step, outcome,)
                .execute(self.db())
                .await
                .map_err(|e| self.failed(e))?;
        if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotFound) }
    }
}
