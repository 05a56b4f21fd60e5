//! What operators read and change by hand (`idem outbox`, `idem keys`, `idem dlq`) and the health gauges
//! the service exports. Never on a request path.

use chrono::{DateTime, Utc};
use idem_ports::StoreError;
use uuid::Uuid;

use crate::PgStore;
use crate::error::map_sqlx_error;

/// Gauges read from the database in the background (`/metrics` only encodes them).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Health {
    /// Unpublished outbox rows.
    pub outbox_backlog: i64,
    /// Age of the oldest unpublished, not quarantined, outbox row (0 when none).
    pub oldest_unpublished_seconds: f64,
    /// Quarantined outbox rows waiting for an operator.
    pub quarantined_rows: i64,
    /// Age of the oldest open transaction that wrote idempotency records: a key in flight that long
    /// (0 when none).
    pub oldest_in_flight_claim_seconds: f64,
    /// Records held between the phases of a foreign call.
    pub held_records: i64,
    /// Of them, those whose lease lapsed: their attempt died, waiting for a retry to take them over.
    pub lapsed_records: i64,
    /// Age of the oldest held record (0 when none).
    pub oldest_held_seconds: f64,
    /// Of them, those the completer parked for an operator (`idem keys held --parked`).
    pub parked_records: i64,
}

/// An outbox row as an operator sees it (no payload).
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// The row id (its `event_id`).
    pub id: Uuid,
    /// Topic it goes to.
    pub topic: String,
    /// The message key.
    pub key: String,
    /// The event type.
    pub event_type: String,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// Failed attempts so far.
    pub attempts: i32,
    /// The broker's last refusal.
    pub last_error: Option<String>,
    /// When it was quarantined, if it is.
    pub quarantined_at: Option<DateTime<Utc>>,
}

/// Which outbox rows to list.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutboxFilter {
    /// Quarantined rows.
    Quarantined,
    /// Unpublished rows created before this time (stuck), quarantined or not.
    UnpublishedBefore(DateTime<Utc>),
}

/// An idempotency record as an operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    /// The merchant.
    pub scope: String,
    /// The key.
    pub key: String,
    /// `in_flight` or `completed`.
    pub state: String,
    /// SHA-256 of the request (method, route, canonical body).
    pub fingerprint: Vec<u8>,
    /// The stored status, once completed.
    pub status_code: Option<i16>,
    /// When the key was claimed.
    pub created_at: DateTime<Utc>,
    /// When it expires.
    pub expires_at: DateTime<Utc>,
    /// The stored body, once completed.
    pub response_body: Option<Vec<u8>>,
    /// Between the phases of a foreign call: the attempt holding it (0 for a claim in one transaction).
    pub attempt: i32,
    /// Until when that attempt's lease holds.
    pub lease_until: Option<DateTime<Utc>>,
    /// Where a taken-over attempt resumes.
    pub recovery_point: Option<String>,
}

/// A record held between the phases of a foreign call, as an operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldRecord {
    /// The merchant.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The attempt holding it.
    pub attempt: i32,
    /// Until when that attempt's lease holds.
    pub lease_until: DateTime<Utc>,
    /// Where a resumed attempt starts.
    pub recovery_point: String,
    /// When the key was claimed.
    pub created_at: DateTime<Utc>,
    /// How often the completer re-sent it.
    pub completer_runs: i32,
    /// When the completer parked it for an operator.
    pub parked_at: Option<DateTime<Utc>>,
    /// Why.
    pub parked_reason: Option<String>,
    /// The request's path.
    pub request_uri: Option<String>,
}

/// One re-driven dead letter.
#[derive(Debug, Clone, PartialEq)]
pub struct Redrive {
    /// The dead-letter topic.
    pub dlq_topic: String,
    /// Its partition.
    pub dlq_partition: i32,
    /// Its offset.
    pub dlq_offset: i64,
    /// The message's `event_id`, when it has a valid one.
    pub event_id: Option<Uuid>,
    /// Where it is produced again.
    pub source_topic: String,
    /// Why it was dead-lettered.
    pub reason: String,
    /// Who re-drove it.
    pub by: String,
    /// When.
    pub at: DateTime<Utc>,
    /// Admitted although older than the dedup window (applied at most once).
    pub admitted_late: bool,
    /// The consumer group the admission is for.
    pub consumer: String,
}

/// What the server says about the durability of a commit it acknowledges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    /// `synchronous_standby_names`: empty when no standby must confirm a commit.
    pub synchronous_standby_names: String,
    /// `synchronous_commit` of idem's sessions.
    pub synchronous_commit: String,
}

impl Durability {
    /// Why an acknowledged commit could be lost in a failover, if it could: no synchronous standby, or
    /// `synchronous_commit` below `remote_write`.
    pub fn risk(&self) -> Option<String> {
        if self.synchronous_standby_names.trim().is_empty() {
            return Some(
                "the primary has no synchronous standby (synchronous_standby_names is empty): a failover can lose \
                 commits idem already acknowledged, published or committed offsets for (RELIABILITY.md, \
                 \"Replication\")"
                    .into(),
            );
        }
        match self.synchronous_commit.as_str() {
            "remote_write" | "on" | "remote_apply" => None,
            other => Some(format!(
                "synchronous_commit is {other}: a commit is acknowledged before a standby has it, so a failover can \
                 lose it; use remote_write or stronger (RELIABILITY.md, \"Replication\")"
            )),
        }
    }
}

impl PgStore {
    /// The server's replication settings that decide whether an acknowledged commit survives a failover.
    pub async fn durability(&self) -> Result<Durability, StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let (names, commit): (String, String) = sqlx::query_as(
            "SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit')",
        )
        .fetch_one(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        let _ = tx.commit().await;
        Ok(Durability { synchronous_standby_names: names, synchronous_commit: commit })
    }

    /// The health gauges, in one round trip.
    pub async fn health(&self) -> Result<Health, StoreError> {
        let row = sqlx::query!(
            r#"SELECT
                 (SELECT count(*) FROM outbox_message) AS "backlog!",
                 (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM outbox_message
                   WHERE quarantined_at IS NULL) AS "oldest!",
                 (SELECT count(*) FROM outbox_message WHERE quarantined_at IS NOT NULL) AS "quarantined!",
                 (SELECT coalesce(extract(epoch FROM now() - min(a.xact_start)), 0)::float8
                    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                   WHERE l.relation = 'idempotency_record'::regclass AND l.mode = 'RowExclusiveLock'
                     AND a.pid <> pg_backend_pid()) AS "in_flight!",
                 (SELECT count(*) FROM idempotency_record
                   WHERE state = 'in_flight' AND lease_until IS NOT NULL) AS "held!",
                 (SELECT count(*) FROM idempotency_record
                   WHERE state = 'in_flight' AND lease_until IS NOT NULL AND lease_until <= now()) AS "lapsed!",
                 (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM idempotency_record
                   WHERE state = 'in_flight' AND lease_until IS NOT NULL) AS "oldest_held!",
                 (SELECT count(*) FROM idempotency_record
                   WHERE state = 'in_flight' AND lease_until IS NOT NULL AND parked_at IS NOT NULL) AS "parked!""#
        )
        .fetch_one(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)?;
        Ok(Health {
            outbox_backlog: row.backlog,
            oldest_unpublished_seconds: row.oldest,
            quarantined_rows: row.quarantined,
            oldest_in_flight_claim_seconds: row.in_flight,
            held_records: row.held,
            lapsed_records: row.lapsed,
            oldest_held_seconds: row.oldest_held,
            parked_records: row.parked,
        })
    }

    /// Rows a cleanup round at `now` would delete (progress of `idem cleanup --once`).
    pub async fn expired_rows(&self, now: DateTime<Utc>) -> Result<i64, StoreError> {
        sqlx::query_scalar!(
            r#"SELECT (SELECT count(*) FROM idempotency_record WHERE expires_at <= $1)
                    + (SELECT count(*) FROM processed_event WHERE expires_at <= $1)
                    AS "n!""#,
            now,
        )
        .fetch_one(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)
    }

    /// Outbox rows matching `filter`, oldest first, at most `limit`.
    pub async fn outbox_rows(&self, filter: OutboxFilter, limit: i64) -> Result<Vec<OutboxRow>, StoreError> {
        let (quarantined_only, before) = match filter {
            OutboxFilter::Quarantined => (true, None),
            OutboxFilter::UnpublishedBefore(t) => (false, Some(t)),
        };
        sqlx::query_as!(
            OutboxRow,
            r#"SELECT id, topic, aggregateid AS key, type AS event_type, created_at, attempts, last_error, quarantined_at
               FROM outbox_message
               WHERE (NOT $1 OR quarantined_at IS NOT NULL)
                 AND ($2::timestamptz IS NULL OR created_at < $2)
               ORDER BY seq
               LIMIT $3"#,
            quarantined_only,
            before,
            limit,
        )
        .fetch_all(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)
    }

    /// Releases quarantined or failing rows for new attempts (attempts reset, last error kept). Returns
    /// the ids that were found unpublished; published or unknown ids are left out.
    pub async fn retry_outbox(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let released = sqlx::query_scalar!(
            r#"UPDATE outbox_message SET quarantined_at = NULL, attempts = 0
               WHERE id = ANY($1)
               RETURNING id"#,
            ids,
        )
        .fetch_all(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        if !released.is_empty() {
            // wake the relays of every instance (they would also find the rows at their next poll)
            let _ = sqlx::query("SELECT pg_notify($1, 'operator')").bind(crate::OUTBOX_CHANNEL).execute(&mut *tx).await;
        }
        tx.commit().await.map_err(map_sqlx_error)?;
        Ok(released)
    }

    /// The idempotency record of (`scope`, `key`), expired or not.
    pub async fn key_record(&self, scope: &str, key: &str) -> Result<Option<KeyRecord>, StoreError> {
        sqlx::query_as!(
            KeyRecord,
            r#"SELECT scope, key, state, command_hash AS fingerprint, status_code, created_at, expires_at, response_body,
                      attempt, lease_until, recovery_point
               FROM idempotency_record WHERE scope = $1 AND key = $2"#,
            scope,
            key,
        )
        .fetch_optional(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)
    }

    /// Records held between the phases of a foreign call (only the parked ones with `parked_only`), oldest
    /// first, at most `limit`.
    pub async fn held_records(&self, parked_only: bool, limit: i64) -> Result<Vec<HeldRecord>, StoreError> {
        sqlx::query_as!(
            HeldRecord,
            r#"SELECT scope, key, attempt, lease_until AS "lease_until!", recovery_point AS "recovery_point!",
                      created_at, completer_runs, parked_at, parked_reason, request_uri
               FROM idempotency_record
               WHERE state = 'in_flight' AND lease_until IS NOT NULL AND recovery_point IS NOT NULL
                 AND (NOT $1 OR parked_at IS NOT NULL)
               ORDER BY created_at LIMIT $2"#,
            parked_only,
            limit,
        )
        .fetch_all(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)
    }

    /// Puts a parked record, or a held one whose lease lapsed, back in the completer's hands: unparked, its
    /// backoff and its wait after an unknown outcome reset. Never a live lease (an attempt whose call may be
    /// in process): false then, and when it is not held.
    pub async fn resume_held(&self, scope: &str, key: &str) -> Result<bool, StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let done = sqlx::query!(
            r#"UPDATE idempotency_record SET parked_at = NULL, parked_reason = NULL, completer_runs = 0,
                      not_before = NULL
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND lease_until IS NOT NULL
                 AND (parked_at IS NOT NULL OR lease_until <= clock_timestamp())"#,
            scope,
            key,
        )
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        tx.commit().await.map_err(map_sqlx_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// Ends a parked record with a final answer an operator decided after checking the other side (nothing
    /// happened there, or it was compensated): `status` and the problem+json `body` are stored and replayed
    /// to every retry; the key is never executed again. Only a parked record can be abandoned (a held one
    /// may still be running). False when it is not parked.
    pub async fn abandon_parked(&self, scope: &str, key: &str, status: u16, body: &[u8]) -> Result<bool, StoreError> {
        let status = i16::try_from(status).map_err(|_| StoreError::Other("status out of range".into()))?;
        let headers = serde_json::json!([["content-type", "application/problem+json"]]);
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let done = sqlx::query!(
            r#"UPDATE idempotency_record
               SET state = 'completed', status_code = $3, response_headers = $4, response_body = $5,
                   expires_at = expires_at + greatest(now() - created_at, interval '0'),
                   request_body = NULL, parked_at = NULL
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND parked_at IS NOT NULL"#,
            scope,
            key,
            status,
            headers,
            body,
        )
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        tx.commit().await.map_err(map_sqlx_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// The recorded value of each setting in `idem_setting` (see the migration): `(value, previous,
    /// changed_at)` by name.
    pub async fn settings(&self) -> Result<Vec<RecordedSetting>, StoreError> {
        sqlx::query_as!(RecordedSetting, "SELECT name, value, previous, changed_at FROM idem_setting ORDER BY name")
            .fetch_all(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
            .await
            .map_err(map_sqlx_error)
    }

    /// Records a setting's value (and what it replaced, when it changed).
    pub async fn record_setting(&self, setting: &RecordedSetting) -> Result<(), StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        sqlx::query!(
            "INSERT INTO idem_setting (name, value, previous, changed_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, previous = EXCLUDED.previous,
                 changed_at = EXCLUDED.changed_at",
            setting.name,
            setting.value,
            setting.previous,
            setting.changed_at,
        )
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        tx.commit().await.map_err(map_sqlx_error)
    }

    /// Whether `consumer` holds a processed-event row for `event_id` in either dedup storage (a late
    /// re-drive of such an event would be a duplicate: the consumer records the row for late admissions
    /// too, so it would not apply it).
    pub async fn processed_anywhere(&self, consumer: &str, event_id: uuid::Uuid) -> Result<bool, StoreError> {
        sqlx::query_scalar!(
            r#"SELECT (EXISTS (SELECT 1 FROM processed_event WHERE consumer_name = $1 AND event_id = $2)
                    OR EXISTS (SELECT 1 FROM processed_event_partitioned
                               WHERE consumer_name = $1 AND event_id = $2 AND event_time = uuid_v7_time($2))) AS "exists!""#,
            consumer,
            event_id,
        )
        .fetch_one(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)
    }

    /// Whether the dead letter at this position was re-driven already.
    pub async fn redriven(&self, dlq_topic: &str, partition: i32, offset: i64) -> Result<bool, StoreError> {
        sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM dlq_redrive
                WHERE dlq_topic = $1 AND dlq_partition = $2 AND dlq_offset = $3) AS "exists!""#,
            dlq_topic,
            partition,
            offset,
        )
        .fetch_one(&mut *self.small_tx().await.map_err(map_sqlx_error)?)
        .await
        .map_err(map_sqlx_error)
    }

    /// Records a re-drive after the broker acknowledged the message: `false` if it was recorded already
    /// (a concurrent re-drive of the same dead letter; its two copies share the event_id).
    pub async fn record_redrive(&self, r: &Redrive) -> Result<bool, StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        let inserted = sqlx::query!(
            r#"INSERT INTO dlq_redrive (dlq_topic, dlq_partition, dlq_offset, event_id, source_topic, reason,
                                        redriven_by, redriven_at, admitted_late)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
               ON CONFLICT DO NOTHING"#,
            r.dlq_topic,
            r.dlq_partition,
            r.dlq_offset,
            r.event_id,
            r.source_topic,
            r.reason,
            r.by,
            r.at,
            r.admitted_late,
        )
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        tx.commit().await.map_err(map_sqlx_error)?;
        Ok(inserted.rows_affected() == 1)
    }

    /// Admits `event_id` for `consumer` although it is older than the dedup window (before its re-drive is
    /// produced, so the consumer finds the admission; an admission whose message never went out is
    /// harmless: the event is applied at most once whenever it comes).
    pub async fn admit_late(
        &self,
        consumer: &str,
        event_id: Uuid,
        by: &str,
        at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let mut tx = self.small_tx().await.map_err(map_sqlx_error)?;
        sqlx::query!(
            r#"INSERT INTO late_admission (consumer, event_id, admitted_by, admitted_at)
               VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING"#,
            consumer,
            event_id,
            by,
            at,
        )
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        tx.commit().await.map_err(map_sqlx_error)
    }
}

/// A row of `idem_setting`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedSetting {
    /// `dedup_storage/<group>`, `dedup_ttl/<group>`, `consumer_group/<topic>`, `idempotency_ttl`.
    pub name: String,
    /// Its value at the last start.
    pub value: String,
    /// The value it replaced, when the last change is one whose effects still matter.
    pub previous: Option<String>,
    /// When it took this value.
    pub changed_at: chrono::DateTime<chrono::Utc>,
}

#[cfg(test)]
mod tests {
    use super::Durability;

    #[test]
    fn only_a_synchronous_standby_with_remote_write_or_stronger_is_safe() {
        let d = |names: &str, commit: &str| Durability {
            synchronous_standby_names: names.into(),
            synchronous_commit: commit.into(),
        };
        assert!(d("", "on").risk().is_some_and(|r| r.contains("no synchronous standby")));
        assert!(d("ANY 1 (s1, s2)", "local").risk().is_some_and(|r| r.contains("synchronous_commit is local")));
        assert!(d("s1", "off").risk().is_some());
        for commit in ["remote_write", "on", "remote_apply"] {
            assert_eq!(d("FIRST 1 (s1)", commit).risk(), None, "{commit}");
        }
    }
}
