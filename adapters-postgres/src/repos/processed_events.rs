//! `ProcessedEventRepository`: processed-event rows (dedup by `event_id`) and late admissions.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{ProcessedEvent, ProcessedEventRepository, StoreError};
use uuid::Uuid;

use crate::PgUnitOfWork;

#[async_trait]
impl ProcessedEventRepository for PgUnitOfWork {
    async fn record_new(
        &mut self,
        consumer: &str,
        events: &[ProcessedEvent],
        created_at: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = events.iter().map(|e| e.event_id).collect();
        let topics: Vec<String> = events.iter().map(|e| e.topic.clone()).collect();
        let expires: Vec<DateTime<Utc>> = events.iter().map(|e| e.expires_at).collect();
        if self.dedup == crate::DedupStorage::Partitioned {
            return sqlx::query_scalar!(
                r#"INSERT INTO processed_event_partitioned (consumer_name, event_id, event_time, topic, created_at, expires_at)
                   SELECT $1, e.id, uuid_v7_time(e.id), e.topic, $4, e.expires_at
                   FROM UNNEST($2::uuid[], $3::text[], $5::timestamptz[]) AS e(id, topic, expires_at)
                   ORDER BY e.id
                   ON CONFLICT (consumer_name, event_id, event_time) DO NOTHING
                   RETURNING event_id"#,
                consumer,
                &ids,
                &topics,
                created_at,
                &expires,
            )
            .fetch_all(self.db())
            .await
            .map_err(|e| self.failed(e));
        }
        sqlx::query_scalar!(
            r#"INSERT INTO processed_event (consumer_name, event_id, topic, created_at, expires_at)
               SELECT $1, e.id, e.topic, $4, e.expires_at
               FROM UNNEST($2::uuid[], $3::text[], $5::timestamptz[]) AS e(id, topic, expires_at)
               ORDER BY e.id -- one lock order for every batch: concurrent batches cannot deadlock
               ON CONFLICT (consumer_name, event_id) DO NOTHING
               RETURNING event_id"#,
            consumer,
            &ids,
            &topics,
            created_at,
            &expires,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))
    }

    async fn is_processed(&mut self, consumer: &str, event_id: Uuid) -> Result<bool, StoreError> {
        if self.dedup == crate::DedupStorage::Partitioned {
            return sqlx::query_scalar!(
                r#"SELECT EXISTS (SELECT 1 FROM processed_event_partitioned
                    WHERE consumer_name = $1 AND event_id = $2 AND event_time = uuid_v7_time($2)) AS "exists!""#,
                consumer,
                event_id,
            )
            .fetch_one(self.db())
            .await
            .map_err(|e| self.failed(e));
        }
        sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM processed_event WHERE consumer_name = $1 AND event_id = $2) AS "exists!""#,
            consumer,
            event_id,
        )
        .fetch_one(self.db())
        .await
        .map_err(|e| self.failed(e))
    }

    async fn late_admitted(&mut self, consumer: &str, event_ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        sqlx::query_scalar!(
            "SELECT event_id FROM late_admission WHERE consumer = $1 AND event_id = ANY($2)",
            consumer,
            event_ids,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))
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
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(applied.rows_affected() == 1)
    }
}
