//! `ProcessedEventRepository`: processed-event rows (dedup by `event_id`) and late admissions.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{ProcessedEvent, ProcessedEventRepository, StoreError};
use uuid::Uuid;

use crate::PgUnitOfWork;
use crate::error::map_sqlx_error;

#[async_trait]
impl ProcessedEventRepository for PgUnitOfWork {
    async fn record_new(
        &mut self,
        consumer: &str,
        events: &[ProcessedEvent],
        created_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = events.iter().map(|e| e.event_id).collect();
        let topics: Vec<String> = events.iter().map(|e| e.topic.clone()).collect();
        if self.dedup == crate::DedupStorage::Partitioned {
            return sqlx::query_scalar!(
                r#"INSERT INTO processed_event_partitioned (consumer_name, event_id, event_time, topic, created_at, expires_at)
                   SELECT $1, e.id, uuid_v7_time(e.id), e.topic, $4, $5
                   FROM UNNEST($2::uuid[], $3::text[]) AS e(id, topic)
                   ORDER BY e.id
                   ON CONFLICT (consumer_name, event_id, event_time) DO NOTHING
                   RETURNING event_id"#,
                consumer,
                &ids,
                &topics,
                created_at,
                expires_at,
            )
            .fetch_all(self.connection())
            .await
            .map_err(map_sqlx_error);
        }
        sqlx::query_scalar!(
            r#"INSERT INTO processed_event (consumer_name, event_id, topic, created_at, expires_at)
               SELECT $1, e.id, e.topic, $4, $5 FROM UNNEST($2::uuid[], $3::text[]) AS e(id, topic)
               ORDER BY e.id -- one lock order for every batch: concurrent batches cannot deadlock
               ON CONFLICT (consumer_name, event_id) DO NOTHING
               RETURNING event_id"#,
            consumer,
            &ids,
            &topics,
            created_at,
            expires_at,
        )
        .fetch_all(self.connection())
        .await
        .map_err(map_sqlx_error)
    }

    async fn is_processed(&mut self, consumer: &str, event_id: Uuid) -> Result<bool, StoreError> {
        sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM processed_event WHERE consumer_name = $1 AND event_id = $2) AS "exists!""#,
            consumer,
            event_id,
        )
        .fetch_one(self.connection())
        .await
        .map_err(map_sqlx_error)
    }

    async fn late_admitted(&mut self, consumer: &str, event_ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        sqlx::query_scalar!(
            "SELECT event_id FROM late_admission WHERE consumer = $1 AND event_id = ANY($2)",
            consumer,
            event_ids,
        )
        .fetch_all(self.connection())
        .await
        .map_err(map_sqlx_error)
    }

    async fn apply_late_admission(
        &mut self,
        consumer: &str,
        event_id: Uuid,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let applied = sqlx::query!(
            "UPDATE late_admission SET applied_at = $3 WHERE consumer = $1 AND event_id = $2 AND applied_at IS NULL",
            consumer,
            event_id,
            now,
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(applied.rows_affected() == 1)
    }
}
