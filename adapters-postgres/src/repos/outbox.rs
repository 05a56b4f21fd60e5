//! `OutboxRepository`: enqueue, claim by key shards, delete what was published, quarantine.

use async_trait::async_trait;
use idem_ports::{NewOutboxMessage, OutboxRecord, OutboxRepository, StoreError};
use uuid::Uuid;

use crate::PgUnitOfWork;

/// Number of key shards of the outbox (`key_shard` in the migrations); also the most advisory locks all
/// relays together hold.
pub const OUTBOX_KEY_SHARDS: i64 = 64;
/// Most shards (so most advisory locks) one claim over a backlog takes: a quarter, so four relay rounds
/// share the keys. A claim that finds less than a full batch takes every shard it found.
pub const SHARDS_PER_CLAIM: i64 = OUTBOX_KEY_SHARDS / 4;

/// The trace context stored with a row (and sent with its message): the current span's when tracing is on
/// (the request or the consumed event that wrote it, itself a child of its client's), else the client's
/// `traceparent` the use case carried.
pub(crate) fn trace_headers(m: &NewOutboxMessage, current: &[(String, String)]) -> serde_json::Value {
    let mut headers = serde_json::Map::new();
    if current.is_empty() {
        if let Some(tp) = &m.traceparent {
            headers.insert(idem_ports::trace::TRACEPARENT.into(), serde_json::Value::String(tp.clone()));
        }
    } else {
        for (k, v) in current {
            headers.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
    }
    serde_json::Value::Object(headers)
}

#[async_trait]
impl OutboxRepository for PgUnitOfWork {
    async fn enqueue(&mut self, m: &NewOutboxMessage) -> Result<(), StoreError> {
        let headers = trace_headers(m, &idem_ports::trace::current_headers());
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
            headers,
            m.saga_id,
            m.created_at,
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(())
    }

    async fn enqueue_many(&mut self, messages: &[NewOutboxMessage]) -> Result<(), StoreError> {
        if messages.is_empty() {
            return Ok(());
        }
        let current = idem_ports::trace::current_headers();
        let headers: Vec<serde_json::Value> = messages.iter().map(|m| trace_headers(m, &current)).collect();
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
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(())
    }

    async fn claim_unpublished(&mut self, limit: i64) -> Result<Vec<OutboxRecord>, StoreError> {
        // Keys are spread over OUTBOX_KEY_SHARDS shards (`key_shard`, a hash of the key). A claim first
        // reads the shards of the oldest unpublished rows (no locks), then takes a transaction-scoped
        // advisory lock on them, oldest row first, and claims the oldest rows of the shards it holds. Facing
        // a backlog (a full batch of candidates) it locks at most SHARDS_PER_CLAIM shards, leaving the rest to
        // the other workers' rounds; otherwise it locks every shard it found, so one claim takes every row
        // waiting since the last one (rows left for a follow-up claim waited a whole claim interval more).
        // Shards are tried in the order of their oldest candidate, so the oldest row is always claimed unless
        // another round holds its shard. The lock function runs only over the distinct shards of a
        // materialized set (not materialized, the planner pushed it below the sort, into the aggregate: every
        // shard found was locked), so a claim holds at most OUTBOX_KEY_SHARDS advisory locks whatever plan the
        // planner picks, and so do all relays together. A key belongs to one shard, so no two relays ever
        // publish one key at once, and a key's rows are claimed in `seq` order. Rows of a shard change only
        // under its lock (a round deletes, counts failures, quarantines), so rows read after the lock is
        // held need no row locks: a row another round published is already gone from that snapshot.
        // Quarantined rows, and every row of a key that has one, are skipped.
        // Prefer reading the unpublished rows in `seq` order from their index over a bitmap scan and a sort:
        // an index scan marks the entries of published (deleted) rows as it passes them, so the next claims skip
        // them; a bitmap scan revisits every dead entry on every claim until VACUUM (measured: 100,000 dead
        // entries made each claim ~8 ms and the relay's p99 commit-to-publish 130 ms). Discouraging the sort
        // (not forbidding bitmap scans) leaves the planner every plan when index scans are unavailable.
        // A discouraged sort still runs where nothing else can (ordering the ≤ 64 shards), but its penalty
        // cost pushes the plan past `jit_above_cost`: JIT compilation made each claim ~300 ms, so JIT is off
        // for the claim. Transaction-scoped, like everything this unit sets; one round trip for both.
        sqlx::query("SELECT set_config('enable_sort', 'off', true), set_config('jit', 'off', true)")
            .execute(self.db())
            .await
            .map_err(|e| self.failed(e))?;
        // Two statements: the rows are read with a snapshot taken after the shard locks are held. In one
        // statement the snapshot predates the locks, so a round that quarantined a key's first row and
        // committed just before the lock was taken left that key's later rows looking claimable, while
        // `FOR UPDATE` dropped the changed first row (test
        // `a_claim_racing_a_quarantine_never_takes_the_rows_behind_it`).
        let held: Vec<i32> = sqlx::query_scalar!(
            r#"WITH candidates AS MATERIALIZED (
                   SELECT key_shard, seq FROM outbox_message o
                   WHERE quarantined_at IS NULL
                     AND NOT EXISTS (SELECT 1 FROM outbox_message q WHERE q.aggregateid = o.aggregateid
                                     AND q.quarantined_at IS NOT NULL)
                   ORDER BY seq LIMIT $1
               ), shards AS MATERIALIZED (
                   SELECT key_shard FROM candidates GROUP BY key_shard ORDER BY min(seq)
               )
               SELECT key_shard AS "key_shard!" FROM shards
               WHERE pg_try_advisory_xact_lock(7368, key_shard)
               LIMIT CASE WHEN (SELECT count(*) FROM candidates) >= $1 THEN $2::bigint ELSE $3::bigint END"#,
            limit,
            SHARDS_PER_CLAIM,
            OUTBOX_KEY_SHARDS,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let rows = sqlx::query!(
            r#"SELECT id, topic, aggregatetype, aggregateid, type AS "event_type", payload::text AS "payload!",
                      headers, saga_id, created_at, attempts
               FROM outbox_message o
               WHERE quarantined_at IS NULL AND key_shard = ANY($2)
                 AND NOT EXISTS (SELECT 1 FROM outbox_message q WHERE q.aggregateid = o.aggregateid
                                 AND q.quarantined_at IS NOT NULL)
               ORDER BY seq
               LIMIT $1"#,
            limit,
            &held,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))?;
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

    async fn delete_published(&mut self, ids: &[Uuid]) -> Result<(), StoreError> {
        sqlx::query!("DELETE FROM outbox_message WHERE id = ANY($1)", ids)
            .execute(self.db())
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    async fn record_failure(&mut self, ids: &[Uuid], error: &str) -> Result<(), StoreError> {
        sqlx::query!(
            "UPDATE outbox_message SET attempts = attempts + 1, last_error = left($2, 1000) WHERE id = ANY($1)",
            ids,
            error,
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(())
    }

    async fn record_rejection(&mut self, ids: &[Uuid], error: &str, quarantine_after: i32) -> Result<u64, StoreError> {
        let quarantined = sqlx::query_scalar!(
            r#"WITH updated AS (
                   UPDATE outbox_message
                   SET attempts = attempts + 1, last_error = left($2, 1000),
                       quarantined_at = CASE WHEN attempts + 1 >= $3 THEN now() END
                   WHERE id = ANY($1)
                   RETURNING quarantined_at
               )
               SELECT count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS "n!" FROM updated"#,
            ids,
            error,
            quarantine_after,
        )
        .fetch_one(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(u64::try_from(quarantined).unwrap_or(0))
    }

    async fn backlog(&mut self) -> Result<i64, StoreError> {
        sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM outbox_message"#)
            .fetch_one(self.db())
            .await
            .map_err(|e| self.failed(e))
    }
}
