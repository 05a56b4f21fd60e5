//! The repository ports, implemented on one transaction.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{
    ClaimOutcome, IdempotencyClaim, IdempotencyRecord, IdempotencyRepository, IdempotencyState, NewOutboxMessage,
    NewPayment, NewRefund, OutboxRecord, OutboxRepository, PaymentInsert, PaymentRecord, PaymentRepository,
    PaymentStatus, ProcessedEvent, ProcessedEventRepository, ProjectionRepository, RefundRecord, SagaStepClaim,
    SagaStepRepository, StoreError, StoredResponse,
};
use rust_decimal::Decimal;
use uuid::Uuid;

use crate::PgUnitOfWork;
use crate::error::map_sqlx_error;

struct PaymentRow {
    id: Uuid,
    merchant_id: String,
    order_id: Uuid,
    customer_id: Uuid,
    provider: String,
    external_payment_id: String,
    amount: Decimal,
    currency: String,
    status: String,
    refunded_amount: Decimal,
    created_at: DateTime<Utc>,
}

impl TryFrom<PaymentRow> for PaymentRecord {
    type Error = StoreError;

    fn try_from(r: PaymentRow) -> Result<Self, StoreError> {
        let status = PaymentStatus::parse(&r.status)
            .ok_or_else(|| StoreError::Other(format!("unknown payment status {:?}", r.status)))?;
        Ok(PaymentRecord {
            id: r.id,
            merchant_id: r.merchant_id,
            order_id: r.order_id,
            customer_id: r.customer_id,
            provider: r.provider,
            external_payment_id: r.external_payment_id,
            amount: r.amount,
            currency: r.currency,
            status,
            refunded_amount: r.refunded_amount,
            created_at: r.created_at,
        })
    }
}

fn record(row: Option<PaymentRow>) -> Result<Option<PaymentRecord>, StoreError> {
    row.map(PaymentRecord::try_from).transpose()
}

#[async_trait]
impl PaymentRepository for PgUnitOfWork {
    async fn insert(&mut self, p: &NewPayment) -> Result<PaymentRecord, StoreError> {
        sqlx::query_as!(
            PaymentRow,
            r#"INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id,
                                   amount, currency, status, created_at, updated_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10)
               RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency AS "currency!", status, refunded_amount, created_at"#,
            p.id,
            p.merchant_id,
            p.order_id,
            p.customer_id,
            p.provider,
            p.external_payment_id,
            p.amount,
            p.currency,
            p.status.as_str(),
            p.created_at,
        )
        .fetch_one(self.connection())
        .await
        .map_err(map_sqlx_error)?
        .try_into()
    }

    async fn insert_or_get(&mut self, p: &NewPayment) -> Result<PaymentInsert, StoreError> {
        let inserted = sqlx::query_as!(
            PaymentRow,
            r#"INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id,
                                   amount, currency, status, created_at, updated_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10)
               ON CONFLICT (provider, external_payment_id) DO NOTHING
               RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency AS "currency!", status, refunded_amount, created_at"#,
            p.id,
            p.merchant_id,
            p.order_id,
            p.customer_id,
            p.provider,
            p.external_payment_id,
            p.amount,
            p.currency,
            p.status.as_str(),
            p.created_at,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        if let Some(row) = inserted {
            return Ok(PaymentInsert::Inserted(row.try_into()?));
        }
        // The conflicting row is committed (ON CONFLICT waited for its transaction), and this new statement
        // sees it under READ COMMITTED.
        let existing = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at
               FROM payment WHERE provider = $1 AND external_payment_id = $2"#,
            p.provider,
            p.external_payment_id,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        match record(existing)? {
            Some(p) => Ok(PaymentInsert::Existing(p)),
            None => Err(StoreError::Retryable("conflicting payment vanished".into())),
        }
    }

    async fn insert_many_or_get(&mut self, payments: &[NewPayment]) -> Result<Vec<PaymentInsert>, StoreError> {
        if payments.is_empty() {
            return Ok(Vec::new());
        }
        let col = |f: fn(&NewPayment) -> String| payments.iter().map(f).collect::<Vec<_>>();
        let ids: Vec<Uuid> = payments.iter().map(|p| p.id).collect();
        let orders: Vec<Uuid> = payments.iter().map(|p| p.order_id).collect();
        let customers: Vec<Uuid> = payments.iter().map(|p| p.customer_id).collect();
        let amounts: Vec<Decimal> = payments.iter().map(|p| p.amount).collect();
        let created: Vec<DateTime<Utc>> = payments.iter().map(|p| p.created_at).collect();
        let inserted = sqlx::query_as!(
            PaymentRow,
            r#"INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id,
                                   amount, currency, status, created_at, updated_at)
               SELECT * , p.created_at FROM UNNEST($1::uuid[], $2::text[], $3::uuid[], $4::uuid[], $5::text[],
                                      $6::text[], $7::numeric[], $8::text[], $9::text[], $10::timestamptz[])
                    AS p(id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency, status, created_at)
               ON CONFLICT (provider, external_payment_id) DO NOTHING
               RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency AS "currency!", status, refunded_amount, created_at"#,
            &ids,
            &col(|p| p.merchant_id.clone()),
            &orders,
            &customers,
            &col(|p| p.provider.clone()),
            &col(|p| p.external_payment_id.clone()),
            &amounts,
            &col(|p| p.currency.clone()),
            &col(|p| p.status.as_str().to_owned()),
            &created,
        )
        .fetch_all(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        let mut by_id: std::collections::HashMap<Uuid, PaymentRecord> = std::collections::HashMap::new();
        for row in inserted {
            let rec = PaymentRecord::try_from(row)?;
            by_id.insert(rec.id, rec);
        }
        let missing: Vec<&NewPayment> = payments.iter().filter(|p| !by_id.contains_key(&p.id)).collect();
        let mut existing: std::collections::HashMap<(String, String), PaymentRecord> = std::collections::HashMap::new();
        if !missing.is_empty() {
            let providers: Vec<String> = missing.iter().map(|p| p.provider.clone()).collect();
            let externals: Vec<String> = missing.iter().map(|p| p.external_payment_id.clone()).collect();
            let rows = sqlx::query_as!(
                PaymentRow,
                r#"SELECT p.id, p.merchant_id, p.order_id, p.customer_id, p.provider, p.external_payment_id, p.amount,
                          p.currency AS "currency!", p.status, p.refunded_amount, p.created_at
                   FROM payment p
                   JOIN UNNEST($1::text[], $2::text[]) AS k(provider, external_payment_id)
                     ON p.provider = k.provider AND p.external_payment_id = k.external_payment_id"#,
                &providers,
                &externals,
            )
            .fetch_all(self.connection())
            .await
            .map_err(map_sqlx_error)?;
            for row in rows {
                let rec = PaymentRecord::try_from(row)?;
                existing.insert((rec.provider.clone(), rec.external_payment_id.clone()), rec);
            }
        }
        payments
            .iter()
            .map(|p| match by_id.get(&p.id) {
                Some(rec) => Ok(PaymentInsert::Inserted(rec.clone())),
                None => existing
                    .get(&(p.provider.clone(), p.external_payment_id.clone()))
                    .cloned()
                    .map(PaymentInsert::Existing)
                    .ok_or_else(|| StoreError::Retryable("conflicting payment vanished".into())),
            })
            .collect()
    }

    async fn get(&mut self, id: Uuid) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at
               FROM payment WHERE id = $1"#,
            id,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        record(row)
    }

    async fn get_for_update(&mut self, id: Uuid) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at
               FROM payment WHERE id = $1 FOR UPDATE"#,
            id,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        record(row)
    }

    async fn find_by_order_for_update(
        &mut self,
        merchant_id: &str,
        order_id: Uuid,
    ) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at
               FROM payment WHERE merchant_id = $1 AND order_id = $2
               ORDER BY created_at DESC, id DESC LIMIT 1 FOR UPDATE"#,
            merchant_id,
            order_id,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        record(row)
    }

    async fn apply_refund(
        &mut self,
        r: &NewRefund,
        refunded_amount: Decimal,
        status: PaymentStatus,
    ) -> Result<RefundRecord, StoreError> {
        let updated = sqlx::query!(
            "UPDATE payment SET refunded_amount = $2, status = $3, updated_at = $4 WHERE id = $1",
            r.payment_id,
            refunded_amount,
            status.as_str(),
            r.created_at,
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        if updated.rows_affected() != 1 {
            return Err(StoreError::NotFound);
        }
        sqlx::query_as!(
            RefundRecord,
            r#"INSERT INTO refund (id, payment_id, amount, reason, created_at)
               VALUES ($1, $2, $3, $4, $5)
               RETURNING id, payment_id, amount, reason, created_at"#,
            r.id,
            r.payment_id,
            r.amount,
            r.reason,
            r.created_at,
        )
        .fetch_one(self.connection())
        .await
        .map_err(map_sqlx_error)
    }
}

fn duration_ms(wait: Duration) -> String {
    format!("{}ms", wait.as_millis().max(1))
}

#[async_trait]
impl IdempotencyRepository for PgUnitOfWork {
    async fn claim(
        &mut self,
        c: &IdempotencyClaim,
        now: DateTime<Utc>,
        wait: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        // One round trip: bound the lock wait (set_config runs while the SELECT produces the row, before
        // the insert can wait on a concurrent claim), then claim the key or take over an expired record.
        let claimed = sqlx::query_scalar!(
            r#"INSERT INTO idempotency_record AS r (scope, key, command_hash, state, created_at, expires_at)
               SELECT $1, $2, $3, 'in_flight', $4, $5
               FROM (SELECT set_config('lock_timeout', $7, true)) AS bounded_wait
               ON CONFLICT (scope, key) DO UPDATE
                   SET command_hash = EXCLUDED.command_hash, state = 'in_flight', status_code = NULL,
                       response_headers = NULL, response_body = NULL,
                       created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
                   WHERE r.expires_at <= $6
               RETURNING 1 AS "one!""#,
            c.scope,
            c.key,
            &c.command_hash[..],
            c.created_at,
            c.expires_at,
            now,
            duration_ms(wait),
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        if claimed.is_some() {
            return Ok(ClaimOutcome::Claimed);
        }
        match IdempotencyRepository::get(self, &c.scope, &c.key).await? {
            Some(existing) => Ok(ClaimOutcome::Existing(existing)),
            None => Err(StoreError::Retryable("conflicting idempotency record vanished".into())),
        }
    }

    async fn complete(&mut self, scope: &str, key: &str, response: &StoredResponse) -> Result<(), StoreError> {
        let headers = serde_json::to_value(&response.headers)
            .map_err(|e| StoreError::Other(format!("headers not serializable: {e}")))?;
        let status =
            i16::try_from(response.status_code).map_err(|_| StoreError::Other("status code out of range".into()))?;
        let done = sqlx::query!(
            r#"UPDATE idempotency_record
               SET state = 'completed', status_code = $3, response_headers = $4, response_body = $5
               WHERE scope = $1 AND key = $2"#,
            scope,
            key,
            status,
            headers,
            response.body,
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotFound) }
    }

    async fn get(&mut self, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, StoreError> {
        let row = sqlx::query!(
            r#"SELECT scope, key, command_hash, state, status_code, response_headers, response_body,
                      created_at, expires_at
               FROM idempotency_record WHERE scope = $1 AND key = $2"#,
            scope,
            key,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        let Some(row) = row else { return Ok(None) };
        let command_hash: [u8; 32] =
            row.command_hash.try_into().map_err(|_| StoreError::Other("command_hash is not 32 bytes".into()))?;
        let state = match row.state.as_str() {
            "completed" => IdempotencyState::Completed,
            _ => IdempotencyState::InFlight,
        };
        let response = match (row.status_code, row.response_body) {
            (Some(code), Some(body)) => {
                let headers: Vec<(String, String)> = match row.response_headers {
                    Some(h) => serde_json::from_value(h)
                        .map_err(|e| StoreError::Other(format!("stored headers unreadable: {e}")))?,
                    None => Vec::new(),
                };
                let status_code =
                    u16::try_from(code).map_err(|_| StoreError::Other("stored status negative".into()))?;
                Some(StoredResponse { status_code, headers, body })
            }
            _ => None,
        };
        Ok(Some(IdempotencyRecord {
            scope: row.scope,
            key: row.key,
            command_hash,
            state,
            response,
            created_at: row.created_at,
            expires_at: row.expires_at,
        }))
    }
}

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

/// Number of key shards of the outbox (`key_shard` in the migrations); also the most advisory locks all
/// relays together hold.
pub const OUTBOX_KEY_SHARDS: i64 = 64;
/// Most shards (so most advisory locks) one claim takes: a quarter, so four relay rounds share the keys.
pub const SHARDS_PER_CLAIM: i64 = OUTBOX_KEY_SHARDS / 4;

#[async_trait]
impl OutboxRepository for PgUnitOfWork {
    async fn enqueue(&mut self, m: &NewOutboxMessage) -> Result<(), StoreError> {
        let mut headers = serde_json::Map::new();
        if let Some(tp) = &m.traceparent {
            headers.insert("traceparent".into(), serde_json::Value::String(tp.clone()));
        }
        self.wrote_outbox = true;
        sqlx::query!(
            r#"INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers,
                                          saga_id, created_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"#,
            m.id,
            m.topic,
            m.aggregate_type,
            m.aggregate_id,
            m.event_type,
            m.payload,
            serde_json::Value::Object(headers),
            m.saga_id,
            m.created_at,
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(())
    }

    async fn enqueue_many(&mut self, messages: &[NewOutboxMessage]) -> Result<(), StoreError> {
        if messages.is_empty() {
            return Ok(());
        }
        let headers: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| match &m.traceparent {
                Some(tp) => serde_json::json!({ "traceparent": tp }),
                None => serde_json::json!({}),
            })
            .collect();
        self.wrote_outbox = true;
        sqlx::query!(
            r#"INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, saga_id,
                                          created_at)
               SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[],
                                    $7::jsonb[], $8::uuid[], $9::timestamptz[])"#,
            &messages.iter().map(|m| m.id).collect::<Vec<_>>(),
            &messages.iter().map(|m| m.topic.clone()).collect::<Vec<_>>(),
            &messages.iter().map(|m| m.aggregate_type.clone()).collect::<Vec<_>>(),
            &messages.iter().map(|m| m.aggregate_id.clone()).collect::<Vec<_>>(),
            &messages.iter().map(|m| m.event_type.clone()).collect::<Vec<_>>(),
            &messages.iter().map(|m| m.payload.clone()).collect::<Vec<_>>(),
            &headers,
            &messages.iter().map(|m| m.saga_id).collect::<Vec<_>>() as &[Option<Uuid>],
            &messages.iter().map(|m| m.created_at).collect::<Vec<_>>(),
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(())
    }

    async fn claim_unpublished(&mut self, limit: i64) -> Result<Vec<OutboxRecord>, StoreError> {
        // Keys are spread over OUTBOX_KEY_SHARDS shards (`key_shard`, a hash of the key). A claim first
        // reads the shards of the oldest unpublished rows (no locks), then takes a transaction-scoped
        // advisory lock on at most SHARDS_PER_CLAIM of them, and claims the oldest rows of the shards it
        // holds. The lock function runs only over the distinct shards of a materialized set, so a claim
        // holds at most SHARDS_PER_CLAIM advisory locks whatever plan the planner picks, and all relays
        // together at most OUTBOX_KEY_SHARDS. A key belongs to one shard, so no two relays ever publish
        // one key at once, and a key's rows are claimed in `seq` order. `FOR UPDATE` (no SKIP LOCKED: a
        // skipped row would let a later row of its key overtake it) re-checks `published_at` against the
        // latest committed version. Quarantined rows, and every row of a key that has one, are skipped.
        // Prefer reading the unpublished rows in `seq` order from their index over a bitmap scan and a sort:
        // an index scan marks the entries of published (dead) rows as it passes them, so the next claims skip
        // them; a bitmap scan revisits every dead entry on every claim until VACUUM (measured: 100,000 dead
        // entries made each claim ~8 ms and the relay's p99 commit-to-publish 130 ms). Discouraging the sort
        // (not forbidding bitmap scans) leaves the planner every plan when index scans are unavailable.
        // Transaction-scoped, like everything this unit sets.
        sqlx::query("SET LOCAL enable_sort = off").execute(self.connection()).await.map_err(map_sqlx_error)?;
        let rows = sqlx::query!(
            r#"WITH candidates AS MATERIALIZED (
                   SELECT key_shard FROM outbox_message o
                   WHERE published_at IS NULL AND quarantined_at IS NULL
                     AND NOT EXISTS (SELECT 1 FROM outbox_message q WHERE q.aggregateid = o.aggregateid
                                     AND q.quarantined_at IS NOT NULL AND q.published_at IS NULL)
                   ORDER BY seq LIMIT $1
               ), held AS MATERIALIZED (
                   SELECT s.key_shard
                   FROM (SELECT DISTINCT key_shard FROM candidates) AS s
                   WHERE pg_try_advisory_xact_lock(7368, s.key_shard)
                   LIMIT $2
               )
               SELECT id, topic, aggregatetype, aggregateid, type AS "event_type", payload::text AS "payload!", headers, saga_id,
                      created_at, attempts
               FROM outbox_message o
               WHERE published_at IS NULL AND quarantined_at IS NULL AND key_shard IN (SELECT key_shard FROM held)
                 AND NOT EXISTS (SELECT 1 FROM outbox_message q WHERE q.aggregateid = o.aggregateid
                                 AND q.quarantined_at IS NOT NULL AND q.published_at IS NULL)
               ORDER BY seq
               LIMIT $1
               FOR UPDATE"#,
            limit,
            SHARDS_PER_CLAIM,
        )
        .fetch_all(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        rows.into_iter()
            .map(|r| {
                let headers = match r.headers {
                    serde_json::Value::Object(map) => {
                        map.into_iter().filter_map(|(k, v)| v.as_str().map(|v| (k, v.to_owned()))).collect()
                    }
                    _ => Vec::new(),
                };
                Ok(OutboxRecord {
                    id: r.id,
                    topic: r.topic,
                    aggregate_type: r.aggregatetype,
                    aggregate_id: r.aggregateid,
                    event_type: r.event_type,
                    payload: r.payload,
                    headers,
                    saga_id: r.saga_id,
                    created_at: r.created_at,
                    attempts: r.attempts,
                })
            })
            .collect()
    }

    async fn mark_published(
        &mut self,
        ids: &[Uuid],
        published_at: DateTime<Utc>,
        expires_at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        sqlx::query!(
            "UPDATE outbox_message SET published_at = $2, expires_at = $3, last_error = NULL WHERE id = ANY($1)",
            ids,
            published_at,
            expires_at,
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(())
    }

    async fn record_failure(&mut self, ids: &[Uuid], error: &str) -> Result<(), StoreError> {
        sqlx::query!(
            "UPDATE outbox_message SET attempts = attempts + 1, last_error = left($2, 1000) WHERE id = ANY($1)",
            ids,
            error,
        )
        .execute(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(())
    }

    async fn record_rejection(&mut self, ids: &[Uuid], error: &str, quarantine_after: i32) -> Result<u64, StoreError> {
        let quarantined = sqlx::query_scalar!(
            r#"WITH updated AS (
                   UPDATE outbox_message
                   SET attempts = attempts + 1, last_error = left($2, 1000),
                       quarantined_at = CASE WHEN attempts + 1 >= $3 THEN now() END
                   WHERE id = ANY($1) AND published_at IS NULL
                   RETURNING quarantined_at
               )
               SELECT count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS "n!" FROM updated"#,
            ids,
            error,
            quarantine_after,
        )
        .fetch_one(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(u64::try_from(quarantined).unwrap_or(0))
    }

    async fn backlog(&mut self) -> Result<i64, StoreError> {
        sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM outbox_message WHERE published_at IS NULL"#)
            .fetch_one(self.connection())
            .await
            .map_err(map_sqlx_error)
    }
}

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
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        if claimed.is_some() {
            return Ok(SagaStepClaim::Claimed);
        }
        let outcome =
            sqlx::query_scalar!("SELECT outcome FROM saga_step WHERE saga_id = $1 AND step = $2", saga_id, step,)
                .fetch_one(self.connection())
                .await
                .map_err(map_sqlx_error)?;
        Ok(SagaStepClaim::Done(outcome.unwrap_or(serde_json::Value::Null)))
    }

    async fn complete(&mut self, saga_id: Uuid, step: &str, outcome: &serde_json::Value) -> Result<(), StoreError> {
        let done =
            sqlx::query!("UPDATE saga_step SET outcome = $3 WHERE saga_id = $1 AND step = $2", saga_id, step, outcome,)
                .execute(self.connection())
                .await
                .map_err(map_sqlx_error)?;
        if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotFound) }
    }
}

#[async_trait]
impl ProjectionRepository for PgUnitOfWork {
    async fn apply_order_version(
        &mut self,
        order_id: Uuid,
        version: i64,
        status: &str,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let applied = sqlx::query_scalar!(
            r#"INSERT INTO order_projection AS o (order_id, version, status, updated_at)
               VALUES ($1, $2, $3, $4)
               ON CONFLICT (order_id) DO UPDATE
                   SET version = EXCLUDED.version, status = EXCLUDED.status, updated_at = EXCLUDED.updated_at
                   WHERE o.version < EXCLUDED.version
               RETURNING 1 AS "one!""#,
            order_id,
            version,
            status,
            now,
        )
        .fetch_optional(self.connection())
        .await
        .map_err(map_sqlx_error)?;
        Ok(applied.is_some())
    }

    async fn apply_order_versions(
        &mut self,
        versions: &[(Uuid, i64, String)],
        now: DateTime<Utc>,
    ) -> Result<Vec<Uuid>, StoreError> {
        if versions.is_empty() {
            return Ok(Vec::new());
        }
        sqlx::query_scalar!(
            r#"INSERT INTO order_projection AS o (order_id, version, status, updated_at)
               SELECT v.order_id, v.version, v.status, $4
               FROM UNNEST($1::uuid[], $2::bigint[], $3::text[]) AS v(order_id, version, status)
               ON CONFLICT (order_id) DO UPDATE
                   SET version = EXCLUDED.version, status = EXCLUDED.status, updated_at = EXCLUDED.updated_at
                   WHERE o.version < EXCLUDED.version
               RETURNING o.order_id"#,
            &versions.iter().map(|v| v.0).collect::<Vec<_>>(),
            &versions.iter().map(|v| v.1).collect::<Vec<_>>(),
            &versions.iter().map(|v| v.2.clone()).collect::<Vec<_>>(),
            now,
        )
        .fetch_all(self.connection())
        .await
        .map_err(map_sqlx_error)
    }
}
