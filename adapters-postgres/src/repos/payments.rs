//! `PaymentRepository` and `ProjectionRepository`: the reference payment service's own tables.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use idem_ports::{
    NewOutboxMessage, NewPayment, NewPendingPayment, NewRefund, PaymentInsert, PaymentRecord, PaymentRepository,
    PaymentStatus, ProjectionRepository, RefundRecord, StoreError,
};
use rust_decimal::Decimal;
use uuid::Uuid;

use crate::PgUnitOfWork;

struct PaymentRow {
    id: Uuid,
    merchant_id: String,
    order_id: Uuid,
    customer_id: Uuid,
    provider: String,
    external_payment_id: Option<String>,
    amount: Decimal,
    currency: String,
    status: String,
    refunded_amount: Decimal,
    created_at: DateTime<Utc>,
    through_provider: bool,
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
            through_provider: r.through_provider,
        })
    }
}

fn record(row: Option<PaymentRow>) -> Result<Option<PaymentRecord>, StoreError> {
    row.map(PaymentRecord::try_from).transpose()
}

impl PgUnitOfWork {
    /// `PaymentUnitOfWork::insert_announced` in one statement: the payment's insert and, only for a new
    /// payment, its announcement's (a data-modifying CTE reading the insert's RETURNING); an existing
    /// payment is read as `insert_or_get` does.
    pub(crate) async fn insert_announced_pg(
        &mut self,
        p: &NewPayment,
        m: &NewOutboxMessage,
    ) -> Result<PaymentInsert, StoreError> {
        let headers = super::outbox::trace_headers(m, &idem_ports::trace::current_headers());
        let inserted = sqlx::query_as!(
            PaymentRow,
            r#"WITH inserted AS (
                   INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id,
                                        amount, currency, status, created_at, updated_at)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10)
                   ON CONFLICT (provider, external_payment_id) DO NOTHING
                   RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                             currency, status, refunded_amount, created_at, through_provider
               ), announced AS (
                   INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers,
                                               saga_id, created_at)
                   SELECT $11, $12, $13, $14, $15, $16, $17, $18, $19 FROM inserted
               )
               SELECT id AS "id!", merchant_id AS "merchant_id!", order_id AS "order_id!",
                      customer_id AS "customer_id!", provider AS "provider!", external_payment_id,
                      amount AS "amount!", currency AS "currency!", status AS "status!",
                      refunded_amount AS "refunded_amount!", created_at AS "created_at!",
                      through_provider AS "through_provider!"
               FROM inserted"#,
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
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        match inserted {
            Some(row) => {
                self.wrote_outbox = true;
                Ok(PaymentInsert::Inserted(row.try_into()?))
            }
            None => self.existing_payment(p).await,
        }
    }

    /// The committed payment a `(provider, external_payment_id)` insert conflicted with (`ON CONFLICT`
    /// waited for its transaction, and this new statement sees it under READ COMMITTED).
    async fn existing_payment(&mut self, p: &NewPayment) -> Result<PaymentInsert, StoreError> {
        let existing = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at, through_provider
               FROM payment WHERE provider = $1 AND external_payment_id = $2"#,
            p.provider,
            p.external_payment_id,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        match record(existing)? {
            Some(p) => Ok(PaymentInsert::Existing(p)),
            None => Err(StoreError::Retryable("conflicting payment vanished".into())),
        }
    }
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
                         currency AS "currency!", status, refunded_amount, created_at, through_provider"#,
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
        .fetch_one(self.db())
        .await
        .map_err(|e| self.failed(e))?
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
                         currency AS "currency!", status, refunded_amount, created_at, through_provider"#,
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
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        match inserted {
            Some(row) => Ok(PaymentInsert::Inserted(row.try_into()?)),
            None => self.existing_payment(p).await,
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
                         currency AS "currency!", status, refunded_amount, created_at, through_provider"#,
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
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))?;
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
                          p.currency AS "currency!", p.status, p.refunded_amount, p.created_at, p.through_provider
                   FROM payment p
                   JOIN UNNEST($1::text[], $2::text[]) AS k(provider, external_payment_id)
                     ON p.provider = k.provider AND p.external_payment_id = k.external_payment_id"#,
                &providers,
                &externals,
            )
            .fetch_all(self.db())
            .await
            .map_err(|e| self.failed(e))?;
            for row in rows {
                let rec = PaymentRecord::try_from(row)?;
                let external = rec.external_payment_id.clone().unwrap_or_default();
                existing.insert((rec.provider.clone(), external), rec);
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
                      currency AS "currency!", status, refunded_amount, created_at, through_provider
               FROM payment WHERE id = $1"#,
            id,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        record(row)
    }

    async fn get_for_update(
        &mut self,
        id: Uuid,
        merchant_id: Option<String>,
    ) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at, through_provider
               FROM payment WHERE id = $1 AND ($2::text IS NULL OR merchant_id = $2) FOR UPDATE"#,
            id,
            merchant_id,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
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
                      currency AS "currency!", status, refunded_amount, created_at, through_provider
               FROM payment WHERE merchant_id = $1 AND order_id = $2
               ORDER BY created_at DESC, id DESC LIMIT 1 FOR UPDATE"#,
            merchant_id,
            order_id,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        record(row)
    }

    async fn insert_pending(&mut self, p: &NewPendingPayment) -> Result<PaymentRecord, StoreError> {
        // ON CONFLICT (id) DO UPDATE touches nothing but makes the existing row (a resumed attempt's) come back
        sqlx::query_as!(
            PaymentRow,
            r#"INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id,
                                   amount, currency, status, created_at, updated_at, through_provider)
               VALUES ($1, $2, $3, $4, $5, NULL, $6, $7, 'pending', $8, $8, true)
               ON CONFLICT (id) DO UPDATE SET id = payment.id
               RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency AS "currency!", status, refunded_amount, created_at, through_provider"#,
            p.id,
            p.merchant_id,
            p.order_id,
            p.customer_id,
            p.provider,
            p.amount,
            p.currency,
            p.created_at,
        )
        .fetch_one(self.db())
        .await
        .map_err(|e| self.failed(e))?
        .try_into()
    }

    async fn capture(
        &mut self,
        id: Uuid,
        external_payment_id: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"UPDATE payment SET status = 'captured', external_payment_id = $2, updated_at = $3
               WHERE id = $1 AND status = 'pending'
               RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency AS "currency!", status, refunded_amount, created_at, through_provider"#,
            id,
            external_payment_id,
            now,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        record(row)
    }

    async fn decline(&mut self, id: Uuid, now: DateTime<Utc>) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"UPDATE payment SET status = 'declined', updated_at = $2
               WHERE id = $1 AND status = 'pending'
               RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                         currency AS "currency!", status, refunded_amount, created_at, through_provider"#,
            id,
            now,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        record(row)
    }

    async fn charged_through_provider_since(
        &mut self,
        provider: &str,
        since: DateTime<Utc>,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<PaymentRecord>, StoreError> {
        let rows = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at, through_provider
               FROM payment
               WHERE provider = $1 AND created_at >= $2 AND (through_provider OR substr(id::text, 15, 1) = '8')
                 AND status IN ('captured', 'partially_refunded', 'refunded') AND ($3::uuid IS NULL OR id > $3)
               ORDER BY id
               LIMIT $4"#,
            provider,
            since,
            after,
            limit,
        )
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        rows.into_iter().map(PaymentRecord::try_from).collect()
    }

    async fn get_refund(&mut self, id: Uuid) -> Result<Option<RefundRecord>, StoreError> {
        sqlx::query_as!(RefundRecord, "SELECT id, payment_id, amount, reason, created_at FROM refund WHERE id = $1", id)
            .fetch_optional(self.db())
            .await
            .map_err(|e| self.failed(e))
    }

    async fn get_by_external_for_update(
        &mut self,
        provider: &str,
        external_payment_id: &str,
    ) -> Result<Option<PaymentRecord>, StoreError> {
        let row = sqlx::query_as!(
            PaymentRow,
            r#"SELECT id, merchant_id, order_id, customer_id, provider, external_payment_id, amount,
                      currency AS "currency!", status, refunded_amount, created_at, through_provider
               FROM payment WHERE provider = $1 AND external_payment_id = $2 FOR UPDATE"#,
            provider,
            external_payment_id,
        )
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        record(row)
    }

    async fn record_provider_event(
        &mut self,
        provider: &str,
        event_id: &str,
        kind: &str,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let recorded = sqlx::query!(
            "INSERT INTO provider_event (provider, event_id, type, received_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
            provider,
            event_id,
            kind,
            now,
        )
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
        Ok(recorded.rows_affected() == 1)
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
        .execute(self.db())
        .await
        .map_err(|e| self.failed(e))?;
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
        .fetch_one(self.db())
        .await
        .map_err(|e| self.failed(e))
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
        .fetch_optional(self.db())
        .await
        .map_err(|e| self.failed(e))?;
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
        .fetch_all(self.db())
        .await
        .map_err(|e| self.failed(e))
    }
}
