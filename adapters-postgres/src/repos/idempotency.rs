//! `IdempotencyRepository`: claim, complete and read idempotency records.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{
    ClaimOutcome, HeldCall, HeldRequest, IdempotencyClaim, IdempotencyRecord, IdempotencyRepository, IdempotencyState,
    LapsedRecord, PhaseHold, StoreError, StoredRequest, StoredResponse, TakeOver,
};

use crate::PgUnitOfWork;

/// An attempt number as its column holds it.
fn attempt_column(attempt: u32) -> Result<i32, StoreError> {
    i32::try_from(attempt).map_err(|_| StoreError::Other("attempt out of range".into()))
}

/// A response's status and headers as their columns hold them.
fn response_columns(response: &StoredResponse) -> Result<(i16, serde_json::Value), StoreError> {
    let headers = serde_json::to_value(&response.headers)
        .map_err(|e| StoreError::Other(format!("headers not serializable: {e}")))?;
    let status =
        i16::try_from(response.status_code).map_err(|_| StoreError::Other("status code out of range".into()))?;
    Ok((status, headers))
}

fn duration_ms(wait: Duration) -> String {
    format!("{}ms", wait.as_millis().max(1))
}

impl PgUnitOfWork {
    /// The live record a claim or an insert at commit found in its way (committed: the conflict waited for
    /// its transaction, and this new statement sees it under READ COMMITTED).
    async fn existing(&mut self, c: &IdempotencyClaim) -> Result<ClaimOutcome, StoreError> {
        match IdempotencyRepository::get(self, &c.scope, &c.key).await? {
            Some(existing) => Ok(ClaimOutcome::Existing(existing)),
            None => Err(StoreError::Retryable("conflicting idempotency record vanished".into())),
        }
    }
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
        // the insert can wait on a concurrent claim), then claim the key or take over an expired record, and
        // once it is claimed put the session's own lock_timeout back (`set_config(…, NULL, true)` is `SET
        // LOCAL … TO DEFAULT`): the handler's statements in this transaction wait on rows as they would anywhere.
        let claimed = sqlx::query_scalar!(
            r#"INSERT INTO idempotency_record AS r (scope, key, command_hash, state, created_at, expires_at,
                                                 generation)
               SELECT $1, $2, $3, 'in_flight', $4, $5, $8
               FROM (SELECT set_config('lock_timeout', $7, true)) AS bounded_wait
               ON CONFLICT (scope, key) DO UPDATE
                   SET command_hash = EXCLUDED.command_hash, state = 'in_flight', status_code = NULL,
                       generation = EXCLUDED.generation,
                       response_headers = NULL, response_body = NULL,
                       created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at,
                       -- the row as a fresh claim inserts it (as after the cleaner): the expired request's
                       -- attempt and lease would refuse this one's first hold as "taken over"
                       attempt = 0, lease_until = NULL, not_before = NULL, recovery_point = NULL, request_method = NULL,
                       request_uri = NULL, request_content_type = NULL, request_body = NULL,
                       completer_runs = 0, parked_at = NULL, parked_reason = NULL
                   WHERE r.expires_at <= $6 AND (r.state = 'completed' OR r.lease_until IS NULL)
               RETURNING set_config('lock_timeout', NULL, true) IS NOT NULL AS "reset!""#,
            c.scope,
            c.key,
            &c.command_hash[..],
            c.created_at,
            c.expires_at,
            now,
            duration_ms(wait),
            c.created_at.timestamp_micros(),
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if claimed.is_some() { Ok(ClaimOutcome::Claimed) } else { self.existing(c).await }
    }

    async fn complete(&mut self, scope: &str, key: &str, response: &StoredResponse) -> Result<(), StoreError> {
        let (status, headers) = response_columns(response)?;
        let done = sqlx::query!(
            r#"UPDATE idempotency_record
               SET state = 'completed', status_code = $3, response_headers = $4, response_body = $5,
                   -- held between phases: its retention counts from completion; the request is not needed
                   expires_at = CASE WHEN lease_until IS NULL THEN expires_at
                                     ELSE expires_at + greatest(now() - created_at, interval '0') END,
                   request_body = NULL, parked_at = NULL
               WHERE scope = $1 AND key = $2"#,
            scope,
            key,
            status,
            headers,
            response.body,
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if done.rows_affected() == 1 { Ok(()) } else { Err(StoreError::NotFound) }
    }

    async fn insert_completed(
        &mut self,
        c: &IdempotencyClaim,
        response: &StoredResponse,
        now: DateTime<Utc>,
        wait: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let (status, headers) = response_columns(response)?;
        // One statement, one tuple: the record written once, completed, where `claim` + `complete` write
        // it twice (the second a non-HOT update: `state` is in the held-records index's predicate). The
        // lock wait on a concurrent uncommitted record is bounded as in `claim`; an expired record is
        // replaced under the same condition, its phase columns cleared.
        let inserted = sqlx::query_scalar!(
            r#"INSERT INTO idempotency_record AS r (scope, key, command_hash, state, status_code, response_headers,
                                                 response_body, created_at, expires_at)
               SELECT $1, $2, $3, 'completed', $8, $9, $10, $4, $5
               FROM (SELECT set_config('lock_timeout', $7, true)) AS bounded_wait
               ON CONFLICT (scope, key) DO UPDATE
                   SET command_hash = EXCLUDED.command_hash, state = 'completed',
                       status_code = EXCLUDED.status_code, response_headers = EXCLUDED.response_headers,
                       response_body = EXCLUDED.response_body, created_at = EXCLUDED.created_at,
                       expires_at = EXCLUDED.expires_at, attempt = 0, lease_until = NULL, not_before = NULL,
                       recovery_point = NULL, request_method = NULL, request_uri = NULL,
                       request_content_type = NULL, request_body = NULL, completer_runs = 0, parked_at = NULL,
                       parked_reason = NULL
                   WHERE r.expires_at <= $6 AND (r.state = 'completed' OR r.lease_until IS NULL)
               RETURNING set_config('lock_timeout', NULL, true) IS NOT NULL AS "reset!""#,
            c.scope,
            c.key,
            &c.command_hash[..],
            c.created_at,
            c.expires_at,
            now,
            duration_ms(wait),
            status,
            headers,
            response.body,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if inserted.is_some() { Ok(ClaimOutcome::Claimed) } else { self.existing(c).await }
    }

    async fn get(&mut self, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, StoreError> {
        let row = read(self.db(), scope, key).await.map_err(|e| self.failed(e))?;
        row.map(RecordRow::into_record).transpose()
    }

    async fn hold(&mut self, scope: &str, key: &str, hold: &PhaseHold) -> Result<bool, StoreError> {
        let attempt = attempt_column(hold.attempt)?;
        // the first hold of a claim (attempt 0 in the row) or a renewal by the attempt that holds it
        let request = hold.request.as_ref();
        let held = sqlx::query!(
            r#"UPDATE idempotency_record SET attempt = $3,
                      lease_until = clock_timestamp() + make_interval(secs => $4::float8), recovery_point = $5,
                      request_method = coalesce($6, request_method), request_uri = coalesce($7, request_uri),
                      request_content_type = CASE WHEN $6::text IS NULL THEN request_content_type ELSE $8 END,
                      request_body = coalesce($9, request_body)
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt IN ($3, $3 - 1)
                 AND (attempt = $3 OR lease_until IS NULL) AND parked_at IS NULL"#,
            scope,
            key,
            attempt,
            hold.lease.as_secs_f64(),
            hold.recovery_point,
            request.map(|r| r.method.as_str()),
            request.map(|r| r.uri.as_str()),
            request.and_then(|r| r.content_type.as_deref()),
            request.map(|r| r.body.as_slice()),
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(held.rows_affected() == 1)
    }

    async fn take_over(
        &mut self,
        scope: &str,
        key: &str,
        attempt: u32,
        lease: Duration,
        window: Option<Duration>,
    ) -> Result<TakeOver, StoreError> {
        let attempt = attempt_column(attempt)?;
        // both instants on the database's clock: a host whose clock is ahead cannot take over a live lease;
        // taken, the claim's bounded lock wait is put back to the session's (the handler runs next)
        let taken = sqlx::query!(
            r#"UPDATE idempotency_record
               SET attempt = attempt + 1, lease_until = clock_timestamp() + make_interval(secs => $4::float8),
                   not_before = NULL
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt = $3
                 AND lease_until <= clock_timestamp() AND (not_before IS NULL OR not_before <= clock_timestamp())
                 AND parked_at IS NULL
               RETURNING set_config('lock_timeout', NULL, true) IS NOT NULL AS "reset!",
                         coalesce(created_at + make_interval(secs => $5::float8) <= clock_timestamp(), false)
                             AS "past_window!""#,
            scope,
            key,
            attempt,
            lease.as_secs_f64(),
            window.map(|w| w.as_secs_f64()),
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if let Some(taken) = taken {
            return Ok(TakeOver::Taken { past_window: taken.past_window });
        }
        let why = sqlx::query!(
            r#"SELECT parked_at IS NOT NULL AS "parked!",
                      CASE WHEN lease_until <= clock_timestamp() AND not_before > clock_timestamp()
                           THEN extract(epoch FROM not_before - clock_timestamp())::float8 END AS wait
               FROM idempotency_record
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt = $3"#,
            scope,
            key,
            attempt,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(match why {
            Some(r) if r.parked => TakeOver::Parked,
            Some(r) => {
                r.wait.map_or(TakeOver::Held, |secs| TakeOver::NotBefore(Duration::from_secs_f64(secs.max(0.0))))
            }
            None => TakeOver::Held,
        })
    }

    async fn defer(&mut self, scope: &str, key: &str, attempt: u32, wait: Duration) -> Result<bool, StoreError> {
        let attempt = attempt_column(attempt)?;
        let deferred = sqlx::query!(
            r#"UPDATE idempotency_record
               SET lease_until = clock_timestamp(),
                   not_before = clock_timestamp() + make_interval(secs => $4::float8)
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt = $3"#,
            scope,
            key,
            attempt,
            wait.as_secs_f64(),
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(deferred.rows_affected() == 1)
    }

    async fn lease_left(&mut self, scope: &str, key: &str, attempt: u32) -> Result<Option<Duration>, StoreError> {
        let attempt = attempt_column(attempt)?;
        let left = sqlx::query_scalar!(
            r#"SELECT extract(epoch FROM lease_until - clock_timestamp())::float8 AS "left!"
               FROM idempotency_record
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt = $3 AND parked_at IS NULL
                 AND lease_until > clock_timestamp()"#,
            scope,
            key,
            attempt,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(left.map(|secs| Duration::from_secs_f64(secs.max(0.0))))
    }

    async fn owns(&mut self, scope: &str, key: &str, attempt: u32) -> Result<bool, StoreError> {
        let attempt = attempt_column(attempt)?;
        let owned = sqlx::query_scalar!(
            r#"SELECT true AS "owned!" FROM idempotency_record
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt = $3 FOR UPDATE"#,
            scope,
            key,
            attempt,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(owned.is_some())
    }

    async fn lapsed(
        &mut self,
        now: DateTime<Utc>,
        grace: Duration,
        max_backoff: Duration,
        limit: i64,
    ) -> Result<Vec<LapsedRecord>, StoreError> {
        let rows = sqlx::query!(
            r#"SELECT r.scope, r.key, r.request_method, r.request_uri, r.request_content_type, r.request_body,
                      r.created_at, r.completer_runs
               FROM idempotency_record r
               JOIN (SELECT scope, key, row_number() OVER (PARTITION BY scope ORDER BY created_at) AS turn
                     FROM idempotency_record
                     WHERE state = 'in_flight' AND lease_until IS NOT NULL AND parked_at IS NULL
                       AND lease_until <= $1::timestamptz - make_interval(secs => least($2::float8 * power(2, least(completer_runs, 30)), $3::float8))
                       AND (not_before IS NULL OR not_before <= clock_timestamp())) AS due
                 ON due.scope = r.scope AND due.key = r.key
               WHERE r.state = 'in_flight' AND r.parked_at IS NULL
               -- round-robin over scopes: each scope's oldest first, then each one's second, …
               ORDER BY due.turn, r.created_at
               LIMIT $4
               FOR UPDATE OF r SKIP LOCKED"#,
            now,
            grace.as_secs_f64(),
            max_backoff.as_secs_f64(),
            limit,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(rows
            .into_iter()
            .map(|r| LapsedRecord {
                request: match (r.request_method, r.request_uri, r.request_body) {
                    (Some(method), Some(uri), Some(body)) => {
                        Some(StoredRequest { method, uri, content_type: r.request_content_type, body })
                    }
                    _ => None,
                },
                scope: r.scope,
                key: r.key,
                created_at: r.created_at,
                completer_runs: u32::try_from(r.completer_runs).unwrap_or_default(),
            })
            .collect())
    }

    async fn cancel_unstarted(
        &mut self,
        scope: &str,
        key: &str,
        response: &StoredResponse,
    ) -> Result<Option<HeldCall>, StoreError> {
        let (status, headers) = response_columns(response)?;
        // attempt 0: held by `enqueue_held` and never taken over, so never sent
        let cancelled = sqlx::query_scalar!(
            r#"UPDATE idempotency_record
               SET state = 'completed', status_code = $3, response_headers = $4, response_body = $5,
                   lease_until = NULL, not_before = NULL, recovery_point = NULL
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND attempt = 0
               RETURNING 1 AS "one!""#,
            scope,
            key,
            status,
            headers,
            response.body,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        if cancelled.is_some() {
            return Ok(Some(HeldCall::Cancelled));
        }
        let held = sqlx::query_scalar!(
            r#"SELECT true AS "held!" FROM idempotency_record
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' FOR UPDATE"#,
            scope,
            key,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(held.map(|_| HeldCall::InProgress))
    }

    async fn held_with_field(
        &mut self,
        scope: &str,
        key_prefix: &str,
        uri: &str,
        field: &str,
        value: &str,
    ) -> Result<Vec<String>, StoreError> {
        let pattern = format!("{}%", key_prefix.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_"));
        let keys = sqlx::query_scalar!(
            r#"SELECT key FROM idempotency_record
               WHERE scope = $1 AND state = 'in_flight' AND key LIKE $2 AND request_uri = $3
                 AND convert_from(request_body, 'UTF8')::jsonb ->> $4 = $5"#,
            scope,
            pattern,
            uri,
            field,
            value,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(keys)
    }

    async fn enqueue_held(&mut self, held: &HeldRequest) -> Result<bool, StoreError> {
        // attempt 0 with a lease lapsed long before (no client to wait for): the completer takes it over as
        // attempt 1 at its next round
        let inserted = sqlx::query!(
            r#"INSERT INTO idempotency_record (scope, key, command_hash, state, created_at, expires_at, attempt,
                                               lease_until, recovery_point, request_method, request_uri,
                                               request_content_type, request_body, generation)
               VALUES ($1, $2, $3, 'in_flight', $4, $5, 0, $4::timestamptz - interval '1 day', 'held', $6, $7, $8, $9,
                       $10)
               ON CONFLICT (scope, key) DO NOTHING"#,
            held.scope,
            held.key,
            &held.command_hash[..],
            held.created_at,
            held.expires_at,
            held.request.method,
            held.request.uri,
            held.request.content_type,
            held.request.body,
            held.created_at.timestamp_micros(),
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(inserted.rows_affected() == 1)
    }

    async fn completer_ran(&mut self, scope: &str, key: &str) -> Result<(), StoreError> {
        sqlx::query!(
            "UPDATE idempotency_record SET completer_runs = completer_runs + 1 WHERE scope = $1 AND key = $2",
            scope,
            key,
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(())
    }

    async fn park(&mut self, scope: &str, key: &str, reason: &str, now: DateTime<Utc>) -> Result<bool, StoreError> {
        let parked = sqlx::query!(
            r#"UPDATE idempotency_record SET parked_at = $3, parked_reason = $4
               WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND lease_until IS NOT NULL"#,
            scope,
            key,
            now,
            reason,
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(parked.rows_affected() == 1)
    }
}

/// A row of `idempotency_record`.
pub(crate) struct RecordRow {
    scope: String,
    key: String,
    command_hash: Vec<u8>,
    state: String,
    status_code: Option<i16>,
    response_headers: Option<serde_json::Value>,
    response_body: Option<Vec<u8>>,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    attempt: i32,
    lease_until: Option<DateTime<Utc>>,
    not_before: Option<DateTime<Utc>>,
    generation: Option<i64>,
    recovery_point: Option<String>,
}

/// Reads the record of `(scope, key)`, expired or not, on `conn` (in a transaction or not).
pub(crate) async fn read(
    conn: &mut sqlx::PgConnection,
    scope: &str,
    key: &str,
) -> Result<Option<RecordRow>, sqlx::Error> {
    Ok(read_with_standby(conn, scope, key).await?.map(|(record, _)| record))
}

/// [`read`], with whether a synchronous standby is configured: the replay fast path needs both, and on a
/// server without a standby a replay then costs this read alone (`replication.rs`; the setting is a lookup
/// in the session, no round trip).
pub(crate) async fn read_with_standby(
    conn: &mut sqlx::PgConnection,
    scope: &str,
    key: &str,
) -> Result<Option<(RecordRow, bool)>, sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT scope, key, command_hash, state, status_code, response_headers, response_body,
                  created_at, expires_at, attempt, lease_until, not_before, generation, recovery_point,
                  current_setting('synchronous_standby_names') <> '' AS "synchronous!"
           FROM idempotency_record WHERE scope = $1 AND key = $2"#,
        scope,
        key,
    )
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|r| {
        let record = RecordRow {
            scope: r.scope,
            key: r.key,
            command_hash: r.command_hash,
            state: r.state,
            status_code: r.status_code,
            response_headers: r.response_headers,
            response_body: r.response_body,
            created_at: r.created_at,
            expires_at: r.expires_at,
            attempt: r.attempt,
            lease_until: r.lease_until,
            not_before: r.not_before,
            generation: r.generation,
            recovery_point: r.recovery_point,
        };
        (record, r.synchronous)
    }))
}

impl RecordRow {
    pub(crate) fn into_record(self) -> Result<IdempotencyRecord, StoreError> {
        let command_hash: [u8; 32] =
            self.command_hash.try_into().map_err(|_| StoreError::Other("command_hash is not 32 bytes".into()))?;
        let state = match self.state.as_str() {
            "completed" => IdempotencyState::Completed,
            _ => IdempotencyState::InFlight,
        };
        let response = match (self.status_code, self.response_body) {
            (Some(code), Some(body)) => {
                let headers: Vec<(String, String)> = match self.response_headers {
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
        Ok(IdempotencyRecord {
            scope: self.scope,
            key: self.key,
            command_hash,
            state,
            response,
            created_at: self.created_at,
            expires_at: self.expires_at,
            phase: match (self.lease_until, self.recovery_point) {
                (Some(lease_until), Some(recovery_point)) if state == IdempotencyState::InFlight => Some(PhaseHold {
                    attempt: u32::try_from(self.attempt).unwrap_or_default(),
                    lease_until,
                    lease: Duration::ZERO,
                    not_before: self.not_before,
                    generation: self.generation,
                    recovery_point,
                    request: None,
                }),
                _ => None,
            },
        })
    }
}
